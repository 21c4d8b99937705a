"""Model averaging: torch's ``model_averaging`` (``averagers.PeriodicModelAverager``,
``hierarchical_model_averager.HierarchicalModelAverager``, ``utils.average_parameters``), with
the averaging in C++.

Same arguments, defaults, errors and warnings as torch's, and two differences, both deliberate:

* Parameters are averaged **in place**, bucket by bucket: the extra memory is about two buckets
  (``bucket_cap_mb``, 25 MB by default, as DDP's buckets), not a flat copy of the whole model,
  and no parameter's ``.data`` is rebound (torch's leaves every parameter a view of one flat
  buffer). Large parameters are reduced in their own storage with no copy at all.
* An averager whose ``warmup_steps`` differs from the ``start_localSGD_iter`` of the ddpx
  ``post_localSGD_hook`` registered on the same parameters raises ValueError on its first
  ``average_parameters`` call (torch's documentation requires them to be equal).
"""
import logging
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from ._groups import group_ranks, new_subgroups_by_ranks, resolve_group
from ._loader import _C
from ._native import check_int, native_property
from .hooks.post_localSGD_hook import hook_state_of

__all__ = [
    "ModelAverager",
    "PeriodicModelAverager",
    "HierarchicalModelAverager",
    "average_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
]

logger = logging.getLogger(__name__)

# torch's warnings, word for word. The C++ averagers warn too (for C++ programs); from Python the
# warning is torch's, raised here with torch's stacklevel, and the C++ one (which carries a
# "Triggered internally at" suffix) is dropped.
_PERIOD_ONE_ADVICE = (
    "no need to use model averaging because the communication cost "
    "of all-reducing parameters will be no less than the cost of all-reducing gradients "
    "by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case.")


