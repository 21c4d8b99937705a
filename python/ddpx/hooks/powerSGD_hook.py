"""PowerSGD (Vogels et al., NeurIPS 2019): torch's ``PowerSGDState``, ``powerSGD_hook`` and
``batched_powerSGD_hook``, run by native C++ code. State and hooks together, as in torch's
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``."""
import functools
import logging
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from .._groups import resolve_group
from .._loader import _C
from .._native import (
    NativeState,
    check_int,
    check_number,
    declare_option_properties,
    declare_torch_slots,
    make_hook,
    native_property,
    process_group_property,
)

try:  # torch's PowerSGDState needs numpy for its `rng`; ddpx runs without it (see `rng`).
    import numpy as _np
except ImportError:  # pragma: no cover - both supported torches come with numpy
    _np = None

logger = logging.getLogger(__name__)

# torch's PowerSGDState.__slots__, in torch's order (the same in torch 1.13, 2.11 and 2.15).
_TORCH_SLOTS = (
    "process_group",
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "orthogonalization_epsilon",
    "use_error_feedback",
    "warm_start",
    "batch_tensors_with_same_shape",
    "rng",
    "error_dict",
    "p_memory_dict",
    "q_memory_dict",
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "compression_stats_logging_frequency",
    "next_stats_report",
)

# The draws of torch's hook: `torch.manual_seed(state.rng.randint(1_000_000_000))`.
_SEED_RANGE = 1_000_000_000
_MT_WORDS = 624


def _rng_to_text(rng: Any) -> str:
    """A numpy RandomState's MT19937 state in the native checkpoint's format (the state words,
    then the position: what C++'s std::mt19937 reads back)."""
    get_state = getattr(rng, "get_state", None)
    state = get_state() if callable(get_state) else None
    if not isinstance(state, tuple) or state[0] != "MT19937":
        raise TypeError(
            f"{_WHO}: state_dict() saves rng only as a numpy.random.RandomState (MT19937), got "
            f"{type(rng).__name__}")
    key, pos = state[1], state[2]
    return " ".join(str(int(word)) for word in key) + " " + str(int(pos))


def _rng_from_text(text: str, into: Any = None) -> Any:
    """The inverse of :func:`_rng_to_text`: sets ``into`` (a RandomState) or a new one."""
    words = text.split()
    if len(words) != _MT_WORDS + 1:
        raise ValueError(f"{_WHO}: corrupt generator state in checkpoint")
    rng = into if isinstance(into, _np.random.RandomState) else _np.random.RandomState()
    rng.set_state(("MT19937", _np.array([int(w) for w in words[:_MT_WORDS]], dtype=_np.uint32),
                   int(words[_MT_WORDS])))
    return rng


def _seed_source(box: list):
    """What the native hooks call for each Q seed: a draw from the state's current ``rng``, as
    torch's hook draws. It holds the box, not the state (no reference cycle through C++)."""
    def draw() -> int:
        return int(box[0].randint(_SEED_RANGE))
    return draw


def _silent(line: str) -> None:
    """A logger for the native state while the Python side emits torch's records itself."""

_WHO = "PowerSGDState"
_check_int = functools.partial(check_int, _WHO)
_check_number = functools.partial(check_number, _WHO)

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


