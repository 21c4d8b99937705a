"""Post-local SGD: ddpx.hooks.PostLocalSGDState / post_localSGD_hook, ddpx.model_averaging
(PeriodicModelAverager, HierarchicalModelAverager, average_parameters) and
ddpx.optim.PostLocalSGDOptimizer against torch's installed implementations, on Gloo ranks.

Set-up (post_local_sgd_cases.py): an MLP (20-64-64-8, tanh) under DDP with 4 KiB buckets, SGD
(lr 0.05, momentum 0.9), rank-dependent data, 30 steps; start_localSGD_iter = warmup_steps = 6,
period 4: global gradient averaging for steps 0-5, then local steps with parameter averaging at
steps 6, 10, ..., 26. The hook's subgroup is built with dist.new_group (torch's new_subgroups()
needs CUDA) and handed to both implementations.

Checks:
  * trajectories equal torch's (drop-in and native hook registration, through
    PostLocalSGDOptimizer or the averager directly, subgroup=None, a tiny averaging bucket):
    bit for bit, except a tiny averaging bucket on 4 ranks (rtol 1e-5 / atol 1e-6);
  * invariants that make those comparisons meaningful: the replicas coincide during warm-up and
    right after every averaging step, and differ on the local steps in between (by more than
    1e-4); post-local SGD differs from plain DDP where it should (and equals it where the
    subgroup is the whole world);
  * HierarchicalModelAverager {2: 2, 4: 4} on 4 ranks: torch's trajectory, pairs coincide at
    steps 6 + 4k, everybody at steps 8 + 4k;
  * checkpoint after 4 (warm-up) or 15 (local phase) steps and resume in fresh objects: the
    uninterrupted trajectory bit for bit; resuming without the hook's iter or the averager's
    step does NOT reproduce it (controls);
  * PostLocalSGDOptimizer: state_dict 'step', load_state_dict with / without it (warning),
    StepLR, zero_grad, shared param_groups / state, add_param_group;
  * average_parameters: mixed fp32/fp64 with torch's promotion, tiny buckets, non-contiguous,
    in place, last_stats bounds, parameters without grad skipped, non-member group;
  * errors and warnings: the same exception type as torch for each bad argument, and a clear
    ValueError for a hook / averager warm-up mismatch.
"""
import functools
import math

import pytest
import torch
import torch.distributed as dist

import ddpx
import post_local_sgd_cases as pc
import selection
from dist_utils import run_ranks

cfg = pc.cfg

# ---- launches ----------------------------------------------------------------------------------

# Subgroups of 2: on 2 ranks the world (post-local SGD equals plain DDP there), on 4 ranks
# {0, 1} and {2, 3}.
TRAIN_BOTH = {
    "torch": cfg("torch"),
    "dropin": cfg("ddpx"),
    "native": cfg("ddpx", mode="native"),
    "native/averager": cfg("ddpx", mode="native", driver="averager"),
    "dropin/tiny": cfg("ddpx", bucket_cap_mb=512 / 2 ** 20),
}
TRAIN = {
    2: {
        **TRAIN_BOTH,
        # subgroup=None: ddpx groups the ranks by host (one host here: both ranks)
        "dropin/nosub": cfg("ddpx", subgroup=None),
        "native/nosub": cfg("ddpx", mode="native", subgroup=None),
        # no gradient allreduce after warm-up: the replicas drift apart between averagings
        "torch/noar": cfg("torch", allreduce=False),
        "dropin/noar": cfg("ddpx", allreduce=False),
        "native/noar": cfg("ddpx", mode="native", allreduce=False),
        "native/noar/averager": cfg("ddpx", mode="native", allreduce=False, driver="averager"),
        "torch/sched": cfg("torch", allreduce=False, sched=(5, 0.5)),
        "dropin/sched": cfg("ddpx", allreduce=False, sched=(5, 0.5)),
        "ddp": cfg("ddp"),
    },
    4: {
        **TRAIN_BOTH,
        # subgroup=None: all four ranks on one host, as an explicit subgroup of 4
        "torch/sub4": cfg("torch", subgroup=4),
        "dropin/nosub": cfg("ddpx", subgroup=None),
        "native/nosub": cfg("ddpx", mode="native", subgroup=None),
        # hierarchical: hook subgroup of one rank, averaging in pairs every 2 steps and globally
        # every 4
        "torch/hier": cfg("torch", averager="hierarchical", hier={2: 2, 4: 4}, subgroup=1),
        "dropin/hier": cfg("ddpx", averager="hierarchical", hier={2: 2, 4: 4}, subgroup=1),
        "native/hier": cfg("ddpx", mode="native", averager="hierarchical", hier={2: 2, 4: 4},
                           subgroup=1),
        "native/hier/averager": cfg("ddpx", mode="native", averager="hierarchical",
                                    hier={2: 2, 4: 4}, subgroup=1, driver="averager"),
        "ddp": cfg("ddp"),
    },
}