def _build_quietly(make):
    """Builds a C++ averager without its own period-one warning (see _PERIOD_ONE_ADVICE)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"When (period|the maximum period)",
                                category=UserWarning)
        return make()


Params = Union[Iterable[torch.nn.Parameter], Iterable[Dict[str, Any]]]

def _bucket_bytes(bucket_cap_mb: float) -> int:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number, got {type(bucket_cap_mb).__name__}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return max(1, int(bucket_cap_mb * 1024 * 1024))


def _native_group(group: Any) -> Optional[dist.ProcessGroup]:
    """The group to hand to C++ (None: this rank is not a member, averaging is a no-op)."""
    return resolve_group(group, "model averaging", non_member_ok=True)


def _flatten(params: Params) -> List[torch.Tensor]:
    """Parameters of a model, or the parameters of optimizer parameter groups, as one list."""
    out: List[torch.Tensor] = []
    for param in params:
        if isinstance(param, torch.Tensor):
            out.append(param)
        elif isinstance(param, dict):
            out.extend(param["params"])
        else:
            raise NotImplementedError(f"Parameter input of type {type(param)} is not supported")
    return out


def get_params_to_average(params: Params) -> List[torch.Tensor]:
    """The parameters (of a model, or of optimizer parameter groups) that have a gradient."""
    return [p for p in _flatten(params) if p.grad is not None]


def average_parameters(params: Iterable[torch.Tensor], process_group: Any,
                       bucket_cap_mb: float = 25) -> Dict[str, int]:
    """Replaces each tensor of ``params`` with its mean over ``process_group``, in place, with
    torch's arithmetic (values promoted to the common dtype, divided by the group size, summed,
    cast back), in bounded memory. Returns counters of what it did (``tensors``,
    ``collectives``, ``inplace_tensors``, ``staged_tensors``, ``staging_bytes``)."""
    return _C.average_parameters(list(params), _native_group(process_group),
                                 _bucket_bytes(bucket_cap_mb))


def average_parameters_or_parameter_groups(params: Params, process_group: Any,
                                           bucket_cap_mb: float = 25) -> Dict[str, int]:
    """Averages the parameters of a model or of optimizer parameter groups that have a
    gradient."""
    return average_parameters(get_params_to_average(params), process_group, bucket_cap_mb)


_UNSET = object()


def _native_or_own(name: str, doc: str, check=None, default: Any = _UNSET) -> property:
    """An averager attribute read from the native averager (``self._cpp``), or, in a subclass
    without one (a custom averager written against torch's ``ModelAverager``), kept in the
    instance as a plain attribute, as torch's (``default`` until first set: torch's base sets
    ``step = 0``)."""
    own = "_own_" + name

    def getter(self):
        if self._cpp is None:
            value = self.__dict__.get(own, default)
            if value is _UNSET:
                raise AttributeError(
                    f"{type(self).__name__!r} object has no attribute {name!r}")
            return value
        return getattr(self._cpp, name)

    def setter(self, value):
        if self._cpp is None:
            self.__dict__[own] = value
        else:
            setattr(self._cpp, name, value if check is None else check(name, value))

    return property(getter, setter, doc=doc)


class ModelAverager(ABC):
    r"""Base class of the model averagers, as torch's (abstract: subclasses define
    :meth:`average_parameters`): ``process_group`` (the default group for None) and ``step``.
    The ddpx averagers keep their counters in their native averager (``self._cpp``); a custom
    subclass without one keeps them as plain attributes, as with torch's base."""

    _cpp: Any = None

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self._warmup_checked = False

    step = _native_or_own(
        "step", doc="Steps counted so far (one per :meth:`average_parameters` call).", default=0)
    last_stats = native_property(
        "last_stats", readonly=True,
        doc="What the last :meth:`average_parameters` call did (all zeros if it did not average).")
    warmup_steps = _native_or_own(
        "warmup_steps", check=lambda name, value: check_int("ModelAverager", name, value),
        doc="Steps without averaging before the first one (settable mid-run, as torch's).")

    @abstractmethod
    def average_parameters(self, params: Params) -> None:
        """Averages the parameters of a model, or of optimizer parameter groups."""
        raise NotImplementedError

    def _average_natively(self, params: Params) -> None:
        """Averages the parameters of a model, or of optimizer parameter groups, that have a
        gradient, if this step calls for it; then counts the step."""
        flat = _flatten(params)
        if not self._warmup_checked:
            self._check_warmup(flat)
        self._cpp.average_parameters(flat)

    def _check_warmup(self, params: List[torch.Tensor]) -> None:
        self._warmup_checked = True
        state = hook_state_of(params)
        warmup = getattr(self, "warmup_steps", None)
        if state is not None and warmup is not None and state.start_localSGD_iter != warmup:
            raise ValueError(
                f"{type(self).__name__}: warmup_steps={warmup} but the ddpx post_localSGD_hook "
                f"registered on these parameters starts local SGD at "
                f"start_localSGD_iter={state.start_localSGD_iter}; they must be equal (gradients "
                "are averaged globally until start_localSGD_iter, parameters from then on)"
            )


class PeriodicModelAverager(ModelAverager):
    r"""Averages parameters every ``period`` steps after ``warmup_steps`` steps (torch's
    :class:`~torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`).

    Args:
        period (int): steps per model averaging (a warning for 1, ValueError below).
        warmup_steps (int): steps without averaging first.
        process_group: the group to average over; None for the default group.
        bucket_cap_mb (float): size of the staging buckets (ddpx only).

    Example::
        >>> averager = ddpx.model_averaging.PeriodicModelAverager(period=4, warmup_steps=100)
        >>> for step in range(200):
        ...     optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        ...     averager.average_parameters(model.parameters())
    """

    def __init__(self, period: int, warmup_steps: int = 0,
                 process_group: Optional[dist.ProcessGroup] = None, bucket_cap_mb: float = 25):
        super().__init__(process_group)
        if warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        if period < 1:
            raise ValueError("Arg ``period`` must be a positive value.")
        if period == 1:
            warnings.warn("When period is 1, " + _PERIOD_ONE_ADVICE, stacklevel=2)
        self._cpp = _build_quietly(lambda: _C.PeriodicModelAverager(
            int(period), int(warmup_steps), _native_group(self.process_group),
            _bucket_bytes(bucket_cap_mb)))

    def average_parameters(self, params: Params) -> None:
        """Averages the parameters of a model, or of optimizer parameter groups, that have a
        gradient if ``step`` is at least ``warmup_steps`` and ``step - warmup_steps`` is a
        multiple of ``period``; then counts the step."""
        self._average_natively(params)

    period = native_property(
        "period", check=lambda name, value: check_int("PeriodicModelAverager", name, value),
        doc="Steps per model averaging (settable mid-run, as torch's: a schedule may change it).")


