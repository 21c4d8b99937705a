"""Adversarial suite, part "every DDP option with every hook": each DDP option a user
can set, with each hook of adversarial_cases.HOOKS, torch's hook against ddpx's (drop-in and
native), 5 SGD steps from a fresh model per configuration (adversarial_cases.rank_options: one
launch runs many options, each configuration in a group built afresh after a failure).

References. torch's own hook where it runs here; torch's PowerSGD hooks through
powersgd_cases.torch_synchronized (each bucket waited for: unsynchronised they race on Gloo with
several buckets); torch 1.13's batched hook, which crashes, replaced by
powersgd_cases.torch_batched_fixed_hook. Where torch's hook is unavailable (its bf16 hooks on
1.13's Gloo) or fails (see TORCH_FAILS), ddpx is checked against torch's allreduce_hook (the
probe configuration, which also measures S_t, the largest |local gradient| a hook sees at step
t).

Bounds (max over elements of |ddpx - reference| after step t, plain SGD at lr = LR):
  * allreduce, post_localSGD, noop: bit-identical for fp32 and fp64 models;
  * a 16-bit hook (or any hook on a 16-bit model): each step's averaged gradient is within
    c U S_t of the reference's, c = W + 4 (test_training's constant for the fp16 wrapper; U the
    unit roundoff of the coarser of the hook's and the model's format), so the parameters are
    within 2 c U lr sum_{k<=t} S_k (factor 2: curvature feedback, as in test_training), plus one
    parameter ulp per step (an update one ulp apart can round the parameter the other way);
  * PowerSGD: the allreduce steps before START as above; compressed steps within
    POWERSGD_ATOL (test_powersgd measures <= 3.4e-7 for 25 steps; 5 steps here measure <= 2e-8)
    plus the 16-bit term where a 16-bit format is involved.
Averaging hooks must leave every rank with the same parameters at every step; noop must not.

The quantized hooks (adversarial_cases.QUANTIZED_HOOKS): ddpx's quantized_hook at 8, 4, 2 and 1
bits (both exchanges, with and without the Hadamard rotation and error feedback), torch's uint8
quantization hooks, and ZeRO-2 (reduce_scatter_hook, bits 8 and 4, its ZeroRedundancyOptimizer
stepping SGD at LR), on 2, 3 and 4 ranks, in the covering set QUANT_PLAN (every option meets
q8_allgather, and q4_reduce_scatter at 3 ranks; each format meets several options). Every state
quantizes from iteration 0. torch has no quantized_hook and no ZeRO-2: the reference is the
allreduce run (the probe). Bounds, with S^_t = max_{k<=t} S_k:
  * 8 and 4 bits: a block of values v is sent as multiples of max|v| / qmax (qmax 127, 7), so one
    quantization errs by at most rho M per element, rho = 1 / (2 qmax), M the largest |value|
    quantized; with the Hadamard rotation (blocks of B values) rho = B / (2 qmax): the rotated
    block's error is at most sqrt(B) / 2 steps in L2, a step at most sqrt(B) max|v| / qmax.
    With error feedback a level's residual e_t = v_t - Q(v_t) joins the next step's values, so
    the step's averaged gradient is the mean plus e_{t-1} - e_t: within 2 rho M per level (rho M
    without feedback). Levels L: 1 for the all-gather and for ZeRO-2 (the owner adds its own
    values exactly), 2 for the reduce-scatter (the owner quantizes the mean again). Gradients
    plus the residuals of both levels keep M <= S^_t / (1 - (2L - 1) rho). The parameters are
    within 2 lr sum_{k<=t} E_k of the allreduce run (E_k that step's bound; factor 2: curvature,
    as above), plus the 16-bit term on 16-bit models.
  * torch's uint8 hooks (per tensor, per channel of 512): ddpx's equal torch's bit for bit (torch's
    run waited per bucket: its second all_gather comes from a callback); against allreduce, a
    rank's value errs by at most 1.5 steps of the min-max scale (half a step of rounding, one of
    clamping where the rounded zero point shifts the range), a step at most 2 S_t / 255: E_t =
    3 S_t / 255.
  * 2 and 1 bits: no element bound (M's recursion has no finite solution for rho >= 1/3, and at 1
    bit the scale is mean|v|). Training-level instead: the displacement d = p_T - p_0 has cosine
    >= LOW_BITS_MIN_COSINE with the allreduce run's d_ref and |d - d_ref| <= LOW_BITS_MAX_DRIFT
    |d_ref| (L2; a hook that returned zeros fails the first, one that blew up the second).
Always: drop-in equals native, finite, every rank identical (after Join's end under join: the
joined rank runs the hook on the join hook's zero buckets meanwhile), and not equal to the
allreduce run (the quantization ran). Under find_unused and find_unused_bucket_view the head
unused on every rank does not move at those steps (with the bucket view, DDP hands that gradient
whatever the hook returned), and a quantized state keeps the error-feedback residuals of a
parameter whose gradient is all zeros on a rank. A second model on one quantized state is
refused. ZeRO-2 does not run under join (documented: a joined rank cannot shadow its exchange).
"""
import fcntl
import functools
import os

