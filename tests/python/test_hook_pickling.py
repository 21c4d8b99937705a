"""Pickling ddpx's hooks, and checkpoints that hold a hook beside its state.

A hook function pickles by reference, as torch's do: ``pickle.loads(pickle.dumps(hook)) is hook``
for every hook of ``ddpx.hooks``, and for what ``fp16_compress_wrapper`` / ``bf16_compress_wrapper``
return around one of them (torch's wrappers return local functions, which do not pickle).
``hook_with_zero_step``'s results hold the DDP model and the optimizer and do not pickle, as
torch's. Then, on 2 Gloo ranks (one launch; the tests read its record), drop-in
(``ddp.register_comm_hook``) and native (``ddpx.register_comm_hook``):

* torch's ``test_ddp_hook_pickling_powerSGD`` and ``test_ddp_comm_hook_logging``
  (torch/testing/_internal/distributed/distributed_test.py), ported to CPU;
* a checkpoint ``torch.save({"hook": hook, "state": state, ...})`` taken mid-run reloads, and the
  reloaded hook and state train bit for bit as the run that was never interrupted.
"""
import copy
import functools
import io
import pickle
import subprocess
import sys
import traceback
import unittest

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_cases as dc
import ddpx
from ddpx import _native
from dist_utils import RankError, run_ranks

WORLD_SIZE = 2

# The hook functions of ddpx.hooks (the other names are states, wrappers and registration).
HOOK_NAMES = sorted(
    name for name in ddpx.hooks.__all__
    if name.endswith("_hook") and name not in ("native_hook", "register_comm_hook",
                                                "register_ddp_comm_hook"))
H = ddpx.hooks
# The wrapped hooks, each with the hook of ddpx.hooks innermost (whose state it takes).
WRAPPED = {
    "fp16(allreduce)": (lambda: H.fp16_compress_wrapper(H.allreduce_hook), "allreduce_hook"),
    "bf16(allreduce)": (lambda: H.bf16_compress_wrapper(H.allreduce_hook), "allreduce_hook"),
    "fp16(powerSGD)": (lambda: H.fp16_compress_wrapper(H.powerSGD_hook), "powerSGD_hook"),
    "bf16(quantized)": (lambda: H.bf16_compress_wrapper(H.quantized_hook), "quantized_hook"),
    "fp16(perchannel)": (lambda: H.fp16_compress_wrapper(H.quantization_perchannel_hook),
                         "quantization_perchannel_hook"),
    "bf16(fp16(noop))": (lambda: H.bf16_compress_wrapper(H.fp16_compress_wrapper(H.noop_hook)),
                         "noop_hook"),
}


def wrapped(key):
    return WRAPPED[key][0]()


# ---- in this process ---------------------------------------------------------------------------

def test_the_hook_list_covers_every_hook():
    assert HOOK_NAMES == sorted([
        "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "noop_hook",
        "powerSGD_hook", "batched_powerSGD_hook", "post_localSGD_hook",
        "quantization_pertensor_hook", "quantization_perchannel_hook", "quantized_hook",
        "reduce_scatter_hook"])


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_unpickles_to_itself(name):
    hook = getattr(H, name)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(hook, protocol=protocol)) is hook, protocol
    # Found where pickle looks: the module it names, under its __qualname__.
    assert getattr(sys.modules[hook.__module__], hook.__qualname__) is hook
    assert hook.__qualname__ == name


def test_bf16_hooks_keep_the_prefixed_name_torch_1_13_needs():
    """torch 1.13's DDP refuses a hook whose __name__ is bf16_compress_hook without CUDA; the
    __qualname__, which pickle and DDP's logging read, is the attribute's name."""
    assert H.bf16_compress_hook.__name__ == "ddpx_bf16_compress_hook"
    assert H.bf16_compress_hook.__qualname__ == "bf16_compress_hook"
    wrapped = H.bf16_compress_wrapper(H.allreduce_hook)
    assert wrapped.__name__ == "ddpx_bf16_compress_wrapper_hook"
    assert wrapped.__qualname__ == "bf16_compress_wrapper(allreduce_hook)"


@pytest.mark.parametrize("key", sorted(WRAPPED))
def test_wrapped_hooks_unpickle_to_themselves(key):
    hook = wrapped(key)
    assert wrapped(key) is hook  # the same hook wrapped twice: the same function
    assert pickle.loads(pickle.dumps(hook)) is hook
    buffer = io.BytesIO()
    torch.save({"hook": hook}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False)["hook"] is hook