# (name, config, save_at, how)
RESUME = {
    2: [
        ("noar/4", cfg("ddpx", allreduce=False), 4, "state_dict"),
        ("noar/15", cfg("ddpx", allreduce=False), 15, "state_dict"),
        ("native/noar/15", cfg("ddpx", mode="native", allreduce=False), 15, "state_dict"),
        ("noar/15/pickle", cfg("ddpx", allreduce=False), 15, "pickle"),
        ("torch/noar/15", cfg("torch", allreduce=False), 15, "state_dict"),
        ("sched/15", cfg("ddpx", allreduce=False, sched=(5, 0.5)), 15, "state_dict"),
        ("control/no_hook_state", cfg("ddpx", allreduce=False), 4, "no_hook_state"),
        ("control/no_step", cfg("ddpx", allreduce=False), 15, "no_step"),
    ],
    4: [
        ("sub2/15", cfg("ddpx"), 15, "state_dict"),
        ("hier/15", cfg("ddpx", averager="hierarchical", hier={2: 2, 4: 4}, subgroup=1), 15,
         "state_dict"),
    ],
}
CONTROLS = {"control/no_hook_state", "control/no_step"}

OTHER = {
    2: [("optimizer", "optimizer_behaviour", {}), ("param_groups", "averager_param_groups", {}),
        ("average", "average_direct", {}), ("errors", "errors", {}),
        ("state", "state_checks", {})],
    4: [("average", "average_direct", {})],
}


@functools.lru_cache(maxsize=None)
def launch(world_size):
    cases = [(f"train/{n}", "train", {"c": c}) for n, c in TRAIN[world_size].items()]
    cases += [(f"resume/{n}", "resume", {"c": c, "save_at": s, "how": how})
              for n, c, s, how in RESUME[world_size]]
    cases += OTHER[world_size]
    cases = selection.wanted_cases(__name__, cases)
    return run_ranks(pc.rank_cases, world_size, args=(cases,), timeout=240)


def case(world_size, name, rank=None):
    """One case's results (all ranks, or one); a case that raised fails here with its trace."""
    res = launch(world_size)
    for r, out in enumerate(res):
        got = out[name]
        if isinstance(got, dict) and "error" in got and len(got) == 1:
            pytest.fail(f"{name} raised on rank {r}:\n{got['error']}")
    return [out[name] for out in res] if rank is None else res[rank][name]


def train(world_size, name):
    return case(world_size, f"train/{name}")


def maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item()


AVERAGING_STEPS = list(range(pc.START, pc.STEPS, pc.PERIOD))           # 6, 10, ..., 26
LOCAL_STEPS = [s for s in range(pc.START, pc.STEPS) if s not in AVERAGING_STEPS]
RTOL, ATOL = 1e-5, 1e-6

DIFF = [(2, "dropin", "torch"), (2, "native", "torch"), (2, "native/averager", "torch"),
        (2, "dropin/tiny", "torch"), (2, "dropin/nosub", "torch"), (2, "native/nosub", "torch"),
        (2, "dropin/noar", "torch/noar"),
        (2, "native/noar", "torch/noar"), (2, "native/noar/averager", "torch/noar"),
        (2, "dropin/sched", "torch/sched"),
        (4, "dropin", "torch"), (4, "native", "torch"), (4, "native/averager", "torch"),
        (4, "dropin/tiny", "torch"), (4, "dropin/nosub", "torch/sub4"),
        (4, "native/nosub", "torch/sub4"),
        (4, "dropin/hier", "torch/hier"), (4, "native/hier", "torch/hier"),
        (4, "native/hier/averager", "torch/hier")]