class PowerSGDState(NativeState):
    r"""State of the PowerSGD hooks: hyperparameters, error-feedback residuals, warm-start Q
    factors, the iteration counter and the random generator. Same arguments, defaults, errors
    and attributes as
    :class:`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState`; the work
    runs in C++.

    Differences from torch, all deliberate:

    * Memories are keyed per parameter (by the order parameters first reach the hook), not per
      bucket index, so :meth:`state_dict` / pickling resume a job bit for bit in a new process
      with a new DDP model, whose first buckets differ from the ones the checkpoint saw.
      ``error_dict``, ``p_memory_dict`` and ``q_memory_dict`` are therefore keyed by parameter,
      not by bucket.
    * A state serves one DDP model; reusing it for another raises ValueError.
    * ``matrix_approximation_rank < 1``, ``min_compression_rate < 0`` and a negative
      ``orthogonalization_epsilon`` raise ValueError (torch accepts them and fails later).
    * A column of zeros with ``orthogonalization_epsilon == 0`` stays zero instead of turning
      into NaN.
    * ``__slots__`` lists torch's names, and as with torch an instance has no ``__dict__``
      (a misspelled attribute raises AttributeError); the values live in the native state, so
      the class's real slots are private ones.

    ``rng`` is torch's: a ``numpy.random.RandomState(random_seed)``, and the hooks draw each
    fresh Q's seed from it (``rng.randint(1_000_000_000)``, as torch's hook), so reseeding it
    (``state.rng.seed(s)``) or replacing it (``state.rng = RandomState(s)``) changes the Qs as
    with torch. ``state_dict()`` and pickling carry its MT19937 state (not a cached Gaussian
    from ``rng.randn``, which the hooks never use). Without numpy (torch's state cannot be built
    then), the hooks draw the same seeds from a built-in MT19937 and reading ``rng`` raises
    AttributeError saying so.

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
        ...                                  start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.powerSGD_hook)
    """

    __slots__ = ("_process_group", "_rng_box")

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
        # Built silent: torch's log records are emitted here, from the values as given (torch
        # logs them with %s: 2 and 2.0 read differently), then the state logs to our logger.
        self._cpp = _C.PowerSGDState(resolve_group(process_group, _WHO), opts, _silent)
        logger.info(
            "PowerSGD config: matrix_approximation_rank = %s; start_powerSGD_iter = %s; "
            "min_compression_rate = %s; orthogonalization_epsilon = %s; use_error_feedback = %s; "
            "warm_start = %s; random_seed = %s; compression_stats_logging_frequency = %s; "
            "batch_tensors_with_same_shape = %s",
            matrix_approximation_rank, start_powerSGD_iter, min_compression_rate,
            orthogonalization_epsilon, use_error_feedback, warm_start, random_seed,
            compression_stats_logging_frequency, batch_tensors_with_same_shape)
        self._cpp.set_logger(logger.info)
        self._set_rng(_np.random.RandomState(random_seed) if _np is not None else None)

    # -- the generator of the Q seeds --------------------------------------------------------------
    def _set_rng(self, rng: Any) -> None:
        """Makes ``rng`` the generator the hooks draw from (None: the native built-in one)."""
        self._rng_box = [rng]
        self._cpp.set_seed_source(None if rng is None else _seed_source(self._rng_box))

    @property
    def rng(self) -> Any:
        """torch's ``rng``: the ``numpy.random.RandomState`` the hooks draw each fresh Q's seed
        from; settable, as torch's."""
        rng = self._rng_box[0]
        if rng is None:
            raise AttributeError(
                f"{_WHO}.rng is a numpy.random.RandomState and numpy is not installed (torch's "
                "PowerSGDState needs numpy too); ddpx draws the same Q seeds from its built-in "
                "MT19937 generator, saved by state_dict()")
        return rng

    @rng.setter
    def rng(self, value: Any) -> None:
        self._set_rng(value)

    # -- torch's attributes (the hyperparameters are set up below the class) -------------------
    process_group = process_group_property(_WHO)
    iter = native_property("iter", _check_int, doc="Iterations counted so far (settable).")
    total_numel_before_compression = native_property(
        "total_numel_before_compression", readonly=True,
        doc="Values the compressed tensors held before compression, summed over the steps.")
    total_numel_after_compression = native_property(
        "total_numel_after_compression", readonly=True,
        doc="Values of their P and Q factors, summed over the steps.")
    next_stats_report = native_property(
        "next_stats_report", readonly=True,
        doc="The iteration of the next compression-stats log line.")
    error_dict = native_property(
        "error_dict", get=lambda cpp, name: cpp.error_dict(), readonly=True,
        doc="Error-feedback residuals per parameter (views of the live buffers).")
    p_memory_dict = native_property(
        "p_memory_dict", get=lambda cpp, name: cpp.p_memory_dict(), readonly=True,
        doc="P factors of the last step per compressed parameter (layer-wise hook; views of the "
            "live buffers). torch keys its p_memory_dict by bucket; ddpx per parameter, as "
            "q_memory_dict.")
    q_memory_dict = native_property(
        "q_memory_dict", get=lambda cpp, name: cpp.q_memory_dict(), readonly=True,
        doc="Warm-start Q factors per compressed parameter (views of the live buffers).")

    def clear_memories(self) -> None:
        """Forgets the error-feedback residuals and the warm-start Q factors: the next
        compressed step starts them afresh (zero residuals, fresh Qs), as the first one does.
        ddpx only: after a step whose gradients held NaN or Inf, PowerSGD's memories hold them
        too (torch's as well), and every later step would carry them; call this between steps to
        start the memories afresh."""
        self._cpp.clear_memories()

    def compression_stats(self) -> Tuple[float, int, int]:
        """Returns ``(compress_rate, numel_before_compression, numel_after_compression)``."""
        return self._cpp.compression_stats()

    # -- checkpointing ---------------------------------------------------------------------------
    # state_dict(): hyperparameters, iteration, statistics, generator state and per-parameter
    # memories as CPU tensors; pickling (NativeState) saves it.
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume, without the process group (not serialisable): the
        hyperparameters, ``iter``, the statistics, ``rng``'s state and the memories."""
        d = self._cpp.state_dict()
        if self._rng_box[0] is not None:
            d["rng"] = _rng_to_text(self._rng_box[0])
        return d

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True,
                        allow_reshard: bool = False) -> None:
        """Restores :meth:`state_dict`'s content. Call it before the first backward of the new
        DDP model: memories reach their parameters as the buckets first run. A value of the wrong
        type raises TypeError naming its key. ``strict``: an error-feedback memory whose size is
        not its parameter's (a corrupt checkpoint, or one saved for a model with other shapes)
        raises ValueError at that parameter's first step; with ``strict=False`` it is dropped
        (error feedback restarts from zero there). Q memories of another size are always dropped
        (a changed rank legitimately changes them).

        Error-feedback memories are one rank's own, so :meth:`state_dict` records the rank and
        world size that saved them, and a checkpoint whose error memories come from another
        rank or world size raises ValueError (save one file per rank and load each rank's own).
        ``allow_reshard=True`` loads them anyway, for a deliberate reshard (ddpx only)."""
        self._cpp.load_state_dict(state_dict, strict=bool(strict),
                                  allow_reshard=bool(allow_reshard))
        if self._rng_box[0] is not None:
            # Into the current RandomState, so that references to state.rng stay live.
            self._set_rng(_rng_from_text(state_dict["rng"], into=self._rng_box[0]))

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # torch's record, character for character (its source continues the string with a
        # backslash, so 16 spaces of indentation are part of the message).
        logger.warning(
            "NOTE: Process group will be set to a default group (i.e. the world size)."
            "                If a different group is desired, please set `self.process_group` "
            "after PowerSGD state is loaded."
        )
        opts = _C.PowerSGDOptions()
        for name in _OPTION_NAMES:
            setattr(opts, name, state[name])
        # As torch: the default group itself (not None), and no second "PowerSGD config" record
        # (torch logs it in __init__ only).
        self._process_group = dist.group.WORLD
        self._cpp = _C.PowerSGDState(resolve_group(None, _WHO), opts, _silent)
        self._cpp.load_state_dict(state)
        self._cpp.set_logger(logger.info)
        self._set_rng(_rng_from_text(state["rng"]) if _np is not None else None)

    def __repr__(self) -> str:
        args = ", ".join(f"{n}={getattr(self, n)!r}" for n in _OPTION_NAMES)
        return f"ddpx.hooks.PowerSGDState({args}, iter={self.iter})"


