"""ddpx.hooks.DDPCommHookType and register_ddp_comm_hook against torch's
(torch.distributed.algorithms.ddp_comm_hooks): every member of torch's enum registered by both on
2 Gloo ranks, the same gradients over several backward passes (bit for bit where ddpx's hook is
torch's bit for bit, else within the bound the hook's own tests use), the registration native
on a DDP model, a process group as the state, and torch's errors for bad input.

Set-up: ddp_cases' model (7130 fp32 values) in one DDP bucket. torch's quantization and PowerSGD
hooks issue collectives from future callbacks and, with several buckets in flight on Gloo, the
ranks' collectives can interleave differently and hang (see test_quantization_hooks.py and
test_powersgd.py); with one bucket they run as written. Gradients are zeroed between passes and
no optimizer steps, so every pass sees the same weights on both sides and the fp16/bf16 bounds of
ddp_cases apply to each pass.

One launch of 2 ranks runs every member; the tests read its results.
"""
import enum
import functools
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms import ddp_comm_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as torch_q
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_cases as dc
import ddpx
import selection
import torch_compat as tc
from dist_utils import catch, run_ranks

WORLD = 2
PASSES = 5
# The PowerSGD members also run compressed: start_powerSGD_iter through the member's value, as
# torch's enum allows (torch's PowerSGDState needs it > 1 with error feedback): passes 0 and 1
# allreduce, 2-4 compress. With the members' default (1000) every pass is an allreduce.
COMPRESSED = {"start_powerSGD_iter": 2}
POWER_SGD = ("POWER_SGD", "POWER_SGD_RANK2", "BATCHED_POWER_SGD", "BATCHED_POWER_SGD_RANK2")
TORCH_MEMBERS = [m.name for m in torch_hooks.DDPCommHookType]

# Where torch's own hook cannot run here, ddpx's is checked against a closed form or for
# consistency only (the hook's own test file compares it with torch elsewhere).
TORCH_CANNOT = {}
if ".cuda(" in inspect.getsource(torch_q) and not torch.cuda.is_available():  # torch 1.13
    TORCH_CANNOT["QUANTIZE_PER_TENSOR"] = TORCH_CANNOT["QUANTIZE_PER_CHANNEL"] = (
        "this torch's quantization hooks run on CUDA tensors only")
if not tc.TORCH_BF16_HOOKS_ON_GLOO:
    TORCH_CANNOT["BF16_COMPRESS"] = "this torch's bf16 hook refuses Gloo"
if not tc.TORCH_BATCHED_POWERSGD_WORKS:  # only once compressing: the default runs are compared
    TORCH_CANNOT["BATCHED_POWER_SGD/compressed"] = TORCH_CANNOT[
        "BATCHED_POWER_SGD_RANK2/compressed"] = "torch's batched_powerSGD_hook fails compressing"

RUNS = [(name, None) for name in TORCH_MEMBERS] + [
    (name, "compressed") for name in POWER_SGD if name in TORCH_MEMBERS]


def _key(name, variant):
    return name if variant is None else f"{name}/{variant}"


def _ddp():
    # One bucket: torch 1.13 takes the first bucket's cap from this global, torch 2.x from
    # bucket_cap_mb.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
    return DDP(dc.make_model(), bucket_cap_mb=25)


def _passes(ddp, rank):
    grads = []
    for it in range(PASSES):
        ddp.zero_grad()
        dc.loss_fn(ddp, *dc.make_batch(rank, it)).backward()
        grads.append(dc.flat_grad(ddp))
    return grads


def _register(impl, name, variant, ddp, state=None):
    enum_type = ddpx.hooks.DDPCommHookType if impl == "ddpx" else torch_hooks.DDPCommHookType
    register = (ddpx.hooks.register_ddp_comm_hook if impl == "ddpx"
                else torch_hooks.register_ddp_comm_hook)
    if variant == "compressed":
        enum_type[name].value(model=ddp, state=state, **COMPRESSED)
    elif state is None:
        register(enum_type[name], ddp)  # state left out: the default group
    else:
        register(enum_type[name], ddp, state)