DIFF_IDS = [f"W{w}-{n}" for w, n, _ in DIFF]


# ---- differential: trajectories ----------------------------------------------------------------

@pytest.mark.cases("train/{name}", "train/{ref}")
@pytest.mark.parametrize("world_size,name,ref", DIFF, ids=DIFF_IDS)
def test_trajectory_matches_torch(world_size, name, ref):
    """Parameters after each of the 30 steps, bit for bit: ddpx's hook reduces DDP's buckets
    as torch's does, and with the default bucket cap the averager reduces one buffer of the
    same size as torch's flat copy, so Gloo sums in the same order. With a tiny averaging
    bucket on 4 ranks the buffers differ, and so may the order of the sums: within RTOL/ATOL
    there (measured 7.5e-8); on 2 ranks a sum of two is exact in either order. Losses too."""
    mine, theirs = train(world_size, name), train(world_size, ref)
    for rank in range(world_size):
        a, b = mine[rank]["params"], theirs[rank]["params"]
        assert a.shape == (pc.STEPS, b.shape[1])
        if world_size == 2 or "tiny" not in name:
            bad = [s for s in range(pc.STEPS) if not torch.equal(a[s], b[s])]
            assert not bad, (rank, bad[:5], maxdiff(a, b))
        else:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(mine[rank]["losses"], theirs[rank]["losses"], rtol=RTOL,
                                   atol=0)


@pytest.mark.cases("train/{name}", "train/{ref}")
@pytest.mark.parametrize("world_size,name,ref", DIFF, ids=DIFF_IDS)
def test_counters_match_torch(world_size, name, ref):
    """The hook's iter and the averager's step after each step, as torch's: iter counts the
    warm-up steps only (1..6, then stays 6), the averager's step every step."""
    mine, theirs = train(world_size, name), train(world_size, ref)
    for rank in range(world_size):
        assert mine[rank]["iters"] == theirs[rank]["iters"]
        assert mine[rank]["avg_steps"] == theirs[rank]["avg_steps"]
        assert mine[rank]["lrs"] == theirs[rank]["lrs"]
    assert theirs[0]["iters"] == [min(i + 1, pc.START) for i in range(pc.STEPS)]
    assert theirs[0]["avg_steps"] == list(range(1, pc.STEPS + 1))


def _pairs_equal(res, step, ranks):
    return [torch.equal(res[a]["params"][step], res[b]["params"][step]) for a, b in ranks]


def _min_pair_diff(res, step, ranks):
    return min(maxdiff(res[a]["params"][step], res[b]["params"][step]) for a, b in ranks)


@pytest.mark.cases("train/{name}")
@pytest.mark.parametrize("name", ["torch/noar", "dropin/noar", "native/noar",
                                  "native/noar/averager"])
def test_replicas_drift_and_coincide_2_ranks(name):
    """No gradient allreduce after warm-up: the replicas are equal during warm-up and right after
    each averaging step, and drift apart (> 1e-4) on every local step."""
    res = train(2, name)
    for s in range(pc.START):
        assert torch.equal(res[0]["params"][s], res[1]["params"][s]), s
    for s in AVERAGING_STEPS:
        assert torch.equal(res[0]["params"][s], res[1]["params"][s]), s
    for s in LOCAL_STEPS:
        assert maxdiff(res[0]["params"][s], res[1]["params"][s]) > 1e-4, s


@pytest.mark.cases("train/{name}")
@pytest.mark.parametrize("name", ["torch", "dropin", "native", "native/averager", "dropin/tiny"])
def test_replicas_subgroups_4_ranks(name):
    """Subgroups {0, 1}, {2, 3}: within a subgroup the replicas stay equal (gradients averaged
    there), across subgroups they drift apart on local steps and coincide after averaging."""
    res = train(4, name)
    within, across = [(0, 1), (2, 3)], [(0, 2), (1, 3), (0, 3)]
    for s in range(pc.STEPS):
        assert all(_pairs_equal(res, s, within)), s
        if s < pc.START or s in AVERAGING_STEPS:
            assert all(_pairs_equal(res, s, across)), s
        else:
            assert _min_pair_diff(res, s, across) > 1e-4, s