declare_option_properties(PowerSGDState, _OPTION_NAMES,
                          doc="The ``{}`` hyperparameter (settable).")

declare_torch_slots(PowerSGDState, _TORCH_SLOTS)


powerSGD_hook = make_hook(
    "powerSGD_hook",
    lambda state: _C.powersgd_hook(state, batched=False),
    """PowerSGD gradient compression (Vogels et al., NeurIPS 2019), torch's ``powerSGD_hook``:
    matrices worth compressing travel as rank-r factors P and Q, the rest is allreduced, with
    error feedback and warm start as configured in ``state`` (a :class:`PowerSGDState`). Plain
    allreduce before ``state.start_powerSGD_iter``.

    Any other state (None included) raises TypeError: at :func:`ddpx.register_comm_hook`, before
    anything is installed, and at the first bucket drop-in (DDP runs a Python hook only then).
    torch's hook accepts any state at registration and fails at the first bucket (an
    AttributeError for None).

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
        ...                                  start_powerSGD_iter=10, min_compression_rate=0.5)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.powerSGD_hook)
    """,
    state_type=PowerSGDState,
)

batched_powerSGD_hook = make_hook(
    "batched_powerSGD_hook",
    lambda state: _C.powersgd_hook(state, batched=True),
    """Torch's ``batched_powerSGD_hook``: the whole bucket compressed as one zero-padded square
    matrix. Faster than :func:`powerSGD_hook` but usually less accurate unless the rank is 1.
    (torch's own crashes with an AssertionError; this one works.) A state that is not a
    :class:`PowerSGDState` raises TypeError as for :func:`powerSGD_hook`.

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.batched_powerSGD_hook)
    """,
    state_type=PowerSGDState,
)
