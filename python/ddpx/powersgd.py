"""PowerSGD: torch's ``PowerSGDState``, ``powerSGD_hook`` and ``batched_powerSGD_hook``, native."""
import logging
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ._loader import _C
from ._groups import resolve_group
from ._state import NativeStateCheckpoint

logger = logging.getLogger(__name__)

_OPTION_NAMES = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "random_seed",
    "compression_stats_logging_frequency",
    "batch_tensors_with_same_shape",
)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"PowerSGDState: {name} must be an int, got {type(value).__name__}")
    return value


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"PowerSGDState: {name} must be a number, got {type(value).__name__}")
    return float(value)


class PowerSGDState(NativeStateCheckpoint):
    r"""State of the PowerSGD hooks: hyperparameters, error-feedback residuals, warm-start Q
    factors, the iteration counter and the random generator. Same arguments, defaults, errors
    and attributes as :class:`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState`;
    the work runs in C++.

    Differences from torch, all deliberate:

    * Memories are keyed per parameter (by the order parameters first reach the hook), not per
      bucket index, so :meth:`state_dict` / pickling resume a job bit for bit in a new process
      with a new DDP model, whose first buckets differ from the ones the checkpoint saw.
      ``error_dict`` and ``q_memory_dict`` are therefore keyed by parameter, not by bucket.
    * A state serves one DDP model; reusing it for another raises ValueError.
    * ``matrix_approximation_rank < 1``, ``min_compression_rate < 0`` and a negative
      ``orthogonalization_epsilon`` raise ValueError (torch accepts them and fails later).
    * A column of zeros with ``orthogonalization_epsilon == 0`` stays zero instead of turning
      into NaN.

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
        ...                                  start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.powerSGD_hook)
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup],
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ):
        opts = _C.PowerSGDOptions()
        opts.matrix_approximation_rank = _check_int(
            "matrix_approximation_rank", matrix_approximation_rank)
        opts.start_powerSGD_iter = _check_int("start_powerSGD_iter", start_powerSGD_iter)
        opts.min_compression_rate = _check_number("min_compression_rate", min_compression_rate)
        opts.use_error_feedback = bool(use_error_feedback)
        opts.warm_start = bool(warm_start)
        opts.orthogonalization_epsilon = _check_number(
            "orthogonalization_epsilon", orthogonalization_epsilon)
        opts.random_seed = _check_int("random_seed", random_seed)
        opts.compression_stats_logging_frequency = _check_int(
            "compression_stats_logging_frequency", compression_stats_logging_frequency)
        opts.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        opts.validate()
        self._process_group = process_group
        self._cpp = _C.PowerSGDState(resolve_group(process_group, "PowerSGDState"), opts, logger.info)

    # -- torch's attributes ---------------------------------------------------------------------
    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self._process_group

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        self._cpp.process_group = resolve_group(group, "PowerSGDState")
        self._process_group = group

    @property
    def iter(self) -> int:
        return self._cpp.iter

    @iter.setter
    def iter(self, value: int) -> None:
        self._cpp.iter = _check_int("iter", value)

    @property
    def total_numel_before_compression(self) -> int:
        return self._cpp.total_numel_before_compression

    @property
    def total_numel_after_compression(self) -> int:
        return self._cpp.total_numel_after_compression

    @property
    def next_stats_report(self) -> int:
        return self._cpp.next_stats_report

    @property
    def error_dict(self) -> Dict[int, torch.Tensor]:
        """Error-feedback residuals per parameter (views of the live buffers)."""
        return self._cpp.error_dict()

    @property
    def q_memory_dict(self) -> Dict[int, torch.Tensor]:
        """Warm-start Q factors per compressed parameter (views of the live buffers)."""
        return self._cpp.q_memory_dict()

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Counts one iteration when ``bucket`` is the last bucket of a step."""
        self._cpp.maybe_increase_iter(bucket.is_last())

    def compression_stats(self) -> Tuple[float, int, int]:
        """Returns ``(compress_rate, numel_before_compression, numel_after_compression)``."""
        return self._cpp.compression_stats()

    # -- checkpointing ---------------------------------------------------------------------------
    # state_dict() (hyperparameters, iteration, statistics, generator state and per-parameter
    # memories as CPU tensors), load_state_dict() (call it before the first backward of the new
    # DDP model; memories reach their parameters as the buckets first run) and pickling come
    # from NativeStateCheckpoint.
    def __setstate__(self, state: Dict[str, Any]) -> None:
        logger.warning(
            "NOTE: Process group will be set to a default group (i.e. the world size). If a "
            "different group is desired, please set `self.process_group` after PowerSGD state "
            "is loaded."
        )
        opts = _C.PowerSGDOptions()
        for name in _OPTION_NAMES:
            setattr(opts, name, state[name])
        self._process_group = None
        self._cpp = _C.PowerSGDState(resolve_group(None, "PowerSGDState"), opts, logger.info)
        self._cpp.load_state_dict(state)

    def __repr__(self) -> str:
        args = ", ".join(f"{n}={getattr(self, n)!r}" for n in _OPTION_NAMES)
        return f"ddpx.hooks.PowerSGDState({args}, iter={self.iter})"


def _option_property(name: str):
    def getter(self):
        return getattr(self._cpp.options, name)

    def setter(self, value):
        opts = self._cpp.options
        setattr(opts, name, value)
        self._cpp.set_options(opts)

    return property(getter, setter, doc=f"The ``{name}`` hyperparameter (settable).")


for _name in _OPTION_NAMES:
    setattr(PowerSGDState, _name, _option_property(_name))


def _native_state(state: Any, hook_name: str) -> "_C.PowerSGDState":
    if not isinstance(state, PowerSGDState):
        hint = ""
        if type(state).__name__ == "PowerSGDState":
            hint = " (this is torch's PowerSGDState; ddpx's hooks need ddpx.hooks.PowerSGDState)"
        raise TypeError(
            f"{hook_name}: state must be a ddpx.hooks.PowerSGDState, got "
            f"{type(state).__name__}{hint}"
        )
    return state._cpp