def test_hooks_unpickle_in_a_process_that_never_imported_ddpx():
    """pickle imports ddpx to find them; the wrapped hooks are built there on first sight, the
    same functions as the wrappers return there."""
    hooks = [getattr(H, n) for n in HOOK_NAMES] + [wrapped(k) for k in sorted(WRAPPED)]
    n = len(HOOK_NAMES)
    script = (
        "import pickle, sys\n"
        "hooks = pickle.loads(sys.stdin.buffer.read())\n"
        "import ddpx\n"
        f"print(all(getattr(ddpx.hooks, h.__qualname__, None) is h for h in hooks[:{n}]))\n"
        "wrap = ddpx.hooks.bf16_compress_wrapper, ddpx.hooks.fp16_compress_wrapper\n"
        f"print(hooks[{n + sorted(WRAPPED).index('bf16(fp16(noop))')}] "
        "is wrap[0](wrap[1](ddpx.hooks.noop_hook)))\n"
        "print('|'.join(h.__qualname__ for h in hooks))\n")
    out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(hooks),
                         capture_output=True, check=True, timeout=120).stdout.decode().split()
    assert out[:2] == ["True", "True"], out
    assert out[2] == "|".join(h.__qualname__ for h in hooks)


def test_a_wrapper_of_a_hook_outside_ddpx_hooks_does_not_pickle():
    """Its __qualname__ names a hook of ddpx.hooks that is not the one it wraps: a clear
    PicklingError when saved, never another hook when loaded."""
    other = _native.make_hook("allreduce_hook", ddpx._C.allreduce_hook, "another allreduce_hook")
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(other)  # not the attribute ddpx.hooks... names either
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(H.fp16_compress_wrapper(other))
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(H.fp16_compress_wrapper(_native.make_hook(
            "nowhere_hook", ddpx._C.allreduce_hook, "a hook no module holds")))


def test_torch_wrappers_do_not_pickle():
    """What ddpx does better: torch's wrapper returns a local function."""
    with pytest.raises((AttributeError, pickle.PicklingError), match="local object"):
        pickle.dumps(torch_default.fp16_compress_wrapper(torch_default.allreduce_hook))


def test_module_getattr_still_refuses_unknown_names():
    from ddpx.hooks import default_hooks
    for name in ("nothing", "fp16_compress_wrapper(nothing_hook)",
                 "fp16_compress_wrapper(PowerSGDState)", "fp16_compress_wrapper()"):
        assert not hasattr(default_hooks, name), name
    with pytest.raises(ImportError):
        exec("from ddpx.hooks.default_hooks import nothing", {})


# ---- on 2 ranks --------------------------------------------------------------------------------

def _register(ddp, state, hook, mode):
    if mode == "dropin":
        ddp.register_comm_hook(state, hook)
    else:
        ddpx.register_comm_hook(ddp, state, hook)


# torch's test is a unittest.TestCase: its assertLogs, outside a test.
_assert = unittest.TestCase()