import pytest
import torch

import adversarial_cases as ac
import ddp_cases as dc
import selection
import torch_compat as tc
from dist_utils import run_ranks

LAUNCHES = {
    "graph": (2, ["find_unused", "static_graph", "static_graph_unused", "bucket_view",
                  "bucket_view_set_to_none", "no_sync", "big_bucket", "fp64"]),
    "misc": (2, ["fp16_model", "bf16_model", "join", "new_group", "two_models",
                 "broadcast_buffers_bn", "frozen_param", "noncontig_params"]),
    "subgroup": (3, ["subgroup_of_2_of_3"]),
}
LAUNCH_OF = {o: name for name, (_, opts) in LAUNCHES.items() for o in opts}
POWERSGD = ("powerSGD", "batched_powerSGD", "fp16_powerSGD")
SIXTEEN = {"fp16": dc.U_FP16, "bf16": dc.U_BF16, "fp16_wrap": dc.U_FP16, "bf16_wrap": dc.U_BF16,
           "fp16_powerSGD": dc.U_FP16}
UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: dc.U_FP16,
        torch.bfloat16: dc.U_BF16}
POWERSGD_ATOL = 1e-6

# torch's hook fails where ddpx's works: (option, hook) -> (type, text in the message).
# torch 2.11: the compress wrappers with find_unused_parameters and a parameter unused on one
# rank raise on that rank only (the 16-bit result meets the fp32 bucket); 1.13 runs them.
# torch 1.13: its PowerSGD needs bmm/addmm, which CPU torch 1.13 lacks for Half (the fp16 wrapper
# around PowerSGD, and PowerSGD on an fp16 model), on every rank.
if tc.TORCH_VERSION >= (2, 0):
    TORCH_FAILS = {
        ("find_unused", "fp16_wrap"): ("RuntimeError", "Expected Float, got Half"),
        ("find_unused", "bf16_wrap"): ("RuntimeError", "Expected Float, got BFloat16"),
        ("find_unused", "fp16_powerSGD"): ("RuntimeError", "Expected Float, got Half"),
    }
else:
    _BMM = ("RuntimeError", "not implemented for 'Half'")  # "bmm" or "addmm_impl_cpu_"
    TORCH_FAILS = {(o, "fp16_powerSGD"): _BMM for o in ac.HOOK_OPTIONS if o != "bf16_model"}
    TORCH_FAILS.update({("fp16_model", h): _BMM for h in ("powerSGD", "batched_powerSGD")})
# torch 1.13's Gloo has no bfloat16: DDP cannot even broadcast a bf16 model's parameters, with
# or without a hook; ddpx promises the same error (no hook runs).
GLOO_HAS_BF16 = tc.TORCH_VERSION >= (2, 0)

