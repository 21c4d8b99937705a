"""Post-local SGD: torch's ``PostLocalSGDState`` for ddpx's native ``post_localSGD_hook``."""
import logging
import weakref
from typing import Any, Dict, Optional

import torch.distributed as dist

from ._loader import _C
from ._groups import check_optional_group, intra_node_subgroup, resolve_group
from ._state import NativeStateCheckpoint

logger = logging.getLogger(__name__)

# Attribute set on the parameters of a DDP model whose post_localSGD_hook is a ddpx one: a weak
# reference to its PostLocalSGDState, so that a model averager given those parameters can check
# that its warm-up matches the hook's start_localSGD_iter.
STATE_TAG = "_ddpx_post_local_sgd_state"

_WHO = "PostLocalSGDState"


class PostLocalSGDState(NativeStateCheckpoint):
    r"""State of :func:`ddpx.hooks.post_localSGD_hook`: gradients are averaged over
    ``process_group`` until iteration ``start_localSGD_iter``, then within ``subgroup`` only (or
    not at all when ``post_local_gradient_allreduce`` is False). Same arguments, attributes and
    log lines as torch's
    :class:`~torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook.PostLocalSGDState`;
    the hook runs in C++.

    ``process_group=None`` means the default group. ``subgroup=None`` means the intra-node
    subgroups, created (a collective: every rank must do it) when the hook is built, i.e. at
    :func:`ddpx.register_comm_hook` or at the first bucket of the drop-in path: with
    ``dist.new_subgroups()`` as torch when CUDA is available, else by host name (torch's raises
    ValueError without CUDA).

    Beyond torch: ``state_dict()`` / ``load_state_dict()`` (``iter``, ``start_localSGD_iter``,
    ``post_local_gradient_allreduce``) and pickling keep ``iter``, so a
    resumed job does not redo the global warm-up; ``start_localSGD_iter < 0`` raises ValueError;
    a model averager whose ``warmup_steps`` differs from ``start_localSGD_iter`` raises
    ValueError when it first averages the parameters of a model with this hook.

    Example::
        >>> subgroup, _ = dist.new_subgroups()
        >>> state = ddpx.hooks.PostLocalSGDState(process_group=None, subgroup=subgroup,
        ...                                      start_localSGD_iter=100)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.post_localSGD_hook)
        >>> opt = ddpx.optim.PostLocalSGDOptimizer(
        ...     torch.optim.SGD(ddp_model.parameters(), lr=0.01),
        ...     ddpx.model_averaging.PeriodicModelAverager(period=4, warmup_steps=100))
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup],
        subgroup: Optional[dist.ProcessGroup],
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ):
        if isinstance(start_localSGD_iter, bool) or not isinstance(start_localSGD_iter, int):
            raise TypeError(
                "PostLocalSGDState: start_localSGD_iter must be an int, got "
                f"{type(start_localSGD_iter).__name__}"
            )
        check_optional_group(subgroup, _WHO, "subgroup")
        native_group = resolve_group(process_group, _WHO)
        self._process_group = process_group
        self._subgroup = subgroup
        self._params_tagged = False
        self._cpp = _C.PostLocalSGDState(
            native_group, subgroup,
            start_localSGD_iter, bool(post_local_gradient_allreduce), logger.info)

    # -- torch's attributes ---------------------------------------------------------------------
    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self._process_group

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        self._cpp.process_group = resolve_group(group, _WHO)
        self._process_group = group

    @property
    def subgroup(self) -> Optional[dist.ProcessGroup]:
        return self._subgroup

    @subgroup.setter
    def subgroup(self, group: Optional[dist.ProcessGroup]) -> None:
        check_optional_group(group, _WHO, "subgroup")
        self._cpp.subgroup = group
        self._subgroup = group

    @property
    def start_localSGD_iter(self) -> int:
        return self._cpp.start_localSGD_iter

    @start_localSGD_iter.setter
    def start_localSGD_iter(self, value: int) -> None:
        self._cpp.start_localSGD_iter = value

    @property
    def post_local_gradient_allreduce(self) -> bool:
        return self._cpp.post_local_gradient_allreduce

    @post_local_gradient_allreduce.setter
    def post_local_gradient_allreduce(self, value: bool) -> None:
        self._cpp.post_local_gradient_allreduce = bool(value)

    @property
    def iter(self) -> int:
        return self._cpp.iter

    @iter.setter
    def iter(self, value: int) -> None:
        self._cpp.iter = value

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Counts one iteration when ``bucket`` is the last bucket of a step."""
        self._cpp.maybe_increase_iter(bucket.is_last())

    # -- checkpointing (state_dict, load_state_dict, pickling: NativeStateCheckpoint) ----------
    def __setstate__(self, state: Dict[str, Any]) -> None:
        logger.warning(
            "NOTE: Process group will be set to the default group and the subgroup to the "
            "intra-node subgroups. Set `process_group` / `subgroup` after loading if a "
            "different group is desired."
        )
        self._process_group = None
        self._subgroup = None
        self._params_tagged = False
        self._cpp = _C.PostLocalSGDState(resolve_group(None, _WHO), None, state["start_localSGD_iter"],
                                         bool(state["post_local_gradient_allreduce"]), logger.info)
        self._cpp.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"ddpx.hooks.PostLocalSGDState(start_localSGD_iter={self.start_localSGD_iter}, "
                f"post_local_gradient_allreduce={self.post_local_gradient_allreduce}, "
                f"iter={self.iter})")

    # -- ddpx internals -------------------------------------------------------------------------
    def _native(self) -> "_C.PostLocalSGDState":
        """The C++ state, with the intra-node subgroup created if it will be needed."""
        if self._subgroup is None and self.post_local_gradient_allreduce:
            self.subgroup = intra_node_subgroup()
        return self._cpp

    def _tag(self, params) -> None:
        ref = weakref.ref(self)
        for p in params:
            setattr(p, STATE_TAG, ref)


def native_state(state: Any, hook_name: str) -> "_C.PostLocalSGDState":
    if not isinstance(state, PostLocalSGDState):
        hint = ""
        if type(state).__name__ == "PostLocalSGDState":
            hint = (" (this is torch's PostLocalSGDState; ddpx's hook needs "
                    "ddpx.hooks.PostLocalSGDState)")
        raise TypeError(
            f"{hook_name}: state must be a ddpx.hooks.PostLocalSGDState, got "
            f"{type(state).__name__}{hint}"
        )
    return state._native()


def hook_state_of(params) -> Optional[PostLocalSGDState]:
    """The live ddpx PostLocalSGDState whose hook is registered on these parameters, if any."""
    for p in params:
        ref = getattr(p, STATE_TAG, None)
        if ref is not None:
            return ref()
    return None
