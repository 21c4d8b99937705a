"""The hook state as a ProcessGroup: subgroups (DDP over part of the world, the hook given the
same group), the world group passed explicitly, and the default group re-initialised."""
import datetime
import functools

import torch
import torch.distributed as dist

import ddp_cases as dc
from dist_utils import free_port, run_ranks

SUBGROUP_CONFIGS = ["torch_allreduce", "torch_fp16"] + [
    f"ddpx_{h}_{m}" for h in ("allreduce", "fp16", "bf16", "noop") for m in dc.MODES]


def rank_subgroups(rank: int, world_size: int):
    """Two DDP replicas groups, {0, 1} and {2, 3}: each trains over its own group and hands
    that group to the hook as its state. Plus ddpx on the world group passed explicitly."""
    # Every rank creates every group, in the same order (dist.new_subgroups needs CUDA in 1.13).
    groups = [dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[2, 3])]
    group = groups[rank // 2]
    out = {"local": []}
    local = dc.make_model()
    for it in range(2):
        local.zero_grad()
        dc.loss_fn(local, *dc.make_batch(rank, it)).backward()
        out["local"].append(dc.flat_grad(local))
    configs = [(c, group, group) for c in SUBGROUP_CONFIGS] + [
        ("ddpx_allreduce_native", None, dist.group.WORLD),
        ("ddpx_fp16_dropin", None, dist.group.WORLD),
        ("torch_allreduce", None, None),
    ]
    for config, ddp_group, state in configs:
        ddp = dc.make_ddp(dc.make_model(), config, state=state, process_group=ddp_group)
        grads = []
        for it in range(2):
            ddp.zero_grad()
            dc.loss_fn(ddp, *dc.make_batch(rank, it)).backward()
            grads.append(dc.flat_grad(ddp))
        key = config if ddp_group is not None else config + "_world"
        out[key] = grads
    return out


@functools.lru_cache(maxsize=None)
def subgroups():
    return run_ranks(rank_subgroups, 4)


def test_subgroup_state_allreduce():
    res = subgroups()
    for rank in range(4):
        peer = rank ^ 1
        for it in range(2):
            mean = dc.exact_mean([res[rank]["local"][it], res[peer]["local"][it]])
            for mode in dc.MODES:
                got = res[rank][f"ddpx_allreduce_{mode}"][it]
                assert torch.equal(got, res[rank]["torch_allreduce"][it]), (rank, mode, it)
                assert torch.equal(got, res[peer][f"ddpx_allreduce_{mode}"][it])
                torch.testing.assert_close(got.double(), mean, rtol=1e-6, atol=1e-9)
    # The two groups averaged different data.
    assert not torch.equal(res[0]["ddpx_allreduce_native"][0], res[2]["ddpx_allreduce_native"][0])


def test_subgroup_state_compression_and_noop():
    res = subgroups()
    for rank in range(4):
        pair = sorted([rank, rank ^ 1])
        for it in range(2):
            local = [res[r]["local"][it] for r in pair]
            for mode in dc.MODES:
                for name, dtype16 in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
                    got = res[rank][f"ddpx_{name}_{mode}"][it]
                    assert torch.equal(got, dc.ref_compress_hook(local, dtype16)), (rank, name)
                got = res[rank][f"ddpx_fp16_{mode}"][it]
                diff = (got.double() - res[rank]["torch_fp16"][it].double()).abs()
                assert (diff <= dc.fp16_vs_torch_bound(local)).all()
                assert torch.equal(res[rank][f"ddpx_noop_{mode}"][it], res[rank]["local"][it])


def test_world_group_as_explicit_state():
    res = subgroups()
    for rank in range(4):
        for it in range(2):
            local = [res[r]["local"][it] for r in range(4)]
            assert torch.equal(res[rank]["ddpx_allreduce_native_world"][it],
                               res[rank]["torch_allreduce_world"][it])
            assert torch.equal(res[rank]["ddpx_fp16_dropin_world"][it],
                               dc.ref_compress_hook(local, torch.float16))


def rank_reinit(rank: int, world_size: int, port: int):
    """Uses ddpx's allreduce_hook with state None on the default group, destroys it, and
    re-initialises the default group without the last rank; then registers the hooks again
    (state None: the new default group) on a new DDP model."""
    ddp = dc.make_ddp(dc.make_model(), "ddpx_allreduce_dropin")
    dc.loss_fn(ddp, *dc.make_batch(rank, 0)).backward()
    dist.barrier()
    del ddp
    dist.destroy_process_group()
    if rank == world_size - 1:
        return None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size - 1, timeout=datetime.timedelta(seconds=10))
    out = {}
    for config in ("torch_allreduce", "ddpx_allreduce_dropin", "ddpx_allreduce_native"):
        ddp = dc.make_ddp(dc.make_model(), config)
        dc.loss_fn(ddp, *dc.make_batch(rank, 0)).backward()
        out[config] = dc.flat_grad(ddp)
    return out


def test_state_none_follows_a_reinitialised_default_group():
    res = run_ranks(rank_reinit, 3, args=(free_port(),), timeout=60)
    assert res[2] is None
    for rank in range(2):
        for mode in dc.MODES:
            assert torch.equal(res[rank][f"ddpx_allreduce_{mode}"],
                               res[rank]["torch_allreduce"]), (rank, mode)