# torch's result is wrong where ddpx's is right: (option, hook) -> the option whose torch run is
# the same training on contiguous parameters (the truth). torch's averager replaces each
# parameter's .data with a contiguous view of its flat buffer; for a parameter whose layout was
# not contiguous, DDP's gradient copy keeps the old strides and the next steps' gradients of that
# weight come out scrambled (2.11 and 1.13: 3.4e-4 off after one more step). ddpx averages in
# place and keeps the layout.
TORCH_WRONG = {("noncontig_params", "post_localSGD"): "new_group"}
# ddpx against the contiguous truth: the same values, but torch 1.13's kernels for the transposed
# weight round differently (measured 3e-8).
CONTIGUOUS_ATOL = 1e-6


# A launch's results are computed once per test session and shared by the xdist workers: the
# first worker to need one runs it while holding a lock file and saves the results next to it.
# A worker that needs a launch another worker is running does not wait idle: it first runs a
# launch the selected tests need that nobody has started (a launch mostly waits on Gloo's
# round trips, so two at once cost little more than one), and then waits. Without the sharing,
# xdist deals the tests of one launch to every worker and each would run it. The folder is under
# the session's pytest basetemp (the controller's, with xdist), which pytest clears away.
_SHARED = []
_FAILED = "launch failed"
_BUSY = object()