def rank_members(rank, world_size, runs, torch_cannot):
    # Count native registrations: ddpx's path into DDP's C++ Reducer.
    native_calls = []
    real = ddpx._C.register_comm_hook

    def counting(*args):
        native_calls.append(1)
        return real(*args)

    ddpx._C.register_comm_hook = counting
    out = {"local": []}
    local = dc.make_model()
    for it in range(PASSES):
        local.zero_grad()
        dc.loss_fn(local, *dc.make_batch(rank, it)).backward()
        out["local"].append(dc.flat_grad(local))
    for name, variant in runs:
        key = _key(name, variant)
        for impl in ("torch", "ddpx"):
            if impl == "torch" and (key in torch_cannot or name in torch_cannot):
                continue
            ddp = _ddp()
            before = len(native_calls)
            _register(impl, name, variant, ddp)
            out[(key, impl)] = _passes(ddp, rank)
            out[(key, impl, "native")] = len(native_calls) - before
    # A process group as the state: each rank's own one-rank group, so the mean is the local
    # gradient itself.
    groups = [dist.new_group([r]) for r in range(world_size)]
    for name in ("ALLREDUCE", "POWER_SGD"):
        for impl in ("torch", "ddpx"):
            ddp = _ddp()
            _register(impl, name, None, ddp, state=groups[rank])
            out[(f"{name}/own group", impl)] = _passes(ddp, rank)
    # A second hook on the same model: RuntimeError, as torch.
    for impl in ("torch", "ddpx"):
        ddp = _ddp()
        _register(impl, "ALLREDUCE", None, ddp)
        out[("second", impl)] = catch(lambda: _register(impl, "FP16_COMPRESS", None, ddp))
    ddpx._C.register_comm_hook = real
    return out


@functools.lru_cache(maxsize=None)
def results():
    # The members the selected tests read (every run of every member and variant in CI); the
    # own-group and second-hook records are made in every launch.
    keys = set(selection.wanted(__name__, [_key(n, v) for n, v in RUNS]))
    runs = [(n, v) for n, v in RUNS if _key(n, v) in keys]
    return run_ranks(rank_members, WORLD, args=(runs, TORCH_CANNOT))


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _local(res, it):
    return [r["local"][it] for r in res]


def _check(key, name, variant, res):
    """ddpx's gradients for `key` against torch's on every rank and pass."""
    for rank, r in enumerate(res):
        for it in range(PASSES):
            got, want = r[(key, "ddpx")][it], r[(key, "torch")][it]
            if name == "FP16_COMPRESS":
                bound = dc.fp16_vs_torch_bound(_local(res, it))
            elif name == "BF16_COMPRESS":
                bound = dc.bf16_vs_torch_bound(_local(res, it))
            elif variant == "compressed" and it >= COMPRESSED["start_powerSGD_iter"]:
                # test_powersgd.py's bound on the first compressed steps (both Gram-Schmidt).
                assert _rel(got, want) <= 1e-6, (rank, it, _rel(got, want))
                continue
            else:  # the same arithmetic as torch's: bit for bit
                assert torch.equal(got, want), (rank, it, _rel(got, want))
                continue
            excess = ((got.double() - want.double()).abs() - bound).max().item()
            assert excess <= 0, (rank, it, excess)


@pytest.mark.cases("{name}*")
@pytest.mark.parametrize("name,variant", RUNS, ids=[_key(n, v) for n, v in RUNS])
def test_member_equals_torchs(name, variant):
    res = results()
    key = _key(name, variant)
    for r in res:
        # Registered natively, once; torch's path never reaches ddpx's native registration.
        assert r[(key, "ddpx", "native")] == 1
        for it in range(PASSES):  # every rank holds the same result (NOOP: its own)
            want = r["local"][it] if name == "NOOP" else res[0][(key, "ddpx")][it]
            assert torch.equal(r[(key, "ddpx")][it], want)
    if key in TORCH_CANNOT or name in TORCH_CANNOT:
        _check_without_torch(key, name, res)
        pytest.skip(f"checked without torch's: {TORCH_CANNOT.get(key, TORCH_CANNOT.get(name))}")
    for r in res:
        assert r[(key, "torch", "native")] == 0
    _check(key, name, variant, res)
    if name != "NOOP":  # the hook averaged: not the local gradients
        assert not torch.equal(res[0][(key, "ddpx")][1], res[0]["local"][1])
    if variant == "compressed":  # and PowerSGD compressed them: not the exact mean
        exact = dc.exact_mean(_local(res, PASSES - 1))
        assert _rel(res[0][(key, "ddpx")][PASSES - 1], exact) > 1e-3


def _check_without_torch(key, name, res):
    for it in range(PASSES):
        local = _local(res, it)
        got = res[0][(key, "ddpx")][it]
        mean = dc.exact_mean(local)
        if name == "BF16_COMPRESS":  # test_grads.py's closed-form bound on 2 ranks
            bound = (dc.U_BF16 + WORLD * 2.0 ** -24) * dc.mean_abs(local)
            bound = bound * (1 + dc.U_BF16) + dc.U_BF16 * mean.abs()
            assert ((got.double() - mean).abs() - bound).max().item() <= 0, it
        elif key.endswith("/compressed") and it >= COMPRESSED["start_powerSGD_iter"]:
            assert _rel(got, mean) > 1e-3, it  # compressed
        elif key.endswith("/compressed") or name in POWER_SGD:  # PowerSGD's plain allreduce
            assert _rel(got, mean) < 1e-6, it
        else:  # the quantization hooks: each rank's values within one uint8 step of its
            # bucket's range (which includes 0), so the mean within the mean of those steps
            step = sum(x.clamp(min=0).max() - x.clamp(max=0).min() for x in local) / 255
            assert (got.double() - mean).abs().max().item() <= step.item() / WORLD * 1.001, it