@pytest.mark.cases("train/{name}")
@pytest.mark.parametrize("name", ["torch/hier", "dropin/hier", "native/hier",
                                  "native/hier/averager"])
def test_hierarchical_pattern(name):
    """{2: 2, 4: 4} after warm-up 6 (hook subgroup: one rank): at steps divisible by 4 all four
    replicas coincide, at the other even steps the pairs {0, 1} and {2, 3} only, at odd steps
    none."""
    res = train(4, name)
    pairs, across = [(0, 1), (2, 3)], [(0, 2), (1, 3)]
    everybody = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    for s in range(pc.START):
        assert all(_pairs_equal(res, s, everybody)), s
    for s in range(pc.START, pc.STEPS):
        if s % 4 == 0:
            assert all(_pairs_equal(res, s, everybody)), s
        elif s % 2 == 0:
            assert all(_pairs_equal(res, s, pairs)), s
            assert _min_pair_diff(res, s, across) > 1e-4, s
        else:
            assert _min_pair_diff(res, s, everybody) > 1e-4, s


@pytest.mark.cases("train/*")
def test_post_local_sgd_differs_from_ddp():
    """The comparisons above are not trivial: without gradient allreduce after warm-up the
    trajectory leaves plain DDP's by far more than the tolerance; with a subgroup that is the
    whole world (2 ranks) it is plain DDP, bit for bit (averaging equal replicas is exact)."""
    for world_size, name in ((2, "torch/noar"), (2, "dropin/noar"), (4, "torch"), (4, "dropin"),
                             (4, "dropin/hier")):
        res, ddp = train(world_size, name), train(world_size, "ddp")
        for rank in range(world_size):
            a, b = res[rank]["params"], ddp[rank]["params"]
            assert torch.equal(a[:pc.START], b[:pc.START])
            assert maxdiff(a[-1], b[-1]) > 1e3 * ATOL, (name, rank)
    for name in ("torch", "dropin", "native", "native/averager", "dropin/tiny"):
        res, ddp = train(2, name), train(2, "ddp")
        for rank in range(2):
            assert torch.equal(res[rank]["params"], ddp[rank]["params"]), name