def _assert_equal(a, b, what=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_equal(a[k], b[k], f"{what}[{k!r}]")
    else:
        assert a == b, (what, a, b)


def _case_test_ddp_hook_pickling_powerSGD(rank, mode):
    """torch's test_ddp_hook_pickling_powerSGD (its _test_hook_pickling), on CPU, with the hook
    registered ``mode``. Where it differs: the states log under ddpx's logger ("ddpx.hooks",
    torch's under "torch.distributed"), the same records; each rank loads its own checkpoint
    (below)."""
    hook = H.powerSGD_hook
    hook_state = H.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                 start_powerSGD_iter=4)
    torch.manual_seed(0)
    learning_rate = 0.01
    input = torch.randn(7, 1)
    target = torch.randn(7, 5)
    net = torch.nn.Linear(1, 5)
    ddp_model = DDP(copy.deepcopy(net))
    dummy_ddp_model = DDP(copy.deepcopy(net))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=learning_rate)
    _register(ddp_model, hook_state, hook, mode)
    ddp_model.train()
    for _ in range(10):
        optimizer.zero_grad()
        F.mse_loss(ddp_model(input), target).backward()
        optimizer.step()

    state = {"state_dict": ddp_model.state_dict(), "comm_hook": hook,
             "comm_hook_state": hook_state}
    # torch's test saves on rank 0 and broadcasts that checkpoint to every rank. ddpx's
    # PowerSGDState refuses error-feedback memories saved by another rank (each rank's are its
    # own; torch's test gets away with loading rank 0's because its ranks train on the same
    # data): every rank saves its own, and the others check that refusal on rank 0's.
    buffer = io.BytesIO()
    with _assert.assertLogs("ddpx.hooks") as captured:
        torch.save(state, buffer)
    assert [r.getMessage() for r in captured.records] == [
        "NOTE: Process group is not serializable and excluded from a saved state."]
    object_list = [buffer.getvalue() if rank == 0 else None]
    dist.broadcast_object_list(object_list)
    if rank != 0:
        with pytest.raises(ValueError, match="saved by rank 0 of 2, and this is rank 1 of 2"):
            torch.load(io.BytesIO(object_list[0]), weights_only=False)

    with _assert.assertLogs("ddpx.hooks") as captured:
        checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert [r.getMessage() for r in captured.records] == [
        "NOTE: Process group will be set to a default group (i.e. the world size)."
        "                If a different group is desired, please set `self.process_group` "
        "after PowerSGD state is loaded."]

    dummy_ddp_model.load_state_dict(checkpoint["state_dict"])
    dummy_hook = checkpoint["comm_hook"]
    dummy_hook_state = checkpoint["comm_hook_state"]
    dummy_optimizer = torch.optim.SGD(dummy_ddp_model.parameters(), lr=learning_rate)

    assert dummy_hook.__qualname__ == hook.__qualname__
    assert dummy_hook is hook  # beyond torch's test: the very function
    assert hook_state.__slots__ == dummy_hook_state.__slots__
    for entry in dummy_hook_state.__slots__:
        if entry not in ("process_group", "rng"):
            _assert_equal(getattr(dummy_hook_state, entry), getattr(hook_state, entry), entry)
    assert dummy_hook_state.process_group == dist.distributed_c10d._get_default_group()
    rng_states = hook_state.rng.get_state(), dummy_hook_state.rng.get_state()
    assert len(rng_states[0]) == len(rng_states[1])
    for entry1, entry2 in zip(*rng_states):
        np.testing.assert_array_equal(entry1, entry2)

    _register(dummy_ddp_model, dummy_hook_state, dummy_hook, mode)
    dummy_ddp_model.train()
    for _ in range(10):
        optimizer.zero_grad()
        dummy_optimizer.zero_grad()
        loss_origin = F.mse_loss(ddp_model(input), target)
        loss_dummy = F.mse_loss(dummy_ddp_model(input), target)
        loss_origin.backward()
        loss_dummy.backward()
        optimizer.step()
        dummy_optimizer.step()
    for orig_param, dummy_param in zip(ddp_model.parameters(), dummy_ddp_model.parameters()):
        assert torch.equal(orig_param.grad, dummy_param.grad)


def _logged(ddp_model):
    return ddp_model._get_ddp_logging_data().get("comm_hook")


def _case_test_ddp_comm_hook_logging(rank, mode):
    """torch's test_ddp_comm_hook_logging, on CPU, with ddpx's hooks registered ``mode``: DDP's
    logging data names a hook by its __qualname__. Where it differs, natively: the PowerSGD hooks
    given None as their state are refused at registration (a TypeError, nothing installed, the
    model still takes a hook), where torch's fail at the first bucket."""
    hooks = [H.allreduce_hook, H.fp16_compress_hook, H.powerSGD_hook, H.batched_powerSGD_hook,
             H.quantization_pertensor_hook, H.quantization_perchannel_hook]
    refused = []
    for hook in hooks:
        ddp_model = DDP(torch.nn.Linear(1, 1, bias=False))
        assert _logged(ddp_model) is None
        if mode == "native" and hook in (H.powerSGD_hook, H.batched_powerSGD_hook):
            with pytest.raises(TypeError, match=rf"{hook.__qualname__}: state must be a "
                               r"ddpx.hooks.PowerSGDState, got NoneType"):
                ddpx.register_comm_hook(ddp_model, None, hook)
            assert _logged(ddp_model) is None
            refused.append(hook.__qualname__)
            ddpx.register_comm_hook(ddp_model, H.PowerSGDState(None), hook)
        else:
            _register(ddp_model, None, hook, mode)
        assert _logged(ddp_model) == hook.__qualname__

    for hook in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS):
        ddp_model = DDP(torch.nn.Linear(1, 1, bias=False))
        assert _logged(ddp_model) is None
        ddp_model._register_builtin_comm_hook(hook)
        assert _logged(ddp_model) == str(hook)

    ddp_model = DDP(torch.nn.Linear(1, 1, bias=False))
    assert _logged(ddp_model) is None
    for _ in range(2):
        ddp_model(torch.ones(1, 1)).sum().backward()
    assert ddp_model._get_ddp_logging_data().get("comm_hook", "") == ""
    return refused


