"""Quantized gradients with error feedback: ``QuantizedState`` and ``quantized_hook``, ddpx's own
hook between ``fp16_compress_hook`` (2x fewer bytes) and PowerSGD (low rank, matrices only).
Every value of every tensor travels in 8, 4, 2 or 1 bits, with a scale per block, exchanged
reduce-scatter style and with two levels of error feedback."""
import functools
import logging
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from .._groups import resolve_group
from .._loader import _C
from .._native import (
    NativeState,
    check_int,
    declare_option_properties,
    declare_torch_slots,
    make_hook,
    native_property,
)

logger = logging.getLogger(__name__)

_WHO = "QuantizedState"
_check_int = functools.partial(check_int, _WHO)

_OPTION_NAMES = ("bits", "block_size", "use_error_feedback", "start_iter", "random_seed",
                 "stochastic_rounding", "exchange", "rotation")
_BOOL_OPTIONS = ("use_error_feedback", "stochastic_rounding")


def _options(**values: Any) -> "_C.QuantizedOptions":
    opts = _C.QuantizedOptions()
    for name, value in values.items():
        setattr(opts, name, _convert(name, value))
    opts.validate()
    return opts


class QuantizedState(NativeState):
    r"""State of :func:`quantized_hook`: the options, the iteration counter and the error-feedback
    residuals.

    Args:
        process_group: the group to average over; None for the default group.
        bits: bits per value: 8, 4 or 2 (symmetric integers with 255, 15 or 3 levels and a
            scale of ``max|v| / qmax`` per block), or 1 (the sign, with a scale of ``mean|v|``
            per block, as signSGD with error feedback). 2 bits without error feedback (and
            without stochastic rounding) fit the scale to the block instead: the mean of the
            magnitudes above the block's mean magnitude, so that fewer values are sent as 0
            (values above 1.5 times the scale are clipped to it).
        block_size: values per scale, a multiple of 8 (so that every block's codes fill whole
            bytes) up to 2**20. Smaller blocks follow the values more closely and cost
            ``32 / block_size`` bits per value of scales.
        use_error_feedback: keep each level's quantization error and add it to the next step's
            values, so that errors do not accumulate (Seide et al. 2014; Karimireddy et al.
            2019). Without it the plain 1- and 2-bit codes are biased; the rotation (on by
            default without error feedback) keeps them close to allreduce.
        start_iter: iterations averaged with a plain allreduce first (``allreduce_hook``'s
            result), while DDP settles its buckets and the first large gradients pass.
        random_seed: seed of the stochastic rounding and of the rotation's signs.
        stochastic_rounding: round to one of the two nearest levels with the probabilities that
            make the result unbiased, instead of to the nearest (needed for training without
            error feedback at low bit widths).
        exchange: how a bucket travels: ``"reduce_scatter"`` (two rounds, two levels of error
            feedback; below), ``"allgather"`` (one round, one level), or ``"auto"``: all-gather on
            2 ranks, where both send the same bytes, reduce-scatter on more, where it sends
            fewer.
        rotation: ``"hadamard"``: every whole block is multiplied by random signs and sent
            through a Hadamard transform before it is quantized, and rotated back where it is
            decoded. The rotated values are spread evenly over the block whatever the gradient's
            shape (one large value, a sparse block), so the codes lose less of them; at 1 bit
            without error feedback the scale is then the unbiased ``sum y^2 / sum |y|`` (DRIVE,
            Vargaftik et al. 2021), so each step's error averages out instead of accumulating.
            Same bytes on the wire; ``block_size`` must be a power of two in [8, 8192] (a
            parameter's short last block goes unrotated). ``"none"``: no rotation. ``"auto"``:
            ``"hadamard"`` without error feedback (where block_size allows it), ``"none"`` with
            it. Checkpoints saved before this option existed resume with ``"none"``.

    How a bucket of ``n`` values travels on ``W`` ranks by reduce-scatter: each rank quantizes
    (bucket + residual) per block and sends block chunk ``j`` to rank ``j`` (one all-to-all); the
    owner of a chunk sums the ``W - 1`` dequantized pieces and its own values (exact: they cross
    no wire) in fp32 in rank order, divides by ``W``, adds its own second residual, quantizes the
    mean again (two-level error feedback, as DeepSpeed's 1-bit Adam) and sends it to every rank
    (a second all-to-all), which dequantize it into the bucket. Every rank ends with the same
    bits; each puts about ``2 (W - 1) / W * n * bits / 8`` bytes on the wire, plus the scales. The
    second collective of a bucket is issued from the next bucket's hook call, so the collective
    order is the same on every rank.

    By all-gather: each rank quantizes its whole (bucket + residual) and sends it to every other
    rank (one all-to-all); every rank sums the ``W`` dequantized messages in fp32 in rank order
    and divides by ``W``. One quantization of each value and one round, ``(W - 1) * n * bits /
    8`` bytes per rank: on 2 ranks the reduce-scatter's count, which is why ``"auto"`` takes it
    there. Checkpoints saved before this option existed resume with ``"reduce_scatter"``.

    A block holding a NaN or an infinity arrives as NaN on every rank (never as a finite
    value), and its residuals restart at zero (so one bad step, the one a GradScaler skips,
    does not poison the later ones).

    Residuals are kept per parameter, so :meth:`state_dict` and pickling resume a job in a new
    process: bit for bit when DDP builds the buckets the checkpoint was taken with (same model,
    ``bucket_cap_mb`` and world size). Each rank's residuals are its own: save one file per
    rank. ``__slots__`` lists the state's fields and an instance has no ``__dict__``.

    Example::
        >>> state = ddpx.hooks.QuantizedState(process_group=None, bits=4)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.quantized_hook)
    """

    __slots__ = ("_process_group",)

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        bits: int = 8,
        block_size: int = 256,
        use_error_feedback: bool = True,
        start_iter: int = 10,
        random_seed: int = 0,
        stochastic_rounding: bool = False,
        exchange: str = "auto",
        rotation: str = "auto",
    ):
        opts = _options(bits=bits, block_size=block_size, use_error_feedback=use_error_feedback,
                        start_iter=start_iter, random_seed=random_seed,
                        stochastic_rounding=stochastic_rounding, exchange=exchange,
                        rotation=rotation)
        self._process_group = process_group
        self._cpp = _C.QuantizedState(resolve_group(process_group, _WHO), opts)

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group the hook averages over (None: the default group)."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        self._cpp.process_group = resolve_group(group, _WHO, arg="process_group")
        self._process_group = group

    iter = native_property("iter", lambda name, value: _check_int(name, value),
                           doc="Iterations counted so far (the last bucket of each step).")

    def state_dict(self) -> Dict[str, Any]:
        """The options, ``iter``, this rank's residuals per parameter (CPU tensors), and the rank
        and world size they belong to. No process group."""
        return self._cpp.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any], allow_reshard: bool = False) -> None:
        """Restores :meth:`state_dict`'s content; call it before the first backward of the new
        DDP model. Residuals saved by another rank or in a group of another size raise
        ValueError unless ``allow_reshard`` (a deliberate reshard)."""
        self._cpp.load_state_dict(state_dict, allow_reshard=allow_reshard)

    def clear_memories(self) -> None:
        """Forgets every residual: the next step starts them from zero."""
        self._cpp.clear_memories()

    def compression_stats(self) -> Tuple[float, int, int]:
        """The compression so far, as :meth:`PowerSGDState.compression_stats` gives it:
        ``(rate, bytes_before, bytes_after)`` over the buckets quantized since the state was
        made, ``bytes_before`` their values' bytes and ``bytes_after`` their blocks' (codes and
        scales), ``rate = bytes_before / bytes_after``; ``(0.0, 0, 0)`` before the first
        quantized bucket (the warm-up's allreduce steps do not count)."""
        return self._cpp.compression_stats()

    def worker_residuals(self) -> Dict[int, Any]:
        """This rank's residuals per parameter key (order of first appearance), as copies."""
        return self._cpp.worker_residuals()

    def server_residuals(self) -> Dict[int, Any]:
        """The residuals of the values this rank owns per parameter key (zeros elsewhere)."""
        return self._cpp.server_residuals()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        logger.warning(
            "NOTE: Process group will be set to the default group. Set `process_group` after "
            "loading if a different group is desired.")
        self._process_group = None
        self._cpp = _C.QuantizedState(
            resolve_group(None, _WHO),
            _options(**{name: state[name] for name in _OPTION_NAMES if name in state}))
        # As load_state_dict: residuals pickled by another rank (or in a group of another size)
        # are refused, not silently handed to this rank.
        self._cpp.load_state_dict(state)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _OPTION_NAMES)
        return f"ddpx.hooks.QuantizedState({fields}, iter={self.iter})"