@pytest.mark.cases()
@pytest.mark.parametrize("name", ["ALLREDUCE", "POWER_SGD"])
def test_process_group_state(name):
    res = results()
    for r in res:
        for impl in ("torch", "ddpx"):
            for it in range(PASSES):
                assert torch.equal(r[(f"{name}/own group", impl)][it], r["local"][it]), impl


@pytest.mark.cases()
def test_second_hook_is_refused_as_by_torch():
    for r in results():
        assert r[("second", "torch")][0] == "RuntimeError", r[("second", "torch")]
        assert r[("second", "ddpx")][0] == "RuntimeError", r[("second", "ddpx")]


# ---- the enum itself, without ranks -------------------------------------------------------------

def test_every_torch_member_is_there_with_torchs_hook_and_options():
    ours = ddpx.hooks.DDPCommHookType
    assert issubclass(ours, enum.Enum)
    missing = [name for name in TORCH_MEMBERS if name not in ours.__members__]
    assert not missing, missing
    for name in TORCH_MEMBERS:
        mine, theirs = ours[name].value, torch_hooks.DDPCommHookType[name].value
        assert isinstance(mine, functools.partial)
        hook = mine.keywords["comm_hook"]
        assert hasattr(hook, "_ddpx_factory"), name  # a ddpx hook: native registration works
        assert hook._ddpx_name == theirs.keywords["comm_hook"].__name__, name
        options = {k: v for k, v in theirs.keywords.items() if k != "comm_hook"}
        assert {k: v for k, v in mine.keywords.items() if k != "comm_hook"} == options, name
        # Called as torch's: value(model=..., state=...), and PowerSGD's start_powerSGD_iter.
        assert (list(inspect.signature(mine).parameters)
                == list(inspect.signature(theirs).parameters)), name
    for name in set(ours.__members__) - set(TORCH_MEMBERS):  # ddpx's own
        assert hasattr(ours[name].value.keywords["comm_hook"], "_ddpx_factory"), name
    assert (list(inspect.signature(ddpx.hooks.register_ddp_comm_hook).parameters)
            == list(inspect.signature(torch_hooks.register_ddp_comm_hook).parameters))
    assert {"DDPCommHookType", "register_ddp_comm_hook"} <= set(ddpx.hooks.__all__)


class _Recorder:
    """Not a DDP model: registration goes through its register_comm_hook, as torch's does."""

    def __init__(self):
        self.calls = []

    def register_comm_hook(self, state, hook):
        self.calls.append((state, hook))


@pytest.mark.parametrize("name,hook", [("ALLREDUCE", "allreduce_hook"), ("NOOP", "noop_hook"),
                                       ("FP16_COMPRESS", "fp16_compress_hook")])
def test_any_model_with_register_comm_hook_gets_ddpxs_hook(name, hook):
    state = object()
    for register, member in (
            (ddpx.hooks.register_ddp_comm_hook, ddpx.hooks.DDPCommHookType[name]),
            # torch's member stands for ddpx's of the same name
            (ddpx.hooks.register_ddp_comm_hook, torch_hooks.DDPCommHookType[name]),
            # torch's function takes ddpx's members
            (torch_hooks.register_ddp_comm_hook, ddpx.hooks.DDPCommHookType[name])):
        model = _Recorder()
        register(member, model, state)
        assert model.calls == [(state, getattr(ddpx.hooks, hook))]


@pytest.mark.parametrize("bad", ["ALLREDUCE", None, 0, ddpx.hooks.allreduce_hook])
def test_not_a_member_raises_as_torch(bad):
    model = _Recorder()
    with pytest.raises(AttributeError):  # torch's reads bad.value
        torch_hooks.register_ddp_comm_hook(bad, model)
    with pytest.raises(AttributeError, match="must be a ddpx.hooks.DDPCommHookType member"):
        ddpx.hooks.register_ddp_comm_hook(bad, model)
    with pytest.raises(TypeError, match="DDPCommHookType"):
        ddpx.hooks.register_ddp_comm_hook(bad, model)
    assert model.calls == []


def test_unknown_member_name_and_model_without_hooks_raise_as_torch():
    for enum_type in (torch_hooks.DDPCommHookType, ddpx.hooks.DDPCommHookType):
        with pytest.raises(KeyError):
            _ = enum_type["ALL_REDUCE"]
        with pytest.raises(AttributeError):
            _ = enum_type.ALL_REDUCE
    for register, enum_type in ((torch_hooks.register_ddp_comm_hook, torch_hooks.DDPCommHookType),
                                (ddpx.hooks.register_ddp_comm_hook, ddpx.hooks.DDPCommHookType)):
        with pytest.raises(AttributeError, match="register_comm_hook"):
            register(enum_type.ALLREDUCE, nn.Linear(2, 2))
