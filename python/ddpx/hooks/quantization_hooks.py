"""torch's uint8 quantization hooks, ``quantization_pertensor_hook`` and
``quantization_perchannel_hook``, run by native C++ code (as torch's
``torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks``). Their state is a
ProcessGroup, or None for the default group."""
from typing import Dict

import torch
import torch.distributed as dist

from .._loader import _C
from .._native import HookFn, check_int, make_hook

_COMMON = """
    Every rank quantizes its bucket to ``torch.uint8`` with the parameters of
    ``torch.ao.quantization.{observer}`` (quint8, affine), then every rank's parameters and
    quantized values are gathered, dequantized and averaged in fp32: the result is torch's, bit
    for bit (for fp16/bf16 buckets the mean is written into the bucket's dtype, as DDP does with
    torch's fp32 result). Torch gathers the parameters and the values in two collectives, the
    second from the first one's callback; here one collective per bucket carries both, and the
    quantization runs in C++ (CUDA for CUDA buckets) instead of a Python loop.

    A NaN or an infinity in a {unit} makes that {unit}'s mean NaN on every rank, as in torch's
    hook (no error, so that ``torch.amp.GradScaler`` can skip the step).

    .. warning ::
        Like torch's, this gathers every rank's values: it sends ``world_size - 1`` times a
        quarter of the fp32 bytes, so it saves bytes over ``allreduce_hook`` only on a few ranks.
"""

quantization_pertensor_hook = make_hook(
    "quantization_pertensor_hook",
    _C.quantization_pertensor_hook,
    """Applies ``torch.quantize_per_tensor`` logic to DDP, like torch's
    ``quantization_pertensor_hook``: one scale and zero point for the whole bucket.
""" + _COMMON.format(observer="MinMaxObserver", unit="bucket") + """
    Example::
        >>> ddp_model.register_comm_hook(process_group, ddpx.hooks.quantization_pertensor_hook)
    """,
    first_param="process_group",
)

_PERCHANNEL_DOC = """Applies ``torch.quantize_per_channel`` logic to DDP, like torch's
    ``quantization_perchannel_hook``: the bucket is padded with zeros to a multiple of
    ``bucket_size`` (torch's padding: ``bucket_size - len % bucket_size`` zeros, so a whole
    channel of zeros when the length is a multiple already), viewed as channels of
    ``bucket_size`` values, and each channel gets its own scale and zero point, which resolves
    large buckets far better than one scale.
""" + _COMMON.format(observer="PerChannelMinMaxObserver", unit="channel") + """
    Args:
        process_group: the group to average over, or None for the default group.
        bucket: the gradient bucket DDP hands over.
        bucket_size: values per channel (an int >= 1; torch's default 512).

    Example::
        >>> ddp_model.register_comm_hook(process_group, ddpx.hooks.quantization_perchannel_hook)
        >>> # another channel size, natively:
        >>> ddpx.register_comm_hook(ddp_model, process_group, functools.partial(
        ...     ddpx.hooks.quantization_perchannel_hook, bucket_size=128))
    """

# One hook function (and so one native hook per group) per channel size used.
_perchannel_hooks: Dict[int, HookFn] = {}


def _check_bucket_size(bucket_size: int) -> int:
    check_int("quantization_perchannel_hook", "bucket_size", bucket_size)
    if bucket_size < 1:
        raise ValueError(
            f"quantization_perchannel_hook: bucket_size must be >= 1, got {bucket_size}")
    return bucket_size


def _perchannel_hook(bucket_size: int) -> HookFn:
    hook = _perchannel_hooks.get(bucket_size)
    if hook is None:
        hook = make_hook(
            "quantization_perchannel_hook",
            lambda group: _C.quantization_perchannel_hook(group, bucket_size),
            _PERCHANNEL_DOC,
            first_param="process_group",
        )
        _perchannel_hooks[bucket_size] = hook
    return hook


def quantization_perchannel_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket, bucket_size=512
) -> torch.futures.Future[torch.Tensor]:
    return _perchannel_hook(_check_bucket_size(bucket_size))(process_group, bucket)


quantization_perchannel_hook.__doc__ = _PERCHANNEL_DOC
# For ddpx.register_comm_hook: the default channel size, or functools.partial's bucket_size.
quantization_perchannel_hook._ddpx_factory = (  # type: ignore[attr-defined]
    lambda state: _perchannel_hook(512)._ddpx_factory(state))  # type: ignore[attr-defined]
quantization_perchannel_hook._ddpx_name = "quantization_perchannel_hook"  # type: ignore[attr-defined]
quantization_perchannel_hook._ddpx_bind = (  # type: ignore[attr-defined]
    lambda bucket_size=512: _perchannel_hook(_check_bucket_size(bucket_size)))