def _state_for(name, model):
    if name in ("powerSGD_hook", "batched_powerSGD_hook"):
        return H.PowerSGDState(None, start_powerSGD_iter=2)
    if name == "post_localSGD_hook":
        return H.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=1)
    if name == "quantized_hook":
        return H.QuantizedState(None, start_iter=1)
    if name == "reduce_scatter_hook":
        return ddpx.optim.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    return None


def _case_every_hook_logs_its_qualname(rank, mode):
    """Every hook of ddpx.hooks and the wrapped ones, with a state each takes: DDP's logging
    data records the hook's __qualname__, whichever path registered it."""
    out = {}
    hooks = {n: (getattr(H, n), n) for n in HOOK_NAMES}
    hooks.update({k: (f(), inner) for k, (f, inner) in WRAPPED.items()})
    for key, (hook, inner) in hooks.items():
        if mode == "native" and getattr(hook, "_ddpx_factory", None) is None:
            continue  # a Python hook: drop-in only
        ddp_model = DDP(dc.make_model())
        _register(ddp_model, _state_for(inner, ddp_model), hook, mode)
        out[key] = (_logged(ddp_model), hook.__qualname__)
    return out


# Checkpoints taken at STEPS_BEFORE of a run of STEPS_BEFORE + STEPS_AFTER SGD steps, past the
# states' start iterations (compressing at the checkpoint).
STEPS_BEFORE, STEPS_AFTER = 4, 3
RESUMED = {
    "powerSGD": lambda: (H.powerSGD_hook,
                         H.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)),
    "fp16(powerSGD)": lambda: (H.fp16_compress_wrapper(H.powerSGD_hook),
                               H.PowerSGDState(None, matrix_approximation_rank=1,
                                               start_powerSGD_iter=2)),
    "quantized": lambda: (H.quantized_hook, H.QuantizedState(None, bits=4, start_iter=2)),
    "bf16(quantized)": lambda: (H.bf16_compress_wrapper(H.quantized_hook),
                                H.QuantizedState(None, bits=8, start_iter=2)),
}


def _train(ddp, opt, rank, steps):
    for step in steps:
        opt.zero_grad()
        dc.loss_fn(ddp, *dc.make_batch(rank, step)).backward()
        opt.step()


