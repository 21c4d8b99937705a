"""Post-local SGD (Lin et al., ICLR 2020): torch's ``PostLocalSGDState`` and
``post_localSGD_hook``, run by native C++ code. State and hook together, as in torch's
``torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook``."""
import logging
import weakref
from typing import Any, Dict, Optional

import torch.distributed as dist

from .._groups import check_optional_group, intra_node_subgroup, resolve_group
from .._loader import _C
from .._native import (
    NativeState,
    check_int,
    declare_torch_slots,
    make_hook,
    native_property,
    process_group_property,
)

logger = logging.getLogger(__name__)

# Attribute set on the parameters of a DDP model whose post_localSGD_hook is a ddpx one: a weak
# reference to its PostLocalSGDState, so that a model averager given those parameters can check
# that its warm-up matches the hook's start_localSGD_iter.
STATE_TAG = "_ddpx_post_local_sgd_state"

_WHO = "PostLocalSGDState"


def _check_subgroup(name: str, group: Any) -> Optional[dist.ProcessGroup]:
    check_optional_group(group, _WHO, name)
    return group


class PostLocalSGDState(NativeState):
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
    ValueError without CUDA). Unlike torch's, these subgroups time out as the default group does
    (torch's take ``new_group``'s 30 minutes whatever ``init_process_group`` was given).

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

    As torch's, ``__slots__`` lists the state's fields and an instance has no ``__dict__`` (a
    misspelled attribute raises AttributeError).
    """

    __slots__ = ("_process_group", "_subgroup", "_params_tagged")

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup],
        subgroup: Optional[dist.ProcessGroup],
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ):
        check_int(_WHO, "start_localSGD_iter", start_localSGD_iter)
        _check_subgroup("subgroup", subgroup)
        native_group = resolve_group(process_group, _WHO)
        self._process_group = process_group
        self._subgroup = subgroup
        self._params_tagged = False
        self._cpp = _C.PostLocalSGDState(
            native_group, subgroup,
            start_localSGD_iter, bool(post_local_gradient_allreduce), logger.info)

    # -- torch's attributes ---------------------------------------------------------------------
    process_group = process_group_property(_WHO)
    subgroup = native_property(
        "subgroup", _check_subgroup, keep=True,
        doc="The group gradients are averaged in after the warm-up (None: intra-node).")
    start_localSGD_iter = native_property(
        "start_localSGD_iter",
        doc="The iteration from which gradients are averaged within the subgroup only.")
    post_local_gradient_allreduce = native_property(
        "post_local_gradient_allreduce", lambda name, value: bool(value),
        doc="Whether gradients are averaged within the subgroup after the warm-up "
            "(False: not at all).")
    iter = native_property(
        "iter", doc="Iterations counted so far (the count stops at start_localSGD_iter).")

    # -- checkpointing (state_dict, load_state_dict, pickling: NativeState) --------------------
    def __setstate__(self, state: Dict[str, Any]) -> None:
        logger.warning(
            "NOTE: Process group will be set to the default group and the subgroup to the "
            "intra-node subgroups. Set `process_group` / `subgroup` after loading if a "
            "different group is desired."
        )
        self._process_group = None
        self._subgroup = None
        self._params_tagged = False
        self._cpp = _C.PostLocalSGDState(resolve_group(None, _WHO), None,
                                         state["start_localSGD_iter"],
                                         bool(state["post_local_gradient_allreduce"]), logger.info)
        self._cpp.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"ddpx.hooks.PostLocalSGDState(start_localSGD_iter={self.start_localSGD_iter}, "
                f"post_local_gradient_allreduce={self.post_local_gradient_allreduce}, "
                f"iter={self.iter})")

    # -- the state protocol (ddpx._native) -----------------------------------------------
    def _ddpx_native_(self, hook_name: str) -> "_C.PostLocalSGDState":
        """The C++ state, with the intra-node subgroup created if it will be needed."""
        if self._subgroup is None and self.post_local_gradient_allreduce:
            self.subgroup = intra_node_subgroup()
        return self._cpp

    def _ddpx_on_register_(self, ddp_model: Any) -> None:
        """Native registration: the model's parameters are known, tag them all."""
        self._tag(ddp_model.parameters())
        self._params_tagged = True

    def _ddpx_on_bucket_(self, bucket: dist.GradBucket) -> None:
        """Drop-in: tag the parameters of the first iteration's buckets, for the model averagers'
        warm-up check."""
        if not self._params_tagged:
            self._tag(bucket.parameters())
            if bucket.is_last():
                self._params_tagged = True

    def _tag(self, params) -> None:
        ref = weakref.ref(self)
        for p in params:
            setattr(p, STATE_TAG, ref)


declare_torch_slots(PostLocalSGDState, ("process_group", "subgroup", "start_localSGD_iter",
                                        "post_local_gradient_allreduce", "iter"))


def hook_state_of(params) -> Optional[PostLocalSGDState]:
    """The live ddpx PostLocalSGDState whose hook is registered on these parameters, if any."""
    for p in params:
        ref = getattr(p, STATE_TAG, None)
        if ref is not None:
            return ref()
    return None


post_localSGD_hook = make_hook(
    "post_localSGD_hook",
    _C.post_localsgd_hook,
    """Post-local SGD (Lin et al., ICLR 2020), torch's ``post_localSGD_hook``:
    averages gradients over ``state.process_group`` (bit-identical to ``allreduce_hook``) until
    ``state.start_localSGD_iter``, then within ``state.subgroup`` only (or not at all when
    ``state.post_local_gradient_allreduce`` is False). Combine it with a model averager run after
    the optimizer step, e.g. :class:`ddpx.optim.PostLocalSGDOptimizer` with a
    :class:`ddpx.model_averaging.PeriodicModelAverager` whose ``warmup_steps`` equals
    ``start_localSGD_iter``.

    Example::
        >>> state = ddpx.hooks.PostLocalSGDState(process_group=None, subgroup=None,
        ...                                      start_localSGD_iter=100)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.post_localSGD_hook)
    """,
    state_type=PostLocalSGDState,
)
