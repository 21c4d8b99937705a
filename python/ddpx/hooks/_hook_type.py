"""torch's ``DDPCommHookType`` and ``register_ddp_comm_hook``
(``torch.distributed.algorithms.ddp_comm_hooks``), with ddpx's hooks behind every member.

Each member's value is, as in torch, a ``functools.partial`` called as
``member.value(model=model, state=state)`` (PowerSGD's also take ``start_powerSGD_iter``), so
that code written against torch's enum, torch's own ``register_ddp_comm_hook`` included, works
with this one unchanged. A DDP model gets the hook natively (:func:`ddpx.register_comm_hook`:
the C++ hook object goes straight into DDP's Reducer); anything else gets it through its own
``register_comm_hook(state, hook)``, as torch's wrapper does.
"""
import enum
import functools
import sys
from typing import Any

import torch

from .._native import HookFn, register_comm_hook
from .default_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook
from .powerSGD_hook import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from .quantization_hooks import quantization_perchannel_hook, quantization_pertensor_hook
from .quantized_hook import QuantizedState, quantized_hook

__all__ = ["DDPCommHookType", "register_ddp_comm_hook"]

# Python 3.13 makes a functools.partial in an Enum body a method (with a FutureWarning from
# 3.13 on) unless wrapped in enum.member, which exists from 3.11 on.
if sys.version_info >= (3, 11):
    _enum_member = enum.member
else:  # pragma: no cover - 3.10 and older: a partial is a member as it is
    def _enum_member(value: Any) -> Any:
        return value


