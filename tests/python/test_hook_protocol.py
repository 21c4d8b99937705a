"""The state protocol of ``ddpx._native``, through which every hook reaches its C++ object
and a state hears of its registration and of every bucket: a state class written against it,
as a new hook's would be, works on both paths; post-local SGD's parameter tagging reaches the
parameters through a compress wrapper too; the package's modules hold what ``ddpx.hooks``
exports. One launch of 2 ranks; the tests read its record.
"""
import functools
import importlib

import pytest
import torch
import torch.distributed as dist

import ddp_cases as dc
import ddpx
from ddpx import _native
from ddpx.hooks.post_localSGD_hook import hook_state_of
from dist_utils import catch, run_ranks

WORLD_SIZE = 2
ITERATIONS = 2  # iteration 0: DDP's single initial bucket; 1: the rebuilt buckets


class RecordingState:
    """A state written against the protocol: allreduce over the default group, recording what
    the machinery calls."""

    def __init__(self):
        self.native_calls, self.registered, self.buckets = [], [], []

    def _ddpx_native_(self, hook_name):
        self.native_calls.append(hook_name)
        return dist.group.WORLD

    def _ddpx_on_register_(self, ddp_model):
        self.registered.append(ddp_model)

    def _ddpx_on_bucket_(self, bucket):
        self.buckets.append(bucket.index())


recording_hook = _native.make_hook("recording_hook", ddpx._C.allreduce_hook,
                                   "allreduce_hook over a RecordingState",
                                   state_type=RecordingState)


def _register(ddp, state, hook, mode):
    if mode == "dropin":
        ddp.register_comm_hook(state, hook)
    else:
        ddpx.register_comm_hook(ddp, state, hook)


def _grads(ddp, rank):
    grads = []
    for it in range(ITERATIONS):
        ddp.zero_grad()
        dc.loss_fn(ddp, *dc.make_batch(rank, it)).backward()
        grads.append(dc.flat_grad(ddp))
    return grads


def rank_protocol(rank: int, world_size: int):
    out = {"torch_allreduce": _grads(dc.make_ddp(dc.make_model(), "torch_allreduce"), rank)}
    for mode in dc.MODES:
        state = RecordingState()
        ddp = dc.make_ddp(dc.make_model(), "torch_none")
        _register(ddp, state, recording_hook, mode)
        out[mode] = {"grads": _grads(ddp, rank), "native_calls": state.native_calls,
                     "registered": [m is ddp for m in state.registered],
                     "buckets": state.buckets}
    out["none_state"] = catch(lambda: ddpx.hooks.native_hook(recording_hook, None))
    # Post-local SGD under a wrapper: the state's callbacks tag the model's parameters (for the
    # model averagers' warm-up check) whichever hook function carries them.
    for mode in dc.MODES:
        state = ddpx.hooks.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=1)
        ddp = dc.make_ddp(dc.make_model(), "torch_none")
        _register(ddp, state, ddpx.hooks.fp16_compress_wrapper(ddpx.hooks.post_localSGD_hook),
                  mode)
        _grads(ddp, rank)
        out[f"wrapped_post_local_{mode}"] = [hook_state_of([p]) is state
                                             for p in ddp.parameters()]
    return out


@functools.lru_cache(maxsize=None)
def record():
    return run_ranks(rank_protocol, WORLD_SIZE)


@pytest.mark.parametrize("mode", dc.MODES)
def test_state_class_of_a_new_hook(mode):
    """_ddpx_native_ once per (hook, state); _ddpx_on_register_ once, natively; on the drop-in
    path _ddpx_on_bucket_ for every bucket of every iteration; the hook's results are the
    C++ hook's (allreduce, bit for bit torch's)."""
    for rank_record in record():
        r = rank_record[mode]
        assert r["native_calls"] == ["recording_hook"]
        for got, ref in zip(r["grads"], rank_record["torch_allreduce"]):
            assert torch.equal(got, ref)
        if mode == "native":
            assert r["registered"] == [True] and r["buckets"] == []
        else:
            buckets = r["buckets"]
            assert r["registered"] == [] and buckets[0] == 0 and len(buckets) >= 5
            assert buckets[1:] == list(range(len(buckets) - 1))  # the rebuilt buckets, in order


def test_state_type_is_checked():
    for rank_record in record():
        name, msg = rank_record["none_state"]
        assert name == "TypeError"
        assert "recording_hook: state must be a ddpx.hooks.RecordingState, got NoneType" in msg


@pytest.mark.parametrize("mode", dc.MODES)
def test_wrapped_post_local_sgd_tags_parameters(mode):
    for rank_record in record():
        tagged = rank_record[f"wrapped_post_local_{mode}"]
        assert tagged and all(tagged)


MODULES = {
    "ddpx.hooks.default_hooks": ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
                                 "fp16_compress_wrapper", "bf16_compress_wrapper", "noop_hook"],
    "ddpx.hooks.powerSGD_hook": ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"],
    "ddpx.hooks.post_localSGD_hook": ["PostLocalSGDState", "post_localSGD_hook"],
    "ddpx.hooks.ddp_zero_hook": ["hook_with_zero_step", "hook_with_zero_step_interleaved"],
    "ddpx.hooks.zero_reduce_scatter_hook": ["reduce_scatter_hook"],
    "ddpx.hooks.quantization_hooks": [
        "quantization_pertensor_hook", "quantization_perchannel_hook"],
    "ddpx.hooks.quantized_hook": ["QuantizedState", "quantized_hook"],
    "ddpx._native": ["register_comm_hook", "native_hook"],
    "ddpx.hooks._hook_type": ["DDPCommHookType", "register_ddp_comm_hook"],
}


def test_modules_hold_what_ddpx_hooks_exports():
    """Every name of ddpx.hooks.__all__ comes from one module of the package (or the machinery
    ddpx._native, shared with the averagers); the attributes
    ddpx.hooks.powerSGD_hook / post_localSGD_hook stay the hook functions even though modules
    of the same names exist; the states log under their module's name."""
    assert sorted(ddpx.hooks.__all__) == sorted(n for names in MODULES.values() for n in names)
    for module, names in MODULES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert getattr(ddpx.hooks, name) is getattr(mod, name), name
    for module in ("powerSGD_hook", "post_localSGD_hook"):
        mod = importlib.import_module(f"ddpx.hooks.{module}")
        assert callable(getattr(ddpx.hooks, module)) and not isinstance(
            getattr(ddpx.hooks, module), type(mod))
        assert mod.logger.name == f"ddpx.hooks.{module}"
    assert ddpx.register_comm_hook is ddpx.hooks.register_comm_hook