@pytest.mark.cases("train/dropin/sched", "train/dropin/noar")
def test_lr_scheduler_applies():
    """StepLR(5, 0.5) on the wrapper changes the wrapped optimizer's lr as on torch's wrapper,
    and the trajectory differs from the run without it."""
    sched, plain = train(2, "dropin/sched"), train(2, "dropin/noar")
    assert sched[0]["lrs"] == [pc.LR * 0.5 ** ((i + 1) // 5) for i in range(pc.STEPS)]
    assert maxdiff(sched[0]["params"][-1], plain[0]["params"][-1]) > 1e-3


@pytest.mark.cases("train/*")
def test_training_makes_progress():
    for world_size, name in ((2, "dropin/noar"), (4, "dropin/hier")):
        for res in train(world_size, name):
            losses = res["losses"]
            assert losses[-5:].mean() < 0.7 * losses[:5].mean()


@pytest.mark.cases("train/*")
def test_averager_stats_after_training():
    """last_stats of the ddpx averagers after the run (step 29: no averaging -> zeros)."""
    for world_size, name in ((2, "dropin"), (4, "dropin/hier")):
        for res in train(world_size, name):
            stats = res["last_stats"]
            assert set(stats) >= {"tensors", "collectives", "inplace_tensors", "staged_tensors",
                                  "staging_bytes"}
            assert all(v == 0 for v in stats.values()), stats


# ---- checkpoint / resume ------------------------------------------------------------------------

RESUME_PARAMS = [
    pytest.param(w, n, id=f"W{w}-{n}")
    for w in (2, 4) for n, *_ in RESUME[w] if n not in CONTROLS]


@pytest.mark.cases("resume/{name}")
@pytest.mark.parametrize("world_size,name", RESUME_PARAMS)
def test_resume_reproduces_trajectory(world_size, name):
    """Checkpoint (model, PostLocalSGDOptimizer state_dict with the averager's step, hook
    state_dict or pickle, StepLR state) after `save_at` steps, fresh DDP / optimizer / averager /
    state / scheduler, load, continue: the uninterrupted run's parameters at every step, bit for
    bit. (torch/noar/15: the same harness with torch's classes, hook iter restored by hand.)"""
    save_at = {n: s for n, _, s, _ in RESUME[world_size]}[name]
    for rank, res in enumerate(case(world_size, f"resume/{name}")):
        assert res["restored"] == {"iter": min(save_at, pc.START), "avg_step": save_at}
        full, resumed = res["full"], res["resumed"]
        bad = [s for s in range(pc.STEPS) if not torch.equal(full[s], resumed[s])]
        assert not bad, (rank, bad[:5], maxdiff(full, resumed))
        assert res["full_iter"] == pc.START and res["full_avg_step"] == pc.STEPS


@pytest.mark.cases("resume/control/*")
def test_resume_controls_diverge():
    """Resuming without the hook's iter (fresh state: warm-up again) or without the averager's
    step (warns, step 0: averaging at other steps) does not reproduce the trajectory: the
    checks above can fail."""
    for name in CONTROLS:
        for res in case(2, f"resume/{name}"):
            save_at = {n: s for n, _, s, _ in RESUME[2]}[name]
            assert torch.equal(res["full"][:save_at], res["resumed"][:save_at])
            assert maxdiff(res["full"][-1], res["resumed"][-1]) > 1e-4, name
    assert case(2, "resume/control/no_step", 0)["restored"]["avg_step"] == 0
    assert case(2, "resume/control/no_hook_state", 0)["restored"]["iter"] == 0


# ---- PostLocalSGDOptimizer ---------------------------------------------------------------------

@pytest.mark.cases("optimizer")
def test_optimizer_wrapper_like_torch():
    for _rank, o in enumerate(case(2, "optimizer")):
        assert o["isinstance_optimizer"]
        assert o["param_groups_shared"] and o["state_shared"]
        assert o["optim_attr"] and o["averager_attr"]
        assert o["avg_step"] == 5
        assert o["sd_keys"] == o["torch_sd_keys"] == ["param_groups", "state", "step"]
        assert o["sd_step"] == 5 and o["torch_sd_step"] == 5
        assert o["sd_state_equal_local"]  # apart from 'step', the wrapped optimizer's
        assert o["loaded_step"] == 5
        assert o["no_step_step"] == 0
        assert len(o["no_step_warnings"]) == 1
        assert "step" in o["no_step_warnings"][0]
        assert o["add_param_group"] == (2, 0.5, True)


@pytest.mark.cases("optimizer")
def test_param_groups_follow_load_state_dict():
    for o in case(2, "optimizer"):
        shared, lr = o["after_load/ddpx"]
        assert shared
        assert lr == pytest.approx(pc.LR * 0.1)


@pytest.mark.cases("optimizer")
def test_optimizer_zero_grad():
    for o in case(2, "optimizer"):
        assert o["zero_grad_false"] == [0.0] * 6       # zeroed, kept
        assert o["zero_grad_true"] == [True] * 6       # set to None


@pytest.mark.cases("param_groups")
def test_averager_takes_param_groups():
    """average_parameters(optimizer.param_groups) and (parameters) give torch's values; a
    parameter without a gradient is skipped; ddpx averages in place (torch rebinds .data)."""
    res = case(2, "param_groups")
    for rank, o in enumerate(res):
        for kind in ("groups", "params"):
            t, d = o[f"torch/{kind}"], o[f"ddpx/{kind}"]
            for i in range(3):
                assert torch.equal(d["after0"][i], t["after0"][i]), (kind, i)
            assert torch.equal(d["a_after1"], t["a_after1"])
            assert torch.equal(d["a_after1"], d["after0"][0] + rank)  # step 1: not averaged
            assert d["step"] == t["step"] == 2
            assert d["inplace"]
    # averaged: equal on both ranks; frozen (no grad): still each rank's own
    for kind in ("groups", "params"):
        a0, a1 = res[0][f"ddpx/{kind}"]["after0"], res[1][f"ddpx/{kind}"]["after0"]
        assert torch.equal(a0[0], a1[0]) and torch.equal(a0[1], a1[1])
        assert maxdiff(a0[2], a1[2]) > 0.1


# ---- average_parameters directly ----------------------------------------------------------------

@pytest.mark.cases("average")
@pytest.mark.parametrize("world_size", [2, 4])
def test_average_parameters_mixed_dtypes(world_size):
    """fp32 and fp64 together: torch promotes to fp64, averages, casts back. The fp32 results
    are then the correctly rounded mean (the fp64 sum of a few fp32 values is exact), equal to
    torch's bit for bit on any number of ranks; fp64 ones on 2 ranks too, close on 4."""
    for res in case(world_size, "average"):
        ref = res["mixed/torch"]
        for cap in ("default", "tiny"):
            mine = res[f"mixed/{cap}"]
            assert res[f"mixed/{cap}/inplace"]
            assert res[f"mixed/{cap}/dtypes"] == [t.dtype for t in ref]
            for i, (a, b) in enumerate(zip(mine, ref)):
                if world_size == 2 or a.dtype == torch.float32:
                    assert torch.equal(a, b), (cap, i, maxdiff(a, b))
                else:
                    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.cases("average")
@pytest.mark.parametrize("world_size", [2, 4])
def test_average_parameters_fp32(world_size):
    for res in case(world_size, "average"):
        ref = res["fp32/torch"]
        for cap in ("default", "tiny"):
            assert res[f"fp32/{cap}/inplace"]
            for a, b in zip(res[f"fp32/{cap}"], ref):
                if world_size == 2:
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # averaged: the same on every rank
    res = case(world_size, "average")
    for r in range(1, world_size):
        for a, b in zip(res[r]["fp32/tiny"], res[0]["fp32/tiny"]):
            assert torch.equal(a, b)


@pytest.mark.cases("average")
@pytest.mark.parametrize("world_size", [2, 4])
def test_duplicate_parameters_average_like_torch(world_size):
    """A parameter listed twice (and views of it listed with it) is averaged once, as torch's
    averager does: bit for bit on 2 ranks, to rounding on 4 (torch sums a flat copy in another
    order)."""
    for res in case(world_size, "average"):
        d = res["duplicate"]
        tol = {} if world_size == 2 else {"rtol": RTOL, "atol": ATOL}
        for got in (d["averager"], d["views"]):
            if world_size == 2:
                assert torch.equal(got, d["torch"]), maxdiff(got, d["torch"])
            else:
                torch.testing.assert_close(got, d["torch"], **tol)


@pytest.mark.cases("average")
def test_period_and_warmup_settable_mid_run_like_torch():
    for res in case(2, "average"):
        assert res["schedule"]["ddpx"] == res["schedule"]["torch"] == [0, 2, 6, 10]


@pytest.mark.cases("average")
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_with_different_parameters_raise_value_error(world_size):
    for res in case(world_size, "average"):
        kind, message = res["mismatch"][:2]
        assert kind == "ValueError" and "passed different tensors" in message, res["mismatch"]


@pytest.mark.cases("average")
@pytest.mark.parametrize("world_size", [2, 4])
def test_average_parameters_non_contiguous(world_size):
    for res in case(world_size, "average"):
        got, ref, same_storage = res["noncontig"]
        assert same_storage
        torch.testing.assert_close(got, ref, rtol=0 if world_size == 2 else RTOL,
                                   atol=0 if world_size == 2 else ATOL)


@pytest.mark.cases("average")
def test_average_parameters_stats_bounded():
    """1 KiB buckets: the fp32 tensors (not the common dtype fp64) must be staged, in chunks of
    at most a bucket, so at least ceil(their fp64 bytes / 1 KiB) collectives; staging memory
    at most two buckets. Default cap: a handful of collectives, staging no larger than the
    promoted parameters. A step that does not average reports zeros."""
    res = case(2, "average")[0]
    nbytes = res["mixed_bytes"]
    dtypes = [t.dtype for t in res["mixed/torch"]]
    fp32_numel = sum(b // 4 for b, d in zip(nbytes, dtypes) if d == torch.float32)
    promoted = sum((b // 4 if d == torch.float32 else b // 8) * 8 for b, d in zip(nbytes, dtypes))
    tiny, default = res["stats/tiny"], res["stats/default"]
    for s in (tiny, default):
        assert s["tensors"] == len(nbytes)
        assert s["inplace_tensors"] + s["staged_tensors"] == len(nbytes)
        assert s["staged_tensors"] >= sum(d == torch.float32 for d in dtypes)
        assert s["collectives"] >= 1
    assert tiny["collectives"] >= math.ceil(fp32_numel * 8 / 1024), tiny
    assert tiny["staging_bytes"] <= 2 * 1024, tiny
    assert default["collectives"] <= 3, default
    assert default["staging_bytes"] <= promoted, (default, promoted)
    assert tiny["collectives"] > default["collectives"]
    for cap in ("tiny", "default"):
        assert all(v == 0 for v in res[f"stats/{cap}/idle"].values()), res[f"stats/{cap}/idle"]


@pytest.mark.cases("average")
def test_params_without_grad_skipped():
    for rank, res in enumerate(case(2, "average")):
        assert res["get_params_to_average"] == [True, False, True]
        got = res["or_groups"]
        assert torch.equal(got[0], torch.full((3,), 0.5))
        assert torch.equal(got[1], torch.full((3,), float(rank)))  # no grad: untouched
        assert torch.equal(got[2], torch.full((3,), 0.5))


@pytest.mark.cases("average")
def test_average_parameters_non_member_group():
    """A group of ranks {0, 1} on 4 ranks: the members average (as torch), the others are left
    alone (torch's NON_GROUP_MEMBER)."""
    res = case(4, "average")
    for rank, r in enumerate(res):
        p = r["pair"]
        for a, b, before in zip(p["ddpx"], p["torch"], p["before"]):
            assert torch.equal(a, b)
            if rank >= 2:
                assert torch.equal(a, before)
    for a, b in zip(res[0]["pair"]["ddpx"], res[1]["pair"]["ddpx"]):
        assert torch.equal(a, b)


# ---- errors and warnings ------------------------------------------------------------------------

ERROR_CASES = ["period0", "period-1", "warmup-1", "hier_empty", "hier_none", "hier_period0",
               "hier_last_size", "hier_warmup-1"]
WARNING_CASES = ["period1", "hier_max_period1"]


@pytest.mark.cases("errors")
@pytest.mark.parametrize("name", ERROR_CASES)
def test_bad_arguments_raise_like_torch(name):
    for res in case(2, "errors"):
        t, d = res[name]["torch"], res[name]["ddpx"]
        assert t[0] == "ValueError", t
        assert d[0] == "ValueError", d
        assert d[1], d  # a message


@pytest.mark.cases("errors")
def test_last_group_size_message():
    d = case(2, "errors", 0)["hier_last_size"]["ddpx"]
    assert "1" in d[1] and "2" in d[1], d


@pytest.mark.cases("errors")
@pytest.mark.parametrize("name", list(WARNING_CASES) + ["period2", "hier_ok"])
def test_warnings_like_torch(name):
    for res in case(2, "errors"):
        t, d = res[name]["torch"], res[name]["ddpx"]
        assert t[0] is None and d[0] is None, (t, d)
        warned = [w for w in d[2] if w.startswith("UserWarning")]
        assert len(warned) == (1 if name in WARNING_CASES else 0), d[2]
        assert len([w for w in t[2] if w.startswith("UserWarning")]) == len(warned)


@pytest.mark.cases("errors")
def test_negative_start_localSGD_iter():
    for res in case(2, "errors"):
        assert res["state_start-1"][0] == "ValueError", res["state_start-1"]


@pytest.mark.cases("errors")
@pytest.mark.parametrize("name", ["mismatch_averager", "mismatch_optim"])
def test_warmup_mismatch_is_a_clear_error(name):
    """Hook start_localSGD_iter 6, averager warmup_steps 4: ValueError naming both at the first
    averaging call, on every rank (no rank left waiting in a collective)."""
    for res in case(2, "errors"):
        exc, msg, _ = res[name]
        assert exc == "ValueError", (exc, msg)
        assert "start_localSGD_iter" in msg and "warmup" in msg, msg
        assert "6" in msg and "4" in msg, msg
        assert res[name + "/avg_step"] <= 1


@pytest.mark.cases("errors")
def test_matching_warmup_no_error():
    for res in case(2, "errors"):
        assert res["match_optim"][0] is None, res["match_optim"]
        assert res["match_optim/avg_step"] == 3


# ---- PostLocalSGDState --------------------------------------------------------------------------

@pytest.mark.cases("state")
def test_state_attributes_and_round_trips():
    for res in case(2, "state"):
        assert res["attrs"] == (True, True, 5, False, 0)
        assert res["default_allreduce"] is True
        assert res["iter_set"] == 3
        assert res["has_maybe_increase_iter"]
        sd = res["state_dict"]
        assert {k: sd[k] for k in ("iter", "start_localSGD_iter",
                                   "post_local_gradient_allreduce")} == {
            "iter": 3, "start_localSGD_iter": 5, "post_local_gradient_allreduce": False}
        # nothing else but metadata (e.g. a format tag): no process groups
        assert all(isinstance(v, (int, bool, str)) for v in sd.values()), sd
        assert res["loaded"] == (3, 5, False)
        assert res["unpickled"] == (3, 5, False)
        assert res["bad_load"][0] is not None, res["bad_load"]


@pytest.mark.cases("state")
def test_state_iter_counts_like_torch():
    """maybe_increase_iter(bucket) on the same buckets: the same counts as torch's state (one
    per backward pass, on the last bucket), with several buckets per pass."""
    for res in case(2, "state"):
        seen = res["maybe_increase_iter"]
        assert len(seen) > 6  # several buckets per backward pass
        assert all(t == d for t, d in seen), seen
        assert seen[-1] == (6, 6)


def rank_agreement(rank: int, world_size: int):
    """The agreement run before averaging's collectives: the digests of every rank compared by
    one all-reduce; the last rank differs in the second digest."""
    group = dist.group.WORLD
    same = ddpx._C._all_ranks_agree([11, 22], group, torch.device("cpu"))
    differ = ddpx._C._all_ranks_agree([11, 22 + (rank == world_size - 1)], group,
                                      torch.device("cpu"), "host")
    return same, differ


@pytest.mark.parametrize("world_size", [2, 3])
def test_agreement_of_digests(world_size):
    for same, differ in run_ranks(rank_agreement, world_size):
        assert same == [True, True]
        assert differ == [True, False]



def rank_subgroups_time_out_as_the_default_group(rank: int, world_size: int):
    """Ranks 1-3 stay away from every collective; rank 0 uses each subgroup ddpx makes for the
    user (post-local SGD's intra-node group, a hierarchical averager's level group) and must be
    told within the default group's timeout (3 s here), not new_group's 30 minutes."""
    import collections
    import time

    from ddpx import _groups
    from dist_utils import exit_rank, wait_for_result_of
    known = _groups.default_group_timeout()
    groups = {
        "intra_node_subgroup": _groups.intra_node_subgroup(),
        # The first level's groups: {0, 1} and {2, 3}.
        "hierarchical": ddpx.model_averaging.HierarchicalModelAverager(
            collections.OrderedDict([(1, 2), (2, world_size)]),
            warmup_steps=0).period_process_group_dict[1],
    }
    if rank != 0:
        wait_for_result_of(0, 60)
        exit_rank(None)
    waited = {}
    for name, group in groups.items():
        assert group is not dist.group.WORLD, name
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(3), group=group)
            waited[name] = ("returned", time.monotonic() - t0)
        except RuntimeError as exc:
            waited[name] = (str(exc)[:200], time.monotonic() - t0)
    exit_rank((None if known is None else known.total_seconds(), waited))


def test_subgroups_time_out_as_the_default_group():
    known, waited = run_ranks(rank_subgroups_time_out_as_the_default_group, 4,
                              collective_timeout_s=3.0, timeout=120)[0]
    assert known == 3.0
    for name, (what, seconds) in waited.items():
        assert what != "returned", name
        assert "timed out" in what.lower() or "timeout" in what.lower(), (name, what)
        assert 2.5 <= seconds < 15, (name, seconds)