@pytest.fixture(scope="session", autouse=True)
def shared_dir(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "ddpx_adversarial_ddp"
    path.mkdir(exist_ok=True)
    _SHARED[:] = [path]
    return path


def _launch_cases():
    """Every launch's case names, "hooks/LAUNCH/OPTION" and "quant/LAUNCH/OPTION": what the
    tests' `cases` markers name (selection.py)."""
    names = [f"hooks/{n}/{o}" for n, (_, options) in LAUNCHES.items() for o in options]
    return names + [f"quant/{n}/{o}" for n, (_, plan) in QUANT_LAUNCHES.items() for o in plan]


def needed_launches():
    """The launches the selected tests read, in the order of _launch_cases."""
    wanted = selection.wanted(__name__, _launch_cases())
    return list(dict.fromkeys(name.split("/")[1] for name in wanted))


def _run_or_load(name, blocking):
    """The results of launch `name`: loaded when saved, else computed and saved under its lock;
    _BUSY when not `blocking` and another worker holds the lock."""
    path = _SHARED[0] / f"{name}.pt"
    with open(_SHARED[0] / f"{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            return _BUSY
        if path.exists():
            return torch.load(path)
        try:
            result = _compute(name)
        except Exception as exc:  # noqa: BLE001 - every reader fails with it
            result = {_FAILED: f"{type(exc).__name__}: {exc}"}
        torch.save(result, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
        return result


def _shared(name):
    """Launch `name`'s results, once per session across the xdist workers. A launch that fails (a
    rank crashed or hung) is not run again: its error is saved in its place, and every test
    that reads it fails with that error at once."""
    passed = set()
    result = _run_or_load(name, blocking=False)
    while result is _BUSY:
        other = next((n for n in needed_launches() if n != name and n not in passed
                      and not (_SHARED[0] / f"{n}.pt").exists()), None)
        if other is None:
            result = _run_or_load(name, blocking=True)
            break
        _run_or_load(other, blocking=False)  # run now, or taken by another worker meanwhile
        passed.add(other)
        result = _run_or_load(name, blocking=False)
    if isinstance(result, dict) and _FAILED in result:
        pytest.fail(f"launch {name} failed:\n{result[_FAILED]}", pytrace=False)
    return result


def _compute(name):
    if name in QUANT_LAUNCHES:
        world_size, plan = QUANT_LAUNCHES[name]
        kwargs = {"hooks": plan, "shared_state": SHARED_STATE_HOOKS if name == "quant_w2_misc"
                  else ()}
        options = list(plan)
    else:
        world_size, options = LAUNCHES[name]
        kwargs = {"reregister": name == "misc"}
    return run_ranks(ac.rank_options, world_size, args=(options,), kwargs=kwargs, timeout=300)


@functools.lru_cache(maxsize=None)
def launch(name):
    return _shared(name)


def results(option, name=None):
    """The participating ranks' results of `option` in launch `name` (default: the launch of
    the matrix of HOOKS that holds the option)."""
    res = launch(name if name is not None else LAUNCH_OF[option])
    return [r for r in res if r.get((option, ac.PROBE)) != {}]


def _record(r, key):
    rec = r[key]
    assert "error" not in rec, (key, rec["error"])
    return rec


def _step_scale(res, option):
    """S_t, the largest |local gradient| any rank's hook saw at step t."""
    per_rank = [_record(r, (option, ac.PROBE))["max_local_grad"] for r in res]
    n = max(len(s) for s in per_rank)
    s = torch.zeros(n, dtype=torch.float64)
    for x in per_rank:
        s[:len(x)] = torch.maximum(s[:len(x)], x)
    return s


def _pad_cumsum(res, option):
    """lr * sum_{k<=t} S_k (_step_scale)."""
    return ac.LR * torch.cumsum(_step_scale(res, option), 0)


def _sixteen_bound(res, option, hook, params, ref):
    dtype = ac.OPTIONS[option].get("dtype", torch.float32)
    u = max(SIXTEEN.get(hook, 0.0), UNIT[dtype])
    c = len(res) + 4
    scale = _pad_cumsum(res, option)[:len(ref)]
    steps = torch.arange(1, len(ref) + 1, dtype=torch.float64)
    pmax = max(params.abs().max().item(), ref.abs().max().item())
    return 2 * c * u * scale + 2 * steps * UNIT[dtype] * pmax


def _dev(a, b):
    return (a.double() - b.double()).abs().max(dim=1).values


def _reference(r, option, hook):
    """(reference record, what it is)."""
    if (option, hook) in TORCH_FAILS or not ac.ref_available(hook):
        return _record(r, (option, ac.PROBE)), "allreduce"
    return _record(r, (option, hook, "torch")), "torch"


CASES = [(o, h) for o in ac.HOOK_OPTIONS for h in ac.HOOKS]


@pytest.mark.cases("hooks/*/{option}")
@pytest.mark.parametrize("option,hook", CASES, ids=[f"{o}-{h}" for o, h in CASES])
def test_option_with_hook(option, hook):
    res = results(option)
    spec = ac.HOOKS[hook]
    if option == "bf16_model" and not GLOO_HAS_BF16:
        for r in res:
            for impl in ac.option_impls(hook) + [ac.PROBE]:
                key = (option, ac.PROBE) if impl == ac.PROBE else (option, hook, impl)
                assert r[key].get("error") == ("RuntimeError", "Invalid scalar type"), key
        return
    dtype = ac.OPTIONS[option].get("dtype", torch.float32)
    exact = dtype in (torch.float32, torch.float64)
    join = ac.OPTIONS[option].get("loop") == "join"
    for rank, r in enumerate(res):
        native = _record(r, (option, hook, "ddpx_native"))
        dropin = _record(r, (option, hook, "ddpx_dropin"))
        # Both registration paths: the same arithmetic.
        assert torch.equal(native["params"], dropin["params"]), rank
        assert torch.equal(native["buffers"], dropin["buffers"]), rank
        ref, what = _reference(r, option, hook)
        got = native["params"]
        assert len(got) == len(ref["params"])
        dev = _dev(got, ref["params"])
        bound = _sixteen_bound(res, option, hook, got, ref["params"])
        if (option, hook) in TORCH_WRONG:
            truth = _record(results(TORCH_WRONG[(option, hook)])[rank],
                            (TORCH_WRONG[(option, hook)], hook, "torch"))["params"]
            assert (_dev(got, truth) <= CONTIGUOUS_ATOL).all(), (rank, _dev(got, truth))
            assert _dev(ref["params"], truth)[-1] > 100 * CONTIGUOUS_ATOL  # torch's is off
        elif what == "allreduce":
            # torch cannot run this hook here: ddpx's result is a mean within the hook's bound.
            assert hook not in ("allreduce", "noop", "post_localSGD")
            if hook in POWERSGD:
                # Compression starts at START: before, a plain mean (ddpx and torch's allreduce).
                d = dev[:ac.START]
                assert (d <= bound[:ac.START]).all(), (rank, d, bound)
                assert torch.isfinite(got).all()
            else:
                assert (dev <= bound).all(), (rank, dev, bound)
        elif hook in ("allreduce", "post_localSGD", "noop") and exact:
            assert torch.equal(got, ref["params"]), (rank, dev)
            assert torch.equal(native["buffers"], ref["buffers"]), rank
            assert torch.equal(native["final"], ref["final"]), rank
        elif hook in POWERSGD:
            if exact and hook != "fp16_powerSGD":
                assert torch.equal(got[:ac.START], ref["params"][:ac.START]), (rank, dev)
                assert (dev <= POWERSGD_ATOL).all(), (rank, dev)
            else:
                assert (dev <= POWERSGD_ATOL + bound).all(), (rank, dev, bound)
        else:
            assert (dev <= bound).all(), (rank, dev, bound)
        if hook in ("fp16", "bf16", "fp16_wrap", "bf16_wrap") and exact:
            assert not torch.equal(got, _record(r, (option, ac.PROBE))["params"])  # 16 bits
    # Averaging hooks keep the replicas identical; noop does not average.
    p0 = [_record(r, (option, hook, "ddpx_native")) for r in res]
    if join:
        # The uneven rank stops early; Join's end syncs the model from the last joiner.
        if spec.averages:
            assert all(torch.equal(p["final"], p0[0]["final"]) for p in p0)
    elif spec.averages:
        assert all(torch.equal(p["params"], p0[0]["params"]) for p in p0), option
    else:
        assert not torch.equal(p0[0]["params"][-1], p0[1]["params"][-1])


@pytest.mark.cases("hooks/*/{option}")
@pytest.mark.parametrize("option,hook", sorted(TORCH_FAILS),
                         ids=[f"{o}-{h}" for o, h in sorted(TORCH_FAILS)])
def test_torch_fails_where_ddpx_works(option, hook):
    """torch's hook raises on one rank (recorded as it happens here); ddpx's trains, checked in
    test_option_with_hook against the exact mean's bound."""
    if not ac.ref_available(hook):
        pytest.skip("torch has no working form of this hook here")
    errors = [r[(option, hook, "torch")].get("error") for r in results(option)]
    kind, text = TORCH_FAILS[(option, hook)]
    assert any(e is not None and e[0] == kind and text in e[1] for e in errors), errors


@pytest.mark.cases("hooks/*")
def test_powersgd_compresses_under_every_option():
    """The PowerSGD comparisons above are not vacuous: after START, ddpx's PowerSGD trajectory
    is far from allreduce's (fp32 models)."""
    for option in ac.HOOK_OPTIONS:
        if ac.OPTIONS[option].get("dtype") is not None:
            continue
        for r in results(option):
            plain = _record(r, (option, ac.PROBE))["params"]
            got = _record(r, (option, "powerSGD", "ddpx_native"))["params"]
            assert _dev(got, plain)[-1] > 100 * POWERSGD_ATOL, option


@pytest.mark.cases("hooks/subgroup/*")
def test_subgroup_rank_outside_trains_nothing():
    res = launch("subgroup")
    assert len(res) == 3 and res[2] and all(v == {} for v in res[2].values())


@pytest.mark.cases("hooks/misc/*")
def test_second_hook_refused_like_torch():
    """A second register_comm_hook on a DDP model raises RuntimeError in torch; ddpx's
    registration, either path, after any first hook, too."""
    res = launch("misc")
    for r in res:
        cases = {k[1:]: v for k, v in r.items() if k[0] == "reregister"}
        assert len(cases) >= len(ac.HOOKS) * 4
        for (hook, first, second), outcome in cases.items():
            assert outcome is not None and outcome[0] == "RuntimeError", (hook, first, second,
                                                                         outcome)


# ---- the quantized hooks ------------------------------------------------------------------------

GRAPH = LAUNCHES["graph"][1] + ["find_unused_bucket_view"]
MISC = LAUNCHES["misc"][1]
# A covering set rather than every hook with every option (the bounds in the module docstring):
# hook -> {world size: its options}. q8_allgather meets every option, and q4_reduce_scatter every
# option at 3 ranks (where the reduce-scatter sends less than the all-gather); each bit width,
# exchange, rotation and error-feedback setting meets find_unused_bucket_view, join and several
# others; torch's uint8 hooks split the options between them. ZeRO-2 is never run under Join:
# reduce_scatter_hook documents that a joined rank cannot shadow its exchange.
QUANT_PLAN = {
    "q8_allgather": {2: GRAPH + MISC, 3: ["subgroup_of_2_of_3", "join"],
                     4: ["find_unused_bucket_view"]},
    "q4_reduce_scatter": {2: ["find_unused_bucket_view", "bucket_view"],
                          3: GRAPH + MISC + ["subgroup_of_2_of_3"],
                          4: ["find_unused_bucket_view", "static_graph", "join"]},
    "q8_reduce_scatter_hadamard": {3: ["find_unused_bucket_view", "static_graph", "no_sync",
                                       "fp16_model", "join", "noncontig_params",
                                       "subgroup_of_2_of_3"]},
    "q4_allgather_no_ef": {2: ["find_unused_bucket_view", "static_graph", "no_sync", "fp64",
                               "fp16_model", "join"]},
    "q2_reduce_scatter": {3: ["find_unused_bucket_view", "bucket_view", "bf16_model", "join",
                              "two_models"]},
    "q2_allgather_hadamard_no_ef": {2: ["find_unused_bucket_view", "bucket_view_set_to_none",
                                        "big_bucket", "bf16_model", "join", "two_models"],
                                    4: ["join"]},
    "q1_reduce_scatter_hadamard": {3: ["find_unused", "static_graph_unused", "fp64", "join",
                                       "new_group"],
                                   4: ["find_unused_bucket_view", "join"]},
    "q1_allgather_hadamard_no_ef": {2: ["find_unused", "static_graph_unused", "no_sync",
                                        "fp16_model", "join", "new_group"]},
    "quantization_pertensor": {2: GRAPH, 3: ["join"]},
    "quantization_perchannel": {2: MISC, 3: ["subgroup_of_2_of_3"], 4: ["static_graph"]},
    "zero2_q8": {2: GRAPH + [o for o in MISC if o != "join"], 3: ["find_unused", "no_sync"]},
    "zero2_q4": {3: ["find_unused_bucket_view", "static_graph", "bucket_view_set_to_none",
                     "fp16_model", "two_models", "frozen_param", "subgroup_of_2_of_3"],
                 4: ["bucket_view", "find_unused_bucket_view"]},
}
assert set(QUANT_PLAN) == set(ac.QUANTIZED_HOOKS)
# A second model on one quantized state (refused), checked in the 2-rank misc launch.
SHARED_STATE_HOOKS = ("q8_allgather", "q4_reduce_scatter")


def _quant_launch_of(world_size, option):
    if world_size == 2:
        return "quant_w2_misc" if option in MISC else "quant_w2_graph"
    return f"quant_w{world_size}"


def _quant_launches():
    """launch name -> (world size, {option: its hooks}), options in OPTIONS' order."""
    launches = {}
    for hook, per_size in QUANT_PLAN.items():
        for world_size, options in per_size.items():
            for option in options:
                plan = launches.setdefault(_quant_launch_of(world_size, option),
                                           (world_size, {}))[1]
                plan.setdefault(option, []).append(hook)
    return {name: (w, {o: plan[o] for o in ac.OPTIONS if o in plan})
            for name, (w, plan) in launches.items()}


QUANT_LAUNCHES = _quant_launches()
QUANT_CASES = [(name, o, h) for name, (_, plan) in QUANT_LAUNCHES.items()
               for o, hooks in plan.items() for h in hooks]
# 2 and 1 bits: training-level bounds on the displacement d = p_T - p_0 against the allreduce
# run's d_ref (measured worst, over every option and 2-4 ranks: cosine 0.65 and relative
# distance 1.08, both for 1 bit without error feedback on the bf16 model).
LOW_BITS_MIN_COSINE = 0.5
LOW_BITS_MAX_DRIFT = 1.25


def _running_scale(res, option):
    """S_t (_step_scale) and its running max."""
    s = _step_scale(res, option)
    return s, torch.cummax(s, 0).values


def _quant_bound(res, option, hook, n):
    """The bound on |ddpx - allreduce run| after each of the first n steps from the quantization
    alone (the module docstring derives it)."""
    s, s_hat = _running_scale(res, option)
    q = ac.QUANTIZED_HOOKS[hook].quant
    if q is None:  # torch's uint8 hooks: min-max scale, no error feedback
        err = 3 * s / 255
    else:
        qmax = 2 ** (q["bits"] - 1) - 1
        rho = (q["block_size"] if q["rotation"] == "hadamard" else 1) / (2 * qmax)
        levels = 2 if q["exchange"] == "reduce_scatter" else 1
        m = s_hat / (1 - (2 * levels - 1) * rho)
        err = (2 if q["use_error_feedback"] else 1) * levels * rho * m
    return (2 * ac.LR * torch.cumsum(err, 0))[:n]


def _branchy_slices():
    """name -> slice of dc.flat_params for the branchy model's heads `extra` and `solo`."""
    out, at = {}, 0
    for name, p in ac.option_model("branchy", torch.float32).named_parameters():
        out[name] = slice(at, at + p.numel())
        at += p.numel()
    return out


def _unused_on(head, step, rank):
    """Whether the branchy model's `head` is unused on `rank` at `step` (_Branchy.forward)."""
    return step % 3 == 1 if head == "extra" else (step + rank) % 2 == 1


def _check_unused_parameters(res, option, hook):
    """find_unused*: the head unused on every rank (`extra`, steps 1 and 4) does not move; a
    quantized state with error feedback keeps the residuals of a parameter whose gradient is all
    zeros on a rank (extra everywhere, `solo` on the rank that skips it): its blocks send zeros,
    and the residuals wait for the next step the parameter is used."""
    slices = _branchy_slices()
    names = list(slices)
    kept_nonzero = False
    for rank, r in enumerate(res):
        native = _record(r, (option, hook, "ddpx_native"))
        params = native["params"]
        for step in range(1, len(params)):
            if _unused_on("extra", step, rank):
                for name in ("extra.weight", "extra.bias"):
                    assert torch.equal(params[step][slices[name]],
                                       params[step - 1][slices[name]]), (rank, step, name)
        if "worker_residuals" not in native:
            continue
        # The state keys its residuals by the order the parameters first reach the hook, as
        # the probe's DDP buckets them.
        order = _record(r, (option, ac.PROBE))["bucket_order"]
        key_of = {names[i]: k for k, i in enumerate(order)}
        worker, server = native["worker_residuals"], native["server_residuals"]
        for step in range(1, len(worker)):
            for name in names:
                head = name.split(".")[0]
                if head not in ("extra", "solo") or not _unused_on(head, step, rank):
                    continue
                key = key_of[name]
                before, after = worker[step - 1].get(key), worker[step].get(key)
                assert (before is None) == (after is None), (rank, step, name)
                if before is not None:
                    assert torch.equal(after, before), (rank, step, name, "worker residual")
                    kept_nonzero |= bool(before.abs().max() > 0)
                if head == "extra":  # the mean is all zeros too: its owner keeps the second
                    # level's residual (the reduce-scatter's; the all-gather has none)
                    before, after = server[step - 1].get(key), server[step].get(key)
                    if before is not None and after is not None:
                        assert torch.equal(after, before), (rank, step, name, "server residual")
    if any("worker_residuals" in r[(option, hook, "ddpx_native")] for r in res):
        assert kept_nonzero, "no nonzero residual was kept: the check proved nothing"


@pytest.mark.cases("quant/{launch_name}/{option}")
@pytest.mark.parametrize("launch_name,option,hook", QUANT_CASES,
                         ids=[f"{n}-{o}-{h}" for n, o, h in QUANT_CASES])
def test_option_with_quantized_hook(launch_name, option, hook):
    res = results(option, launch_name)
    spec = ac.QUANTIZED_HOOKS[hook]
    if option == "bf16_model" and not GLOO_HAS_BF16:
        for r in res:
            for impl in ac.option_impls(hook) + [ac.PROBE]:
                key = (option, ac.PROBE) if impl == ac.PROBE else (option, hook, impl)
                assert r[key].get("error") == ("RuntimeError", "Invalid scalar type"), key
        return
    join = ac.OPTIONS[option].get("loop") == "join"
    low_bits = spec.quant is not None and spec.quant["bits"] <= 2
    for rank, r in enumerate(res):
        native = _record(r, (option, hook, "ddpx_native"))
        dropin = _record(r, (option, hook, "ddpx_dropin"))
        # Both registration paths: the same arithmetic.
        assert torch.equal(native["params"], dropin["params"]), rank
        assert torch.equal(native["buffers"], dropin["buffers"]), rank
        got = native["params"]
        assert torch.isfinite(got).all(), rank
        probe = _record(r, (option, ac.PROBE))
        assert len(got) == len(probe["params"])
        # Not vacuous: the quantization ran (plain allreduce's trajectory is another one).
        assert not torch.equal(got, probe["params"]), rank
        if spec.torch_available and (option, hook, "torch") in r:
            # ddpx's uint8 hooks are torch's, bit for bit.
            ref = _record(r, (option, hook, "torch"))["params"]
            assert torch.equal(got, ref), (rank, _dev(got, ref))
        if low_bits:
            d = (native["final"] - native["init"]).double()
            d_ref = (probe["final"] - probe["init"]).double()
            cosine = (d @ d_ref / (d.norm() * d_ref.norm())).item()
            drift = ((d - d_ref).norm() / d_ref.norm()).item()
            assert cosine >= LOW_BITS_MIN_COSINE, (rank, cosine, drift)
            assert drift <= LOW_BITS_MAX_DRIFT, (rank, cosine, drift)
        else:
            dev = _dev(got, probe["params"])
            bound = (_quant_bound(res, option, hook, len(got))
                     + _sixteen_bound(res, option, hook, got, probe["params"]))
            assert (dev <= bound).all(), (rank, dev, bound)
    if ac.OPTIONS[option].get("model") == "branchy":
        _check_unused_parameters(res, option, hook)
    # Every quantized hook averages: the replicas stay identical (after Join's end for the
    # uneven rank, whose hook ran on the zero buckets of the join hook meanwhile).
    p0 = [_record(r, (option, hook, "ddpx_native")) for r in res]
    if join:
        assert all(torch.equal(p["final"], p0[0]["final"]) for p in p0)
    else:
        assert all(torch.equal(p["params"], p0[0]["params"]) for p in p0), option


@pytest.mark.cases("quant/quant_w2_misc/*")
@pytest.mark.parametrize("hook", SHARED_STATE_HOOKS)
def test_second_model_on_one_quantized_state_is_refused(hook):
    """One QuantizedState per DDP model (its residuals are per parameter): a second model's first
    backward on the same state raises a ValueError saying so, on every rank, both
    registrations; the first model's step runs."""
    for r in launch("quant_w2_misc"):
        for impl in ("ddpx_dropin", "ddpx_native"):
            got = r[("shared_state", hook, impl)]
            assert got["model0"] is None, (impl, got)
            kind, message = got["model1"]
            assert kind == "ValueError" and "already serves another DDP model" in message, got
