"""20 SGD steps of a real DDP training on Gloo ranks: ddpx's trajectories against torch's.

allreduce_hook must reproduce torch's trajectory bit for bit (parameters after every step);
the 16-bit hooks must stay within a bound derived from their per-step rounding error:

  each step's averaged gradient is off by at most c * U * S_t element-wise, S_t = mean over ranks
  of |local gradient| (c: see ddp_cases; c = W + 3 for ddpx fp16 against torch fp16, about 1
  for a 16-bit hook against the exact mean). Plain SGD moves a parameter by lr times that per
  step, so after t steps two trajectories differ by at most c * U * lr * sum_{k<=t} max_i S_k,i,
  to first order; the factor 2 in the tolerance covers the feedback of the parameter
  differences through the loss's curvature (small at this lr over 20 steps).
"""
import functools

import pytest
import torch

import ddp_cases as dc
import selection
from dist_utils import run_ranks

STEPS = 20
LR = 0.2
CONFIGS = dc.all_configs(("allreduce", "fp16", "bf16", "fp16_wrap"),
                         ("torch_none", "torch_allreduce", "torch_fp16"))
SCENARIOS = [
    (2, {}),
    (3, {}),
    (3, {"gradient_as_bucket_view": True, "static_graph": "ctor"}),
]
IDS = ["W2", "W3", "W3-bucket_view+static"]


@functools.lru_cache(maxsize=None)
def train(index: int):
    world_size, kwargs = SCENARIOS[index]
    configs = selection.wanted(__name__, CONFIGS)
    return run_ranks(dc.rank_train, world_size, args=(configs, STEPS, LR), kwargs=kwargs)


def error_scale(res) -> torch.Tensor:
    """lr * sum_{k<=t} max_i S_k,i for every step t (see the module docstring)."""
    s = torch.stack([r["local_grads"].double().abs() for r in res]).mean(0)  # [steps, n]
    return LR * torch.cumsum(s.max(dim=1).values, dim=0)


def max_dev_per_step(a, b) -> torch.Tensor:
    return (a.double() - b.double()).abs().max(dim=1).values


@pytest.mark.cases("ddpx_allreduce_*", "torch_allreduce", "torch_none")
@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=IDS)
def test_allreduce_trajectory_bit_identical(index):
    res = train(index)
    world_size = len(res)
    for r in range(world_size):
        for mode in dc.MODES:
            got = res[r][f"ddpx_allreduce_{mode}"]
            assert torch.equal(got["params"], res[r]["torch_allreduce"]["params"]), (r, mode)
            assert torch.equal(got["losses"], res[r]["torch_allreduce"]["losses"]), (r, mode)
            if world_size & (world_size - 1) == 0:  # see test_grads.assert_matches_builtin
                assert torch.equal(got["params"], res[r]["torch_none"]["params"]), (r, mode)
            else:
                # The built-in path and allreduce_hook differ by fp32 roundings: c = 2 W; and
                # a gradient one ulp apart can round the updated parameter the other way, an
                # ulp of the parameter per step.
                ref = res[r]["torch_none"]["params"]
                dev = max_dev_per_step(got["params"], ref)
                steps = torch.arange(1, STEPS + 1, dtype=torch.float64)
                bound = 2 * 2.0 ** -24 * (2 * world_size * error_scale(res)
                                          + steps * ref.abs().max().item())
                assert (dev <= bound).all(), (r, mode)
        # Parameters stay in sync across ranks.
        assert torch.equal(res[r]["ddpx_allreduce_native"]["params"],
                           res[0]["ddpx_allreduce_native"]["params"])


@pytest.mark.cases("*")
@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=IDS)
def test_training_makes_progress(index):
    """The set-up is a real training: steps 0 and 16 see the same batch; its loss went down."""
    res = train(index)
    for config in CONFIGS:
        losses = res[0][config]["losses"]
        assert losses[16] < 0.95 * losses[0], (config, losses.tolist())


@pytest.mark.cases("ddpx_fp16_*", "torch_fp16", "torch_none")
@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=IDS)
def test_fp16_trajectory_tracks_torch(index):
    res = train(index)
    world_size = len(res)
    scale = error_scale(res)
    fp32 = res[0]["torch_none"]["params"]
    torch_fp16 = res[0]["torch_fp16"]["params"]
    for mode in dc.MODES:
        for hook in ("fp16", "fp16_wrap"):
            got = res[0][f"ddpx_{hook}_{mode}"]["params"]
            for r in range(1, world_size):
                assert torch.equal(res[r][f"ddpx_{hook}_{mode}"]["params"], got)
            # Against torch's fp16 hook: c = W + 3 (W + 4 for the wrapper's extra rounding).
            c = world_size + (3 if hook == "fp16" else 4)
            dev = max_dev_per_step(got, torch_fp16)
            assert (dev <= 2 * c * dc.U_FP16 * scale).all(), (hook, mode, (dev / scale).max())
            # Against the exact (fp32) trajectory: c = 1 for the hook (one rounding of x_r / W),
            # 2 for the wrapper (x_r, then the mean).
            c = 1 if hook == "fp16" else 2
            dev = max_dev_per_step(got, fp32)
            assert (dev <= 2 * c * dc.U_FP16 * scale).all(), (hook, mode, (dev / scale).max())
            assert not torch.equal(got, fp32)  # it did go through fp16


@pytest.mark.cases("ddpx_bf16_*", "torch_none")
@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=IDS)
def test_bf16_trajectory_tracks_fp32(index):
    """torch 1.13's bf16 hook refuses Gloo: the reference is the exact (fp32) trajectory."""
    res = train(index)
    scale = error_scale(res)
    fp32 = res[0]["torch_none"]["params"]
    for mode in dc.MODES:
        got = res[0][f"ddpx_bf16_{mode}"]["params"]
        dev = max_dev_per_step(got, fp32)
        assert (dev <= 2 * dc.U_BF16 * scale).all(), (mode, (dev / scale).max())
        assert not torch.equal(got, fp32)


@pytest.mark.cases("ddpx_*")
@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=IDS)
def test_dropin_equals_native_trajectory(index):
    res = train(index)
    for r in range(len(res)):
        for hook in ("allreduce", "fp16", "bf16", "fp16_wrap"):
            assert torch.equal(res[r][f"ddpx_{hook}_dropin"]["params"],
                               res[r][f"ddpx_{hook}_native"]["params"]), (r, hook)
