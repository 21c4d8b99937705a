"""ZeroRedundancyOptimizer: ddpx.optim.ZeroRedundancyOptimizer against torch's
torch.distributed.optim.ZeroRedundancyOptimizer (same API), on 1-4 Gloo ranks.

    DDPX_ZERO_IMPL=ddpx   (default) tests ddpx's class
    DDPX_ZERO_IMPL=torch  runs the same suite against torch's own class: every test that describes
                          torch's behaviour passes with it (checked on Debian's torch 1.13 and
                          pip's 2.11); the tests of ddpx's improvements (`ddpx_only`) are skipped

Set-up (zero_cases.py): a 12-32-32-16-4 tanh MLP (2116 parameters in 8 tensors), rank-dependent
data, 5 steps; the implementation under test and torch's ZeRO (or DDP + the unsharded optimizer)
run side by side in each rank process on deep copies of the same model. Comparisons are per
step, on all parameters: bit for bit, except for SGD / Adam / AdamW under ddpx, which steps them
with its own fused kernels (rel_err <= 1e-6 relative to the largest |parameter|).

Checks:
  * differential against torch's ZeRO on 1-4 ranks (no DDP: every rank's shard is updated with
    its own gradients, so the partition and the broadcast sources matter): SGD (plain, momentum,
    nesterov, weight decay + dampening), Adam (+ weight decay, amsgrad), AdamW (+ amsgrad,
    maximize), RMSprop and Adagrad (the wrapped optimizer's own step), with and without
    parameters_as_bucket_view, two parameter groups with their own lr, a frozen parameter and a
    parameter whose grad stays None (both never move); the replicas stay equal bit for bit;
  * DDP + ZeRO over ddp.parameters() against DDP + the unsharded optimizer;
  * a process group of ranks {1, 3} of 4 (group ranks are not global ranks); the API's facts
    (Optimizer, Joinable, join_device, join_process_group, .optim's class, zero_grad);
  * the partition (zero.optim.param_groups) equals torch's sorted-greedy partition (recomputed
    here, and torch's own), with ties and empty shards;
  * StepLR on the ZeRO optimizer; add_param_group after construction; Join with uneven inputs
    (rank r runs 3 + r iterations); step(closure) and step(**kwargs);
  * checkpoints: consolidate_state_dict(to=k) + state_dict() on rank k against torch's and against
    the unsharded optimizer's state_dict, RuntimeError elsewhere; a checkpoint saved on W1 ranks
    resumes on W2 ranks as the unsharded optimizer resumes; load_state_dict leaves its argument
    alone (ddpx only: torch's sets other ranks' entries of state_dict['state'] to None);
  * bad constructor arguments: torch's exception types, messages that name the problem.
"""
import fcntl
import functools
import os

import pytest
import torch

import selection
import zero_cases as zc
from dist_utils import run_ranks

IMPL = zc.IMPL
zero_cls = zc.zero_cls

ddpx_only = pytest.mark.skipif(IMPL == "torch", reason="a ddpx improvement over torch's class")

WORLD_SIZES = [1, 2, 3, 4]
# Gloo's timeout in the ranks: ample for these tiny collectives, and a rank left waiting by a
# peer that diverged (a bug) fails the launch with its traceback instead of stalling it.
COLLECTIVE_TIMEOUT_S = 30
BUCKET = [False, True]


def bv(bucket):
    return "bucket" if bucket else "nobucket"


# ---- launches ----------------------------------------------------------------------------------

# (optimizer, model kind, two param groups)
DIFF = ([(opt, "frozen", False) for opt in zc.OPTS]
        + [("sgd_momentum", "plain", False), ("adam", "plain", False),
           ("sgd_nesterov", "frozen", True), ("adamw", "frozen", True),
           ("rmsprop", "plain", True)])