def _case_checkpoint_resumes(rank, key, mode):
    """The uninterrupted run's parameters, and the resumed run's: the checkpoint (the hook, its
    state, the model and the optimizer) saved with torch.save at STEPS_BEFORE and loaded with
    torch.load into a fresh DDP model and optimizer."""
    hook, state = RESUMED[key]()
    ddp = dc.make_ddp(dc.make_model(), "torch_none")  # small buckets: 4 per step
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    _register(ddp, state, hook, mode)
    _train(ddp, opt, rank, range(STEPS_BEFORE))
    buffer = io.BytesIO()
    torch.save({"hook": hook, "state": state, "model": ddp.state_dict(),
                "optimizer": opt.state_dict()}, buffer)
    _train(ddp, opt, rank, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    uninterrupted = dc.flat_params(ddp)

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    assert checkpoint["hook"] is hook
    resumed = dc.make_ddp(dc.make_model(), "torch_none")
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _register(resumed, checkpoint["state"], checkpoint["hook"], mode)
    _train(resumed, resumed_opt, rank, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    assert checkpoint["state"].iter == state.iter

    # The same resume with a fresh state instead of the saved one: what the test would see if
    # the state did not travel.
    fresh = dc.make_ddp(dc.make_model(), "torch_none")
    fresh.load_state_dict(checkpoint["model"])
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh_opt.load_state_dict(checkpoint["optimizer"])
    _register(fresh, RESUMED[key]()[1], hook, mode)
    _train(fresh, fresh_opt, rank, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return uninterrupted, dc.flat_params(resumed), dc.flat_params(fresh)


def _case_zero_step_hooks_pickle_as_torch(rank):
    """What pickling hook_with_zero_step's results raises (they hold the model and the
    optimizer), with their __qualname__."""
    out = {}
    for name in ("hook_with_zero_step", "hook_with_zero_step_interleaved"):
        ddp = DDP(dc.make_model())
        zero = ddpx.optim.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1,
                                                  overlap_with_ddp=True)
        hook = getattr(H, name)(H.allreduce_hook, ddp, zero)
        try:
            pickle.dumps(hook)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - compared with torch's in the test
            out[name] = (type(exc).__name__, str(exc), hook.__qualname__)
    return out


CASES = {
    **{f"pickling_powerSGD_{m}": functools.partial(_case_test_ddp_hook_pickling_powerSGD, mode=m)
       for m in dc.MODES},
    **{f"logging_{m}": functools.partial(_case_test_ddp_comm_hook_logging, mode=m)
       for m in dc.MODES},
    **{f"every_hook_logs_{m}": functools.partial(_case_every_hook_logs_its_qualname, mode=m)
       for m in dc.MODES},
    **{f"resume_{k}_{m}": functools.partial(_case_checkpoint_resumes, key=k, mode=m)
       for k in RESUMED for m in dc.MODES},
    "zero_step_hooks": _case_zero_step_hooks_pickle_as_torch,
}


def rank_cases(rank, world_size):
    """Every case in turn; per case its result, or the traceback of what it raised."""
    out = {}
    for name, case in CASES.items():
        try:
            out[name] = ("ok", case(rank))
        except Exception:  # noqa: BLE001 - reported by the test that reads the case
            out[name] = ("error", traceback.format_exc())
        dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def record():
    # A failed launch is kept too: the tests that read it fail at once, not each after a launch.
    try:
        return run_ranks(rank_cases, WORLD_SIZE, timeout=120, collective_timeout_s=30)
    except RankError as exc:
        return exc


def _result(name):
    rec = record()
    if isinstance(rec, RankError):
        raise rec
    results = []
    for rank, rank_record in enumerate(rec):
        status, value = rank_record[name]
        assert status == "ok", f"rank {rank}:\n{value}"
        results.append(value)
    return results


@pytest.mark.parametrize("mode", dc.MODES)
def test_torch_ddp_hook_pickling_powerSGD(mode):
    _result(f"pickling_powerSGD_{mode}")


@pytest.mark.parametrize("mode", dc.MODES)
def test_torch_ddp_comm_hook_logging(mode):
    for refused in _result(f"logging_{mode}"):
        expected = ["powerSGD_hook", "batched_powerSGD_hook"] if mode == "native" else []
        assert refused == expected


@pytest.mark.parametrize("mode", dc.MODES)
def test_every_hook_logs_its_qualname(mode):
    # Natively: the hooks with a native form (a Python hook registers drop-in only).
    expected = {n for n in HOOK_NAMES
                if mode == "dropin" or getattr(getattr(H, n), "_ddpx_factory", None)}
    for logged in _result(f"every_hook_logs_{mode}"):
        assert set(logged) == expected | set(WRAPPED)
        for key, (name, qualname) in logged.items():
            assert name == qualname, key
        assert logged["fp16(powerSGD)"][0] == "fp16_compress_wrapper(powerSGD_hook)"


@pytest.mark.parametrize("mode", dc.MODES)
@pytest.mark.parametrize("key", sorted(RESUMED))
def test_checkpoint_with_hook_and_state_resumes_bit_for_bit(key, mode):
    for uninterrupted, resumed, fresh_state in _result(f"resume_{key}_{mode}"):
        assert torch.equal(uninterrupted, resumed)
        assert not torch.equal(uninterrupted, fresh_state)  # the state matters


def _torch_local_function(outer):
    """The __qualname__ of the function torch's ``outer`` defines inside itself and returns
    (torch refuses Gloo, so its hook is not built here: it is read from torch's code)."""
    inner = [c for c in outer.__code__.co_consts if isinstance(c, type(outer.__code__))]
    assert len(inner) == 1, inner
    return f"{outer.__qualname__}.<locals>.{inner[0].co_name}"


def test_zero_step_hooks_do_not_pickle_as_torch():
    """torch's hook_with_zero_step returns a local function, which pickle refuses; ddpx's is
    the same local function (a checkpoint keeps the wrapped hook and builds this one again
    around the new model and optimizer)."""
    for out in _result("zero_step_hooks"):
        for name in ("hook_with_zero_step", "hook_with_zero_step_interleaved"):
            qualname = _torch_local_function(getattr(torch_zero_hook, name))
            kind, message, ours = out[name]
            assert ours == qualname
            assert kind in ("AttributeError", "PicklingError"), kind
            assert f"Can't pickle local object '{qualname}'" in message, message