class HierarchicalModelAverager(ModelAverager):
    r"""Hierarchical SGD (torch's
    :class:`~torch.distributed.algorithms.model_averaging.hierarchical_model_averager.HierarchicalModelAverager`):
    groups of the sizes in ``period_group_size_dict`` (period -> group size, an ordered dict whose
    last size is the size of ``process_group``) average parameters every ``period`` steps after
    ``warmup_steps``; at a given step only the group of the largest dividing period averages.
    Subgroups of consecutive ranks are created as ``dist.new_subgroups`` does, with
    ``dist.new_group`` (a collective over the default group: every rank constructs the averager);
    unlike torch 1.13's, this works without CUDA, and unlike torch's the subgroups time out as
    the default group does (not after ``new_group``'s 30 minutes).

    Example::
        >>> averager = ddpx.model_averaging.HierarchicalModelAverager(
        ...     period_group_size_dict=OrderedDict([(4, 8), (16, 16)]), warmup_steps=100)
    """

    def __init__(self, period_group_size_dict: Optional[Dict[int, int]] = None,
                 warmup_steps: int = 0, process_group: Optional[dist.ProcessGroup] = None,
                 bucket_cap_mb: float = 25):
        super().__init__(process_group)
        if not period_group_size_dict:
            raise ValueError("Arg ``period_group_size_dict`` must not be empty.")
        periods = list(period_group_size_dict.keys())
        if any(p <= 0 for p in periods):
            raise ValueError(
                "The minimum period in arg ``period_group_size_dict`` must be a positive value.")
        if periods[-1] == 1:
            warnings.warn("When the maximum period in arg ``period_group_size_dict`` is 1, "
                          + _PERIOD_ONE_ADVICE, stacklevel=2)
        overall = dist.get_world_size(group=self.process_group)
        sizes = list(period_group_size_dict.values())
        if sizes[-1] != overall:
            raise ValueError(
                f"The last value in arg ``period_group_size_dict`` {sizes[-1]} must be equal "
                f"to the size of arg ``process_group`` {overall}."
            )
        if warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        self._periods = periods
        self.period_process_group_dict: "OrderedDict[int, Any]" = OrderedDict()
        ranks = group_ranks(self.process_group)
        logger.info("Model averaging hierarchy:")
        for period, size in period_group_size_dict.items():
            logger.info(
                "\tEach group that has %s processes average parameters every %s iterations, "
                "if no higher-level averaging.", size, period)
            if size == overall:
                self.period_process_group_dict[period] = self.process_group
                continue
            if size <= 0 or overall % size != 0:
                raise ValueError(
                    f"Group size {size} for period {period} in arg ``period_group_size_dict`` "
                    f"must divide the size of ``process_group`` {overall}.")
            # Consecutive ranks, as dist.new_subgroups (which needs CUDA in torch 1.13).
            self.period_process_group_dict[period] = new_subgroups_by_ranks(
                [ranks[i:i + size] for i in range(0, overall, size)])
        levels = [(p, _native_group(g)) for p, g in self.period_process_group_dict.items()]
        self._cpp = _build_quietly(lambda: _C.HierarchicalModelAverager(
            levels, int(warmup_steps), _native_group(self.process_group),
            _bucket_bytes(bucket_cap_mb)))

    def average_parameters(self, params: Params) -> None:
        """Averages the parameters of a model, or of optimizer parameter groups, that have a
        gradient, within the group of the largest period dividing ``step`` (none before
        ``warmup_steps``); then counts the step."""
        self._average_natively(params)

    def _find_process_group(self) -> Optional[Any]:
        """The group that averages at the current step (None if none does)."""
        index = self._cpp.group_index_for_step(self.step)
        return None if index < 0 else self.period_process_group_dict[self._periods[index]]
