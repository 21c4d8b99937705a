"""ProcessGroup objects crossing between Python and ddpx's C++ both ways, on the installed torch.

torch 1.13 binds ProcessGroup with c10::intrusive_ptr as its pybind11 holder; torch 2.x with a
holder of its own (IntrusivePtrNoGilDestructor) and a ProcessGroup that wraps Backend objects.
ddpx's module takes groups as c10::intrusive_ptr<c10d::ProcessGroup> and returns them from its
getters: a group Python still holds comes back as the same object; one Python has let go of
comes back as a new wrapper of the same C++ group, whose holder must be built and destroyed
correctly (a mismatch would crash here, not in a user's job).
"""
import gc
import weakref

import torch
import torch.distributed as dist

from ddpx import _C
from dist_utils import run_ranks


def _allreduce_on(group, rank: int) -> float:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=group)
    return float(t[0])


def rank_round_trip(rank: int, world_size: int):
    world = dist.group.WORLD
    out = {}
    # Groups Python holds: the same Python object back, and usable for a collective.
    psgd = _C.PowerSGDState(world, _C.PowerSGDOptions(), None)
    out["powersgd_is_world"] = psgd.process_group is world
    sub = dist.new_group(ranks=[0, 1])
    pls = _C.PostLocalSGDState(world, sub, 3)
    out["post_local_pg_is_world"] = pls.process_group is world
    out["post_local_subgroup_is_sub"] = pls.subgroup is sub
    out["post_local_subgroup_sum"] = _allreduce_on(pls.subgroup, rank)
    avg = _C.PeriodicModelAverager(2, 0, sub, 1 << 20)
    out["averager_pg_is_sub"] = avg.process_group is sub
    # Setting a group from Python and reading it back.
    psgd.process_group = sub
    out["powersgd_set_is_sub"] = psgd.process_group is sub
    out["powersgd_set_size"] = psgd.process_group.size()

    # A group only C++ still holds: pybind11 builds a new Python wrapper from ddpx's holder.
    own = dist.new_group(ranks=list(range(world_size)))
    holder = _C.PostLocalSGDState(world, own, 3)
    gone = weakref.ref(own)
    dist.destroy_process_group(own)
    del own
    gc.collect()
    out["python_wrapper_gone"] = gone() is None  # else the path below would not be exercised
    back = holder.subgroup
    out["wrapper_type_ok"] = isinstance(back, dist.ProcessGroup)
    out["wrapper_rank_size"] = (back.rank(), back.size())
    # Drop the new wrapper and the C++ state, in both orders, with the GIL held as a user would.
    del back
    gc.collect()
    del holder
    gc.collect()
    # The world group is still fine after all that.
    out["world_sum_after"] = _allreduce_on(world, rank)
    return out


def test_process_groups_round_trip():
    res = run_ranks(rank_round_trip, 2)
    for rank, out in enumerate(res):
        assert out["powersgd_is_world"] and out["post_local_pg_is_world"], out
        assert out["post_local_subgroup_is_sub"] and out["averager_pg_is_sub"], out
        assert out["powersgd_set_is_sub"] and out["powersgd_set_size"] == 2, out
        assert out["post_local_subgroup_sum"] == 3.0  # 1 + 2
        assert out["python_wrapper_gone"], out
        assert out["wrapper_type_ok"] and out["wrapper_rank_size"] == (rank, 2), out
        assert out["world_sum_after"] == 3.0