def _convert(name: str, value: Any) -> Any:
    if name in ("exchange", "rotation"):
        # The names are checked natively (ValueError), as for the setter.
        if not isinstance(value, str):
            raise TypeError(f"{_WHO}: {name} must be a str, got {type(value).__name__}")
        return value
    return bool(value) if name in _BOOL_OPTIONS else _check_int(name, value)


declare_option_properties(QuantizedState, _OPTION_NAMES)
declare_torch_slots(QuantizedState, ("process_group",) + _OPTION_NAMES + ("iter",))


quantized_hook = make_hook(
    "quantized_hook",
    lambda state: _C.quantized_hook(state),
    """Averages the bucket with every value quantized to ``state.bits`` bits (a scale per
    ``state.block_size`` values) and two-level error feedback, reduce-scatter style (see
    :class:`QuantizedState`): about ``2 (W - 1) / W * bits / 8`` bytes per value per rank.
    Plain allreduce before ``state.start_iter``. Works on CPU and CUDA buckets, Gloo and NCCL,
    fp32, fp64, fp16 and bf16 buckets, and inside ``fp16_compress_wrapper`` /
    ``bf16_compress_wrapper``.

    Example::
        >>> state = ddpx.hooks.QuantizedState(process_group=None, bits=8, start_iter=10)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.quantized_hook)
        >>> # natively (no Python per bucket):
        >>> ddpx.register_comm_hook(ddp_model, state, ddpx.hooks.quantized_hook)
    """,
    state_type=QuantizedState,
)
