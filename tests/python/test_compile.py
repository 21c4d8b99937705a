"""torch.compile'd DDP models with ddpx.

Under torch.compile's default ``optimize_ddp="ddp_optimizer"``, dynamo splits the forward graph
at DDP's bucket boundaries and DDP's C++ Reducer runs its buckets and the registered hook as
without compilation. Each case trains the same model, data and hook twice on 2 Gloo ranks, once
as a plain DDP model and once ``torch.compile``d, and the parameters after every step must be
identical, bit for bit: every ddpx hook (drop-in and native), the model averagers with
``post_localSGD_hook`` and ``PostLocalSGDOptimizer``, and ``ZeroRedundancyOptimizer`` (stepped
after backward, and inside the hook with ``overlap_with_ddp=True``). The compiled models use
``backend="aot_eager"``: the same ATen kernels as eager mode, so equality is exact and no C++
compiler runs (inductor fuses and rounds differently, and takes ~25 s per graph on 2 cores).

Under ``optimize_ddp="python_reducer"`` (compiled autograd; DDP calls hooks per gradient with a
``(grad, param)`` tuple and has no buckets) ddpx refuses: native registration raises at once, a
drop-in hook at its first call, both saying what works. torch's own ``allreduce_hook`` fails
there too (an AttributeError on the tuple).
"""
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import adversarial_cases as ac
import ddpx
import torch_compat as tc
from dist_utils import catch, run_ranks

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch 1.13 has no compile")

STEPS = 4  # PowerSGD and post-local SGD start at ac.START = 2: two steps of each regime
LR = 0.05
BACKEND = "aot_eager"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(rank: int, case: str, compiled: bool):
    """The parameters after each of STEPS steps of `case`, compiled or not."""
    torch._dynamo.reset()
    model = _model()
    # Small buckets, the first no larger than the rest (DDPOptimizer asserts it): several of
    # them, so that dynamo's DDPOptimizer splits the graph.
    ddp = DDP(model, **tc.ddp_bucket_kwargs(4096, 4096))
    averager = None
    kind, _, impl = case.partition(":")
    if kind in ac.HOOKS:
        spec = ac.HOOKS[kind]
        ac.register(ddp, spec, impl)
        averager = ac.make_averager(spec, "ddpx")
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    elif kind == "post_local_optimizer":
        ddp.register_comm_hook(ac._post_local_state("ddpx"), ddpx.hooks.post_localSGD_hook)
        if impl == "hierarchical":
            avg = ddpx.model_averaging.HierarchicalModelAverager(
                OrderedDict([(1, 1), (2, 2)]), warmup_steps=ac.START)
        else:
            avg = ddpx.model_averaging.PeriodicModelAverager(period=2, warmup_steps=ac.START)
        opt = ddpx.optim.PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), avg)
    elif kind == "zero":
        overlap = impl == "overlap"
        opt = ddpx.optim.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                                 overlap_with_ddp=overlap, lr=0.01)
        hook = ddpx.hooks.allreduce_hook
        ddp.register_comm_hook(None, ddpx.hooks.hook_with_zero_step(hook, ddp, opt)
                               if overlap else hook)
    else:
        raise ValueError(case)
    forward = torch.compile(ddp, backend=BACKEND) if compiled else ddp
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        forward(_batch(rank, step)).pow(2).mean().backward()
        if kind != "zero" or impl != "overlap":
            opt.step()
        if averager is not None:
            averager.average_parameters(ddp.parameters())
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def rank_compiled_vs_eager(rank: int, world_size: int, case: str):
    from torch._dynamo.utils import counters

    eager = _train(rank, case, compiled=False)
    counters.clear()
    compiled = _train(rank, case, compiled=True)
    return {"eager": eager, "compiled": compiled,
            "counters": {k: dict(v) for k, v in counters.items()}}


HOOK_CASES = [f"{name}:{impl}" for name in ac.HOOKS
              for impl in ("ddpx_dropin", "ddpx_native")]
OPTIMIZER_CASES = ["post_local_optimizer:periodic", "post_local_optimizer:hierarchical",
                   "zero:after_backward", "zero:overlap"]


@pytest.mark.parametrize("case", HOOK_CASES + OPTIMIZER_CASES)
def test_compiled_trains_as_eager(case):
    for rank, got in enumerate(run_ranks(rank_compiled_vs_eager, 2, args=(case,), timeout=240)):
        for step, (e, c) in enumerate(zip(got["eager"], got["compiled"])):
            for i, (a, b) in enumerate(zip(e, c)):
                assert torch.equal(a, b), (case, rank, step, i, (a - b).abs().max().item())
        # The steps moved the model, and dynamo compiled frames (a test that cannot pass by
        # training nothing, or by running eagerly twice).
        assert not torch.equal(got["eager"][0][0], got["eager"][-1][0]), case
        assert got["counters"].get("frames", {}).get("ok", 0) > 0, got["counters"]


# ---- optimize_ddp="python_reducer" --------------------------------------------------------------

def rank_python_reducer(rank: int, world_size: int):
    import torch._dynamo.config as dynamo_config

    out = {}
    with dynamo_config.patch(optimize_ddp="python_reducer"):
        ddp = DDP(_model())
    out["native"] = catch(lambda: ddpx.register_comm_hook(ddp, None, ddpx.hooks.allreduce_hook))
    # Drop-in: DDP accepts the registration; the first call, with a (grad, param) tuple, raises.
    # Called as DDP's python reducer calls it (its per-parameter hook, outside a compile).
    p = next(ddp.parameters())
    out["dropin"] = catch(lambda: ddpx.hooks.fp16_compress_hook(None, (torch.ones_like(p), p)))
    return out


def test_python_reducer_is_refused_with_what_works():
    for got in run_ranks(rank_python_reducer, 2):
        kind, message = got["native"]
        assert kind == "RuntimeError", got
        assert 'optimize_ddp="python_reducer"' in message and '"ddp_optimizer"' in message, message
        kind, message = got["dropin"]
        assert kind == "TypeError" and message.startswith("fp16_compress_hook: "), got
        assert '"ddp_optimizer"' in message, message