def _register_hook(comm_hook: HookFn, model: Any, state: Any) -> None:
    """Registers ``comm_hook`` (a ddpx hook) on ``model`` with ``state``: natively on a DDP
    model, else through ``model.register_comm_hook``, as torch's ``_ddp_comm_hook_wrapper``."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        register_comm_hook(model, state, comm_hook)
    else:
        model.register_comm_hook(state, comm_hook)


def _register_with_state(comm_hook: HookFn, model: Any, state: Any, state_class: type,
                         **options: Any) -> None:
    """Registers ``comm_hook`` with ``state_class(process_group=state, **options)`` as its state:
    the members of a hook that keeps a state take a process group (or None) like the others, and
    the options the member fixes (torch's PowerSGD wrapper does the same)."""
    _register_hook(comm_hook, model, state_class(process_group=state, **options))


def _register_powerSGD_hook(comm_hook: HookFn, model: Any, state: Any,
                            matrix_approximation_rank: int,
                            start_powerSGD_iter: int = 1_000) -> None:
    """torch's ``_powerSGD_comm_hook_wrapper`` with ddpx's ``PowerSGDState``: the same
    arguments, so that ``member.value(model=m, state=pg, start_powerSGD_iter=10)`` works as with
    torch's enum. The other options keep ``PowerSGDState``'s defaults, as in torch."""
    _register_with_state(comm_hook, model, state, PowerSGDState,
                         matrix_approximation_rank=matrix_approximation_rank,
                         start_powerSGD_iter=start_powerSGD_iter)


def _quantized_member(bits: int) -> Any:
    return _enum_member(functools.partial(_register_with_state, comm_hook=quantized_hook,
                                          state_class=QuantizedState, bits=bits))


def _hook_member(comm_hook: HookFn) -> Any:
    return _enum_member(functools.partial(_register_hook, comm_hook=comm_hook))


def _powerSGD_member(comm_hook: HookFn, matrix_approximation_rank: int) -> Any:
    return _enum_member(functools.partial(_register_powerSGD_hook, comm_hook=comm_hook,
                                          matrix_approximation_rank=matrix_approximation_rank))


class DDPCommHookType(enum.Enum):
    """The communication hooks of ddpx by name, as torch's
    :class:`torch.distributed.algorithms.ddp_comm_hooks.DDPCommHookType`: every member of
    torch's, with ddpx's hook of the same name behind it. Register one with
    :func:`register_ddp_comm_hook` or, as with torch,
    ``DDPCommHookType.ALLREDUCE.value(model=model, state=process_group)``.

    ========================== ===================================================================
    member                     ddpx hook (state: a ProcessGroup, or None for the default group)
    ========================== ===================================================================
    ALLREDUCE                  ``allreduce_hook``: torch's result bit for bit (fp32)
    FP16_COMPRESS              ``fp16_compress_hook``: within fp16 rounding of torch's (ddpx
                               divides before the cast and sums in fp32 on Gloo)
    BF16_COMPRESS              ``bf16_compress_hook``, also on Gloo and CPU
    QUANTIZE_PER_TENSOR        ``quantization_pertensor_hook``: torch's result bit for bit
    QUANTIZE_PER_CHANNEL       ``quantization_perchannel_hook`` (channels of 512): bit for bit
    POWER_SGD                  ``powerSGD_hook`` with ``PowerSGDState(process_group=state,
                               matrix_approximation_rank=1, start_powerSGD_iter=1000)``
    POWER_SGD_RANK2            the same with ``matrix_approximation_rank=2``
    BATCHED_POWER_SGD          ``batched_powerSGD_hook``, rank 1
    BATCHED_POWER_SGD_RANK2    ``batched_powerSGD_hook``, rank 2
    NOOP                       ``noop_hook``: no communication (for measurements only)
    QUANTIZED_8BIT             ddpx's ``quantized_hook`` with ``QuantizedState(process_group=state,
                               bits=8)`` (error feedback, blocks of 256, from iteration 10)
    QUANTIZED_4BIT             the same with ``bits=4``
    QUANTIZED_2BIT             the same with ``bits=2``
    QUANTIZED_1BIT             the same with ``bits=1`` (signs)
    ========================== ===================================================================

    The other hooks of ddpx have no member: ``post_localSGD_hook`` needs a ``subgroup`` and a
    ``start_localSGD_iter`` that no default fits, and ``reduce_scatter_hook`` (like
    ``hook_with_zero_step``) takes a ``ZeroRedundancyOptimizer`` as its state, not a process
    group. A member's value takes the state's options as keywords, as torch's PowerSGD members
    do: ``DDPCommHookType.QUANTIZED_4BIT.value(model=m, state=None, block_size=128)``.

    Example::
        >>> ddpx.hooks.register_ddp_comm_hook(DDPCommHookType.POWER_SGD, ddp_model)
        >>> # torch's options through the member's value, as with torch's enum:
        >>> DDPCommHookType.POWER_SGD.value(model=ddp_model, state=None, start_powerSGD_iter=10)
    """

    # torch's members, in torch's order.
    #: ``allreduce_hook``: the mean of the gradients, torch's bits (fp32).
    ALLREDUCE = _hook_member(allreduce_hook)
    #: ``fp16_compress_hook``: the gradients travel as fp16.
    FP16_COMPRESS = _hook_member(fp16_compress_hook)
    #: ``bf16_compress_hook``: the gradients travel as bf16 (Gloo and CPU too).
    BF16_COMPRESS = _hook_member(bf16_compress_hook)
    #: ``quantization_pertensor_hook``: uint8 with one scale per bucket.
    QUANTIZE_PER_TENSOR = _hook_member(quantization_pertensor_hook)
    #: ``quantization_perchannel_hook``: uint8 with a scale per 512 values.
    QUANTIZE_PER_CHANNEL = _hook_member(quantization_perchannel_hook)
    #: ``powerSGD_hook``, rank 1, compressing from iteration 1000.
    POWER_SGD = _powerSGD_member(powerSGD_hook, 1)
    #: ``powerSGD_hook``, rank 2: more accurate than rank 1, and slower.
    POWER_SGD_RANK2 = _powerSGD_member(powerSGD_hook, 2)
    #: ``batched_powerSGD_hook``, rank 1.
    BATCHED_POWER_SGD = _powerSGD_member(batched_powerSGD_hook, 1)
    #: ``batched_powerSGD_hook``, rank 2.
    BATCHED_POWER_SGD_RANK2 = _powerSGD_member(batched_powerSGD_hook, 2)
    #: ``noop_hook``: no communication (for measurements only).
    NOOP = _hook_member(noop_hook)

    # ddpx's own hooks, after torch's. A hook whose state is a process group:
    # `NAME = _hook_member(hook)`. A hook whose state class takes `process_group` and options:
    # `NAME = _enum_member(functools.partial(_register_with_state, comm_hook=hook,
    # state_class=StateClass, option=value))`, the options fixed by the member.
    #: ddpx's ``quantized_hook``, 8 bits a value, with error feedback.
    QUANTIZED_8BIT = _quantized_member(8)
    #: ddpx's ``quantized_hook``, 4 bits a value, with error feedback.
    QUANTIZED_4BIT = _quantized_member(4)
    #: ddpx's ``quantized_hook``, 2 bits a value, with error feedback.
    QUANTIZED_2BIT = _quantized_member(2)
    #: ddpx's ``quantized_hook``, 1 bit (the sign) a value, with error feedback.
    QUANTIZED_1BIT = _quantized_member(1)


class _CommHookTypeError(TypeError, AttributeError):
    """A ``comm_hook_type`` that is no member. torch's ``register_ddp_comm_hook`` reads
    ``comm_hook_type.value`` and so raises AttributeError for anything else; this error is a
    TypeError that is also an AttributeError, so code written against either catches it."""


_TORCH_MODULE = "torch.distributed.algorithms.ddp_comm_hooks"


def _member(comm_hook_type: Any) -> DDPCommHookType:
    if isinstance(comm_hook_type, DDPCommHookType):
        return comm_hook_type
    # torch's own enum: the ddpx member of the same name. torch's module is in sys.modules
    # whenever one of its members exists, so this check imports nothing.
    torch_hooks = sys.modules.get(_TORCH_MODULE)
    torch_type = getattr(torch_hooks, "DDPCommHookType", None)
    if torch_type is not None and isinstance(comm_hook_type, torch_type):
        try:
            return DDPCommHookType[comm_hook_type.name]
        except KeyError:
            raise _CommHookTypeError(
                f"register_ddp_comm_hook: ddpx has no hook for torch's "
                f"DDPCommHookType.{comm_hook_type.name}; register torch's with "
                f"{_TORCH_MODULE}.register_ddp_comm_hook") from None
    raise _CommHookTypeError(
        "register_ddp_comm_hook: comm_hook_type must be a ddpx.hooks.DDPCommHookType member "
        f"(e.g. DDPCommHookType.ALLREDUCE; by name: DDPCommHookType['ALLREDUCE']), got "
        f"{comm_hook_type!r}")


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model: Any, state: Any = None
                           ) -> None:
    """Registers the ddpx hook named by ``comm_hook_type`` on ``model``, as torch's
    :func:`torch.distributed.algorithms.ddp_comm_hooks.register_ddp_comm_hook`: natively when
    ``model`` is a ``DistributedDataParallel`` (no Python per bucket), else through
    ``model.register_comm_hook(state, hook)``.

    Args:
        comm_hook_type: a :class:`DDPCommHookType` member; a member of torch's
            ``DDPCommHookType`` stands for ddpx's member of the same name.
        model: the DDP model.
        state: a ProcessGroup, or None for the default group (the PowerSGD members build a
            ``PowerSGDState`` on it).

    A model takes one hook: a second registration raises RuntimeError, as in torch.

    Example::
        >>> ddpx.hooks.register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, ddp_model, state)
    """
    _member(comm_hook_type).value(model=model, state=state)
