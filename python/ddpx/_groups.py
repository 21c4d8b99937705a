"""Process groups for the Python layer: resolving a group argument as torch does (None is the
default group), and creating subgroups without CUDA that time out as the default group does."""
import datetime
import socket
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ._compat import is_non_group_member, process_group_ranks


def resolve_group(group: Any, who: str, arg: str = "process_group",
                  non_member_ok: bool = False) -> Optional[dist.ProcessGroup]:
    """The ProcessGroup to hand to C++ for the argument ``arg`` of ``who``: None means the default
    group (WORLD), as in torch. With ``non_member_ok``, the placeholder torch uses on ranks outside
    a group (``GroupMember.NON_GROUP_MEMBER``) becomes None: "not a member"; without it, that
    placeholder is a ValueError saying so. Anything else must be a ProcessGroup (TypeError)."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"{who}: {arg} is None, which means the default process group, but "
                "torch.distributed is not initialized; call dist.init_process_group() first"
            )
        return dist.group.WORLD
    if is_non_group_member(group):
        if non_member_ok:
            return None
        raise ValueError(
            f"{who}: this rank is not a member of the process group given as {arg} "
            "(torch hands ranks outside a dist.new_group() its NON_GROUP_MEMBER placeholder); "
            "use the group only on its member ranks, or pass a group this rank belongs to"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{who}: {arg} must be a torch.distributed.ProcessGroup or None (the default "
            f"group), got {type(group).__name__}"
        )
    return group


def check_optional_group(group: Any, who: str, arg: str) -> None:
    """A group argument where None has a meaning of its own (e.g. "create the subgroups")."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{who}: {arg} must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}"
        )


def default_group_timeout() -> Optional[datetime.timedelta]:
    """The timeout the default group was made with (``init_process_group(timeout=...)``), or
    None where this torch does not tell. ``dist.new_group`` and ``dist.new_subgroups`` default
    to torch's 30 minutes whatever the default group's timeout is, so a subgroup ddpx makes on
    the user's behalf (post-local SGD's intra-node group, the hierarchical averager's) would
    wait half an hour on a dead peer where the user asked for seconds."""
    pg = dist.distributed_c10d._get_default_group()
    candidates = [pg]
    for device in ("cpu", "cuda"):
        try:
            candidates.append(pg._get_backend(torch.device(device)))
        except Exception:  # noqa: BLE001 - no such backend, or a torch without _get_backend
            pass
    for obj in candidates:
        options = getattr(obj, "options", None)
        for name in ("_timeout", "timeout"):
            value = getattr(options, name, None)
            if isinstance(value, datetime.timedelta):
                return value
    return None


def _timeout_kwargs() -> Dict[str, datetime.timedelta]:
    # Only a known timeout: torch 1.13's new_group takes no None.
    timeout = default_group_timeout()
    return {} if timeout is None else {"timeout": timeout}


def new_subgroups_by_ranks(rank_lists: List[List[int]]) -> Optional[dist.ProcessGroup]:
    """Creates one group per list of global ranks with ``dist.new_group`` and returns the one
    holding this rank (None if none does). A collective over the default group: every rank calls
    it with the same lists. Works without CUDA (torch 1.13's ``new_subgroups`` and
    ``new_subgroups_by_enumeration`` refuse to run unless CUDA is available). The groups time
    out as the default group does (:func:`default_group_timeout`)."""
    me = dist.get_rank()
    mine = None
    kw = _timeout_kwargs()
    for ranks in rank_lists:
        group = dist.new_group(ranks=list(ranks), **kw)
        if me in ranks:
            mine = group
    return mine


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """The global ranks of ``group`` (None or WORLD: all ranks), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return process_group_ranks(group)


def intra_node_subgroup() -> dist.ProcessGroup:
    """This rank's intra-node subgroup, as torch's ``post_localSGD_hook`` creates it for
    ``subgroup=None``: ``dist.new_subgroups()`` (one subgroup per ``torch.cuda.device_count()``
    consecutive ranks) when CUDA is available. Without CUDA (where torch's raises ValueError)
    the ranks are grouped by host name. A collective over the default group: every rank calls it.
    """
    if torch.cuda.is_available():
        subgroup, _ = dist.new_subgroups(**_timeout_kwargs())
        return subgroup
    world = dist.get_world_size()
    hosts: List[Optional[str]] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    by_host: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(str(host), []).append(rank)
    subgroup = new_subgroups_by_ranks(list(by_host.values()))
    assert subgroup is not None
    return subgroup
