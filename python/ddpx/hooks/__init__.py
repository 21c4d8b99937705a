"""DDP communication hooks with torch's names, arguments and defaults, run by native C++ code.

Every hook here is a plain Python function that ``DistributedDataParallel.register_comm_hook``
accepts (drop-in), and also carries the factory of its C++ object so that
:func:`register_comm_hook` can hand that object to DDP's C++ Reducer (native path).

The modules follow torch's ``torch.distributed.algorithms.ddp_comm_hooks``, each family's state
beside its hooks: ``default_hooks`` (the default hooks, the compress wrappers, ``noop_hook``),
``powerSGD_hook``, ``post_localSGD_hook``, ``quantization_hooks``, ddpx's ``quantized_hook``
(quantized gradients with error feedback) and ``ddp_zero_hook`` (ZeRO's
overlap with DDP), and
ddpx's own ``zero_reduce_scatter_hook`` (ZeRO-2 style gradient sharding);
``ddpx._native`` is the machinery they share with the model averagers (see its
docstring for the state protocol a new hook's state implements). As before, the attributes
``ddpx.hooks.powerSGD_hook`` and ``ddpx.hooks.post_localSGD_hook`` are the hook *functions*;
import the modules of the same name with ``from ddpx.hooks.powerSGD_hook import ...``.
"""
from .._native import native_hook, register_comm_hook
from ._hook_type import DDPCommHookType, register_ddp_comm_hook
from .ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved
from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    noop_hook,
)
from .post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from .powerSGD_hook import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from .quantization_hooks import quantization_perchannel_hook, quantization_pertensor_hook
from .quantized_hook import QuantizedState, quantized_hook
from .zero_reduce_scatter_hook import reduce_scatter_hook

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "noop_hook",
    "PowerSGDState",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "PostLocalSGDState",
    "post_localSGD_hook",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "reduce_scatter_hook",
    "quantization_pertensor_hook",
    "quantization_perchannel_hook",
    "QuantizedState",
    "quantized_hook",
    "register_comm_hook",
    "DDPCommHookType",
    "register_ddp_comm_hook",
    "native_hook",
]