DDP_DIFF = ["sgd_nesterov", "adam", "adamw_amsgrad_maximize", "rmsprop"]
# parameter sizes per group: ties (equal sizes keep their order, equal totals go to the lowest
# rank), groups (the running totals carry over; a one-parameter group leaves empty local groups),
# few (fewer parameters than ranks: some ranks own nothing)
PARTITIONS = {
    "ties": [[5, 3, 5, 8, 1, 5, 3, 2, 8, 5]],
    "groups": [[7, 7, 2], [9, 1, 1, 4], [3]],
    "few": [[10, 20]],
}
JOIN = [("sgd_momentum", False), ("adam", True)]
SUBGROUP = [("sgd_momentum", False), ("adam", True)]


def diff_name(opt, kind, groups, bucket):
    return f"diff/{opt}/{kind}/{'groups' if groups else 'onegroup'}/{bv(bucket)}"


# A launch's results are computed once per test session and shared by the xdist workers (with
# `-n 2` both workers would otherwise run every launch, since xdist deals the tests of one world
# size to both): the first worker to need one runs it while holding a lock file and saves the
# results next to it, the others wait and load them. The folder is under the session's pytest
# basetemp (the controller's, with xdist), which pytest clears away like any tmp_path.
_SHARED = None


@pytest.fixture(scope="session", autouse=True)
def shared_dir(tmp_path_factory):
    global _SHARED
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    _SHARED = base / f"ddpx_zero_{IMPL}"
    _SHARED.mkdir(exist_ok=True)
    return _SHARED


def shared(name, compute):
    """compute(), once per session across the xdist workers (see above). A launch that fails
    (a rank crashed or hung) is not run again: its error is saved in its place, and every test
    that reads it fails with that error at once."""
    assert _SHARED is not None
    path = _SHARED / f"{name}.pt"
    with open(_SHARED / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            result = torch.load(path)
        else:
            try:
                result = compute()
            except Exception as exc:  # noqa: BLE001 - every reader fails with it
                result = {_FAILED: f"{type(exc).__name__}: {exc}"}
            torch.save(result, str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)
    if isinstance(result, dict) and _FAILED in result:
        pytest.fail(f"{name} failed:\n{result[_FAILED]}", pytrace=False)
    return result


_FAILED = "launch failed"


def ckpt_path(world_size):
    return str(_SHARED / f"ckpt_W{world_size}.pt")


@functools.lru_cache(maxsize=None)
def launch(world_size):
    return shared(f"launch_W{world_size}", lambda: _launch(world_size))


def _launch(world_size):
    cases = [(diff_name(o, k, g, b), "diff", dict(opt=o, bucket=b, kind=k, groups=g))
             for o, k, g in DIFF for b in BUCKET]
    cases += [(f"ddp/{o}/{bv(b)}", "ddp_diff", dict(opt=o, bucket=b))
              for o in DDP_DIFF for b in BUCKET]
    cases += [(f"partition/{n}", "partition", dict(sizes=s)) for n, s in PARTITIONS.items()]
    if world_size in (2, 3):
        cases += [(f"sched/{bv(b)}", "sched", dict(opt="sgd_momentum", bucket=b))
                  for b in BUCKET]
        cases += [(f"add_group/{bv(b)}", "add_group", dict(opt="adam", bucket=b))
                  for b in BUCKET]
    if world_size == 2:
        cases += [(f"closure/{bv(b)}", "closure_kwargs", dict(bucket=b)) for b in BUCKET]
        cases += [("api", "api", {})]
    if world_size == 4:
        cases += [(f"subgroup/{o}/{bv(b)}", "subgroup", dict(opt=o, bucket=b))
                  for o, b in SUBGROUP]
    if world_size >= 2:
        cases += [(f"join/{o}/{bv(b)}", "join", dict(opt=o, bucket=b)) for o, b in JOIN]
        cases += [(f"ckpt/to{t}/{bv(b)}", "ckpt", dict(to=t, bucket=b))
                  for t, b in ((0, False), (world_size - 1, True))]
    if world_size == 1:
        cases += [("ckpt/to0/nobucket", "ckpt", dict(to=0, bucket=False))]
        cases += [("errors", "errors", {})]
    # the checkpoint that test_resume_across_world_sizes loads on other world sizes
    cases += [("save", "save", dict(path=ckpt_path(world_size)))]
    cases = selection.wanted_cases(__name__, cases)
    return run_ranks(zc.rank_cases, world_size, args=(IMPL, cases), timeout=240,
                     collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def case(world_size, name):
    """One case's results on all ranks; a case that raised fails here with its traceback."""
    res = launch(world_size)
    for rank, out in enumerate(res):
        got = out[name]
        if isinstance(got, dict) and "error" in got and len(got) == 1:
            pytest.fail(f"{name} raised on rank {rank} of {world_size}:\n{got['error']}")
    return [out[name] for out in res]


# ---- helpers -----------------------------------------------------------------------------------

def assert_traj(mine, ref, tol, what=""):
    """Trajectories [steps + 1, numel]: per step, rel_err <= tol (tol 0: torch.equal)."""
    assert mine.shape == ref.shape, (what, mine.shape, ref.shape)
    for s in range(ref.shape[0]):
        err = zc.rel_err(mine[s], ref[s])
        if tol == 0:
            assert torch.equal(mine[s], ref[s]), f"{what}: step {s}: rel_err {err:.3g} (not equal)"
        else:
            assert err <= tol, f"{what}: step {s}: rel_err {err:.3g} > {tol:g}"


def assert_moves(traj, what="", at_least=1e-4):
    """Every step changes the parameters (so the comparisons mean something)."""
    for s in range(1, traj.shape[0]):
        assert zc.rel_err(traj[s], traj[s - 1]) > at_least, f"{what}: step {s} did not move"


def assert_replicas_equal(res, key):
    for rank in range(1, len(res)):
        assert torch.equal(res[rank][key], res[0][key]), f"{key}: rank {rank} differs from rank 0"


def state_close(mine, ref, tol, what=""):
    """Two optimizer state_dict()['state']s: same indices, same entries, tensors of the same dtype
    and shape with rel_err <= tol, other values equal."""
    assert sorted(mine.keys()) == sorted(ref.keys()), (what, sorted(mine), sorted(ref))
    for index in ref:
        a, b = mine[index], ref[index]
        assert sorted(a.keys()) == sorted(b.keys()), (what, index, sorted(a), sorted(b))
        for k in b:
            if torch.is_tensor(b[k]):
                assert torch.is_tensor(a[k]), (what, index, k, type(a[k]))
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, index, k)
                err = zc.rel_err(a[k], b[k])
                assert err <= tol, f"{what}: state[{index}][{k!r}]: rel_err {err:.3g} > {tol:g}"
            else:
                assert a[k] == b[k], (what, index, k, a[k], b[k])


def spans_of(res, names):
    return [(a, b) for n, a, b in res[0]["spans"] if n in names]


# ---- 1. differential against torch's ZeRO ------------------------------------------------------

DIFF_PARAMS = [(w, o, k, g, b) for w in WORLD_SIZES for o, k, g in DIFF for b in BUCKET]
DIFF_IDS = [f"W{w}-{o}-{k}-{'groups' if g else 'onegroup'}-{bv(b)}"
            for w, o, k, g, b in DIFF_PARAMS]


@pytest.mark.cases("diff/{opt}/{kind}/*")
@pytest.mark.parametrize("world_size,opt,kind,groups,bucket", DIFF_PARAMS, ids=DIFF_IDS)
def test_matches_torch_zero(world_size, opt, kind, groups, bucket):
    """Parameters after every step equal torch's ZeRO's (within the optimizer's tolerance), on
    every rank; the replicas equal each other bit for bit; the trajectory moves; a frozen
    parameter and a parameter whose grad stays None never change."""
    res = case(world_size, diff_name(opt, kind, groups, bucket))
    tol = zc.tolerance(opt)
    for rank, out in enumerate(res):
        assert_traj(out["impl"], out["ref"], tol, f"rank {rank}")
        assert_moves(out["ref"], f"rank {rank}")
    assert_replicas_equal(res, "impl")
    if kind == "frozen":
        for a, b in spans_of(res, {"fc2.bias", "unused.weight", "unused.bias"}):
            for out in res:
                assert (out["impl"][:, a:b] == out["impl"][0, a:b]).all(), (a, b)


@pytest.mark.cases("diff/{opt}/{kind}/*")
@pytest.mark.parametrize("world_size,opt,kind,groups", [
    (w, o, k, g) for w in WORLD_SIZES for o, k, g in
    [("sgd", "frozen", False), ("adam", "plain", False), ("sgd_nesterov", "frozen", True)]],
    ids=lambda v: str(v))
def test_partition_of_model_matches_torch(world_size, opt, kind, groups):
    """zero.optim.param_groups on each rank: torch's sorted-greedy partition of the model's
    parameters (one local group per group, empty ones included), as torch's ZeRO builds it, with
    each group's hyperparameters (lr)."""
    res = case(world_size, diff_name(opt, kind, groups, False))
    numels = res[0]["ref_numels"]
    expected = zc.greedy_partition(numels, world_size)
    for rank, out in enumerate(res):
        assert out["ref_partition"] == expected[rank], (rank, "torch", out["ref_partition"])
        assert out["impl_partition"] == expected[rank], (rank, out["impl_partition"])
        assert out["impl_numels"] == numels
        assert out["impl_lrs"] == out["ref_lrs"]
    lr = zc.OPTS[opt][1]["lr"]
    assert res[0]["impl_lrs"] == ([lr * 0.5, lr * 2] if groups else [lr])


@pytest.mark.cases("partition/{name}")
@pytest.mark.parametrize("world_size,name", [(w, n) for w in WORLD_SIZES for n in PARTITIONS],
                         ids=lambda v: str(v))
def test_partition_matches_torch(world_size, name):
    """Ties and empty shards: the same parameters per rank and group as torch's sorted-greedy."""
    sizes = PARTITIONS[name]
    res = case(world_size, f"partition/{name}")
    numbered, i = [], 0
    for group in sizes:
        numbered.append([(i + j, n) for j, n in enumerate(group)])
        i += len(group)
    expected = zc.greedy_partition(numbered, world_size)
    owned = sorted(x for out in res for g in out["impl"] for x in g)
    assert owned == list(range(i))  # every parameter on exactly one rank
    for rank, out in enumerate(res):
        assert out["ref"] == expected[rank], (rank, "torch", out["ref"])
        assert out["impl"] == expected[rank], (rank, out["impl"])
        assert out["impl_lrs"] == out["ref_lrs"] == [0.01 * (g + 1) for g in range(len(sizes))]


def test_greedy_partition_reference():
    """The reference implementation of torch's partition, on hand-worked examples."""
    # sizes 5 3 5 8: sorted 8(3) 5(0) 5(2) 3(1); totals r0: 8, r1: 5 -> 5(2) to r1 (10) -> 3 to r0
    assert zc.greedy_partition([[(0, 5), (1, 3), (2, 5), (3, 8)]], 2) == [[[3, 1]], [[0, 2]]]
    # ties go to the lowest rank; totals carry across groups (the 1 goes to the empty rank 2)
    assert zc.greedy_partition([[(0, 4), (1, 4)], [(2, 1)]], 3) == [[[0], []], [[1], []],
                                                                     [[], [2]]]
    assert zc.greedy_partition([[(0, 4), (1, 4)], [(2, 1)]], 2) == [[[0], [2]], [[1], []]]


@pytest.mark.cases("subgroup/{opt}/*")
@pytest.mark.parametrize("opt,bucket", SUBGROUP, ids=lambda v: str(v))
def test_process_group_of_some_ranks(opt, bucket):
    """process_group = ranks {1, 3} of 4 (group rank 1 is global rank 3): torch's partition and
    trajectory on both members, equal replicas; consolidate_state_dict(to=1) lands on global rank
    3 (torch's state_dict there; RuntimeError on global rank 1); join_process_group is the group."""
    res = case(4, f"subgroup/{opt}/{bv(bucket)}")
    assert res[0] is None and res[2] is None
    tol = zc.tolerance(opt)
    for rank in (1, 3):
        out = res[rank]
        assert out["impl_partition"] == out["ref_partition"], rank
        assert_traj(out["impl"], out["ref"], tol, f"rank {rank}")
        assert_moves(out["ref"], f"rank {rank}")
        assert out["impl_group_ok"] and out["ref_group_ok"]
    assert torch.equal(res[1]["impl"], res[3]["impl"])
    assert res[1]["impl_sd"][0] == "RuntimeError", res[1]["impl_sd"]
    mine, ref = res[3]["impl_sd"], res[3]["ref_sd"]
    assert isinstance(mine, dict), mine
    assert mine["param_groups"] == ref["param_groups"]
    state_close(mine["state"], ref["state"], tol, "vs torch's ZeRO")


@pytest.mark.cases("api")
def test_api_facts():
    """A torch.optim.Optimizer and a Joinable; join_device is the parameters' device,
    join_process_group the WORLD group (or the group given); zero.optim is an instance of
    optimizer_class; the exposed and local param_groups carry torch's keys; zero_grad() and
    zero_grad(set_to_none=False) clear every parameter's gradient (owned or not) as torch's do;
    step() without a closure returns None."""
    res = case(2, "api")
    for _rank, out in enumerate(res):
        mine, ref = out["impl"], out["ref"]
        assert mine == ref, {k: (mine.get(k), ref[k]) for k in ref if mine.get(k) != ref[k]}
        assert mine["is_optimizer"] and mine["is_joinable"] and mine["optim_is_adam"]
        assert mine["join_device"] == "cpu" and mine["join_group_is_world"]
        assert mine["explicit_group_ok"]
        assert mine["groups"] == [8]
        assert all(g != "none" and g > 0 for g in mine["grads_before"])
        assert mine["zero_grad_false"] == [0.0] * 8
        assert mine["step_returns"] == "None"


# ---- 2. against DDP + the unsharded optimizer --------------------------------------------------

DDP_PARAMS = [(w, o, b) for w in WORLD_SIZES for o in DDP_DIFF for b in BUCKET]


@pytest.mark.cases("ddp/{opt}/*")
@pytest.mark.parametrize("world_size,opt,bucket", DDP_PARAMS,
                         ids=[f"W{w}-{o}-{bv(b)}" for w, o, b in DDP_PARAMS])
def test_matches_ddp_unsharded(world_size, opt, bucket):
    """DDP + ZeRO(ddp.parameters()) follows DDP + the plain optimizer, step by step."""
    res = case(world_size, f"ddp/{opt}/{bv(bucket)}")
    for rank, out in enumerate(res):
        assert_traj(out["impl"], out["ref"], zc.tolerance(opt), f"rank {rank}")
        assert_moves(out["ref"], f"rank {rank}")
    assert_replicas_equal(res, "impl")


# ---- 4. LR scheduler ---------------------------------------------------------------------------

@pytest.mark.cases("sched/*")
@pytest.mark.parametrize("world_size,bucket", [(w, b) for w in (2, 3) for b in BUCKET],
                         ids=lambda v: str(v))
def test_lr_scheduler(world_size, bucket):
    """StepLR(step_size=2, gamma=0.5) on ZeRO: step s runs the local optimizer with the groups'
    lr * 0.5 ** (s // 2); the trajectory is torch's, and differs from the constant-lr one from
    step 3 on (equal before)."""
    res = case(world_size, f"sched/{bv(bucket)}")
    lr = zc.OPTS["sgd_momentum"][1]["lr"]
    base = [lr * 0.5, lr * 2]
    steps = res[0]["impl"].shape[0] - 1
    for rank, out in enumerate(res):
        assert out["impl_local_lrs"] == [[b * 0.5 ** (s // 2) for b in base]
                                         for s in range(steps)], rank
        assert out["impl_lrs"] == [[b * 0.5 ** ((s + 1) // 2) for b in base]
                                   for s in range(steps)], rank
        assert out["impl_local_lrs"] == out["ref_local_lrs"]
        assert out["impl_lrs"] == out["ref_lrs"]
        assert_traj(out["impl"], out["ref"], zc.tolerance("sgd_momentum"), f"rank {rank}")
        assert torch.equal(out["impl"][:3], out["nosched"][:3])
        assert zc.rel_err(out["impl"][-1], out["nosched"][-1]) > 1e-4
    assert_replicas_equal(res, "impl")


# ---- 5. add_param_group ------------------------------------------------------------------------

@pytest.mark.cases("add_group/*")
@pytest.mark.parametrize("world_size,bucket", [(w, b) for w in (2, 3) for b in BUCKET],
                         ids=lambda v: str(v))
def test_add_param_group(world_size, bucket):
    """add_param_group(fc3 + fc4) after 2 Adam steps on fc1 + fc2: the new parameters are
    partitioned as torch does (the old ones stay where they were), the local optimizer gets the
    new group (with its lr), and 3 more steps follow torch's."""
    res = case(world_size, f"add_group/{bv(bucket)}")
    lr = zc.OPTS["adam"][1]["lr"]
    expected = zc.greedy_partition(res[0]["ref_numels"], world_size)
    new = spans_of(res, {"fc3.weight", "fc3.bias", "fc4.weight", "fc4.bias"})
    for rank, out in enumerate(res):
        assert out["ref_partition"] == expected[rank]
        assert out["impl_partition"] == expected[rank], (rank, out["impl_partition"])
        assert out["impl_partition"][0] == out["impl_partition_before"][0]
        assert out["impl_ngroups"] == out["ref_ngroups"] == (2, 2)
        assert out["impl_lrs"] == out["ref_lrs"] == [lr, lr / 4]
        assert_traj(out["impl"], out["ref"], zc.tolerance("adam"), f"rank {rank}")
        traj = out["impl"]
        for a, b in new:
            assert torch.equal(traj[2, a:b], traj[0, a:b]), "a new parameter moved before add"
            assert zc.rel_err(traj[3, a:b], traj[2, a:b]) > 1e-5, "not stepped after add"
    assert_replicas_equal(res, "impl")


# ---- 6. Join -----------------------------------------------------------------------------------

JOIN_PARAMS = [(w, o, b) for w in (2, 3, 4) for o, b in JOIN]


@pytest.mark.cases("join/{opt}/*")
@pytest.mark.parametrize("world_size,opt,bucket", JOIN_PARAMS,
                         ids=[f"W{w}-{o}-{bv(b)}" for w, o, b in JOIN_PARAMS])
def test_join_uneven_inputs(world_size, opt, bucket):
    """Join([ddp, zero]), rank r running 3 + r iterations: the final parameters are equal on all
    ranks and equal torch's ZeRO's under the same schedule."""
    res = case(world_size, f"join/{opt}/{bv(bucket)}")
    assert_replicas_equal(res, "impl")
    assert_replicas_equal(res, "ref")
    for rank, out in enumerate(res):
        assert_traj(out["impl"][None], out["ref"][None], zc.tolerance(opt), f"rank {rank}")
        assert zc.rel_err(out["impl"], out["init"]) > 1e-3


# ---- 8. step(closure), step(**kwargs) ----------------------------------------------------------

@pytest.mark.cases("closure/*")
@pytest.mark.parametrize("bucket", BUCKET, ids=bv)
def test_step_closure_returns_loss(bucket):
    """step(closure) runs the closure once and returns its loss; the steps follow torch's."""
    res = case(2, f"closure/{bv(bucket)}")
    for rank, out in enumerate(res):
        mine, ref = out["impl_closure"], out["ref_closure"]
        assert len(mine["computed"]) == len(mine["returned"]) == 3
        for ret, loss in zip(mine["returned"], mine["computed"]):
            assert ret is not None and torch.equal(ret, loss), (rank, ret, loss)
        assert [r.item() for r in ref["returned"]] == [c.item() for c in ref["computed"]]
        assert_traj(mine["traj"], ref["traj"], zc.tolerance("sgd_momentum"), f"rank {rank}")
        assert_moves(mine["traj"])


@pytest.mark.cases("closure/*")
@pytest.mark.parametrize("bucket", BUCKET, ids=bv)
def test_step_kwargs_reach_optimizer(bucket):
    """step(scale=2.0) reaches the local optimizer's step(): every parameter it owns saw scale
    2.0 and moved by exactly -lr * 2.0 * its own gradient; torch's trajectory bit for bit."""
    res = case(2, f"closure/{bv(bucket)}")
    total = 0
    for rank, out in enumerate(res):
        mine, ref = out["impl_kwargs"], out["ref_kwargs"]
        assert mine["scales"] == [2.0] * mine["owned"], rank
        assert mine["own_ok"] == [True] * mine["owned"], rank
        assert_traj(mine["traj"], ref["traj"], 0.0, f"rank {rank}")
        total += mine["owned"]
    assert total == 8


# ---- 7. checkpoints ----------------------------------------------------------------------------

CKPT_PARAMS = [(1, 0, False)] + [(w, t, b) for w in (2, 3, 4)
                                 for t, b in ((0, False), (w - 1, True))]


@pytest.mark.cases("ckpt/to{to}/*")
@pytest.mark.parametrize("world_size,to,bucket", CKPT_PARAMS,
                         ids=[f"W{w}-to{t}-{bv(b)}" for w, t, b in CKPT_PARAMS])
def test_consolidated_state_dict(world_size, to, bucket):
    """consolidate_state_dict(to=k); state_dict() on rank k: torch's ZeRO's (same keys, same
    param_groups, state within tolerance) and the unsharded optimizer's (Adam, weight decay,
    amsgrad, DDP); state_dict() on any other rank raises RuntimeError naming
    consolidate_state_dict. A second consolidation onto the next rank moves it there."""
    res = case(world_size, f"ckpt/to{to}/{bv(bucket)}")
    tol = zc.tolerance("adam_wd_amsgrad")
    for key, target in (("", to), ("_other", (to + 1) % world_size)):
        mine, ref = res[target]["impl" + key], res[target]["ref" + key]
        assert isinstance(mine, dict), mine
        assert sorted(mine.keys()) == sorted(ref.keys()) == ["param_groups", "state"]
        assert mine["param_groups"] == ref["param_groups"]
        assert mine["param_groups"] == res[target]["plain"]["param_groups"]
        state_close(mine["state"], ref["state"], tol, "vs torch's ZeRO")
        state_close(mine["state"], res[target]["plain"]["state"], tol, "vs Adam")
        assert sorted(mine["state"]) == list(range(8))
        for rank in range(world_size):
            if rank != target:
                err = res[rank]["impl" + key]
                assert err is not None and err[0] == "RuntimeError", (rank, err)
                assert "consolidate_state_dict" in err[1], err
                assert res[rank]["ref" + key][0] == "RuntimeError"


RESUME = [(2, 3), (4, 2), (1, 4), (3, 1)]


@functools.lru_cache(maxsize=None)
def resume(w1, w2):
    """The checkpoint saved by launch(w1) (3 steps on w1 ranks), loaded on w2 ranks (3 more
    steps)."""
    case(w1, "save")
    path = ckpt_path(w1)
    loaded = shared(f"resume_W{w1}_W{w2}", lambda: run_ranks(
        zc.rank_cases, w2, args=(IMPL, [("load", "load", {"path": path})]),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S))
    for rank, out in enumerate(loaded):
        if "error" in out["load"]:
            pytest.fail(f"load raised on rank {rank} of {w2}:\n{out['load']['error']}")
    return torch.load(path), [out["load"] for out in loaded]


@pytest.mark.cases("save")
@pytest.mark.parametrize("w1,w2", RESUME, ids=lambda v: str(v))
def test_resume_across_world_sizes(w1, w2):
    """A checkpoint consolidated on W1 ranks, loaded on W2 ranks into a ZeRO built with another
    lr: the checkpoint's lr is used; each rank's local optimizer holds the checkpoint's state of
    the parameters it owns; consolidating right away gives the checkpoint back; 3 more steps
    follow the unsharded Adam resumed from the same checkpoint."""
    ckpt, res = resume(w1, w2)
    assert ckpt["world_size"] == w1
    tol = zc.tolerance("adam_wd_amsgrad")
    lr = zc.OPTS["adam_wd_amsgrad"][1]["lr"]
    saved = ckpt["optim"]
    assert sorted(saved["state"]) == list(range(8))
    owned = []
    for rank, out in enumerate(res):
        assert_traj(out["impl"], out["plain"], tol, f"rank {rank}")
        assert_moves(out["impl"], f"rank {rank}")
        assert out["local_lrs"] == [lr]
        state_close(out["local_state"], {i: saved["state"][i] for i in out["local_state"]}, 0.0,
                    f"rank {rank}'s local state")
        owned += list(out["local_state"])
    assert sorted(owned) == list(range(8))  # every parameter's state on exactly one rank
    assert_replicas_equal(res, "impl")
    again = res[0]["reconsolidated"]
    assert isinstance(again, dict), again
    assert again["param_groups"] == saved["param_groups"]
    state_close(again["state"], saved["state"], 0.0, "reconsolidated")


@pytest.mark.cases("save")
@ddpx_only
@pytest.mark.parametrize("w1,w2", RESUME, ids=lambda v: str(v))
def test_load_state_dict_leaves_input_unchanged(w1, w2):
    """load_state_dict(sd) leaves sd as it was (deep comparison). torch's does not on more than
    one rank: it sets sd['state'][i] to None for every parameter i another rank owns (seen on
    torch 1.13.1 and 2.11.0)."""
    _, res = resume(w1, w2)
    assert [out["unchanged"] for out in res] == [True] * w2


# ---- 9. bad input ------------------------------------------------------------------------------

# name -> (exception type, words the message must contain (case-insensitive; a tuple: any one))
ERRORS = {
    "single_tensor": ("TypeError", ["params", "iterable"]),
    "not_iterable": ("TypeError", ["params", "iterable"]),
    "empty": ("ValueError", ["empty"]),
    "empty_generator": ("ValueError", ["empty"]),
    "mixed": ("TypeError", ["params", "dict"]),
    "no_params_key": ("ValueError", ["'params'", "group"]),
    "sparse_first": ("ValueError", ["sparse"]),
    "sparse_second": ("ValueError", ["sparse"]),
    "mixed_dtypes": ("ValueError", [("float32", "FloatTensor"), ("float64", "DoubleTensor")]),
    "mixed_dtypes_groups": ("ValueError", [("float32", "FloatTensor"),
                                           ("float64", "DoubleTensor")]),
    "functional": ("ValueError", ["functional", "overlap_with_ddp"]),
}


def _message_has(message, words):
    low = message.lower()
    for w in words:
        alts = w if isinstance(w, tuple) else (w,)
        if not any(a.lower() in low for a in alts):
            return False
    return True


@pytest.mark.cases("errors")
@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_arguments(name):
    """Each bad argument raises torch's exception type, with a message naming the problem."""
    kind, words = ERRORS[name]
    got = case(1, "errors")[0][name]
    assert got["ref"] is not None and got["ref"][0] == kind, ("torch", got["ref"])
    assert got["impl"] is not None and got["impl"][0] == kind, got["impl"]
    assert _message_has(got["impl"][1], words), got["impl"]


@pytest.mark.cases("errors")
@ddpx_only
@pytest.mark.parametrize("name", ["class_is_str", "class_is_instance", "class_not_optimizer"])
def test_optimizer_class_checked(name):
    """optimizer_class that is not a torch.optim.Optimizer subclass (a string, an optimizer
    instance, dict): a TypeError or ValueError naming optimizer_class, at construction. torch's
    calls it blindly: TypeError "'str' object is not callable" / "'SGD' object is not callable",
    and for dict an AttributeError ('dict' object has no attribute 'param_groups')."""
    got = case(1, "errors")[0][name]
    assert got["impl"] is not None and got["impl"][0] in ("TypeError", "ValueError"), got["impl"]
    assert "optimizer_class" in got["impl"][1], got["impl"]
