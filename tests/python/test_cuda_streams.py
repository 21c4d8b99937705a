"""CUDA: the hooks' futures complete only after the kernels that produce their values, when the
work that waits for a collective runs on a stream of torch's pool instead of DDP's autograd
stream: PowerSGD's deferred round two, the reduce-scatter exchange's deferred second round, and
the completion of the chunked gather.

Each test runs the same training twice, once with the GPU far behind the host (torch.cuda._sleep
queued on the autograd stream inside backward, before each layer's gradient), and reads the
gradients right after backward(), with only DDP's own wait between: a missing wait shows as
gradients that differ from the run without the lag, or from the closed form. Skipped without a
GPU, or when ddpx was built without its CUDA kernels.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_cases as dc
import ddpx
import torch_compat as tc
from dist_utils import run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ddpx._C.with_cuda, reason="ddpx was built without CUDA kernels"),
]
C = ddpx._C
# About 10 ms of spinning at 2 GHz: longer than any of these models' steps on the GPU.
LAG_CYCLES = 20_000_000


class _Lag(torch.autograd.Function):
    """The identity; its backward queues a spin on the current (autograd) stream first."""

    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.cycles:
            torch.cuda._sleep(ctx.cycles)
        return grad, None


class Lagged(nn.Module):
    """Linear layers with a lag before each one's gradient in backward."""

    def __init__(self, widths, cycles):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.cycles = cycles

    def forward(self, x):
        for layer in self.layers:
            x = _Lag.apply(layer(x), self.cycles)
            x = torch.tanh(x)
        return x


def train(rank, ddp, widths, steps, local=None):
    """Per step the DDP gradients (read at once) and, with `local`, the local model's."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(16, widths[0], generator=g).cuda()
        ddp.zero_grad()
        ddp(x).square().sum().backward()
        got = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]).cpu()
        want = None
        if local is not None:
            local.zero_grad()
            local(x).square().sum().backward()
            want = dc.flat_grad(local)
        out.append((got, want))
    return out


# ---- PowerSGD's round two, on NCCL (world size 1) and Gloo on CUDA tensors ----------------------

WIDTHS = [64, 64, 64, 64, 10]
LAGS = (0, LAG_CYCLES)


def rank_powersgd(rank, world_size, batch_same_shape):
    """Per lag, 5 steps' gradients; both lags in one launch of the ranks."""
    torch.cuda.set_device(0)
    out = {}
    for lag in LAGS:
        torch.manual_seed(0)
        # 8 KiB buckets: every 64 x 64 weight its own bucket, so that round two is deferred to the
        # next bucket's runHook (the path under test), several times per step.
        ddp = DDP(Lagged(WIDTHS, lag).cuda(), device_ids=[0], **tc.ddp_bucket_kwargs(8192, 8192))
        state = ddpx.hooks.PowerSGDState(None, matrix_approximation_rank=2,
                                         start_powerSGD_iter=2,
                                         batch_tensors_with_same_shape=batch_same_shape)
        ddpx.register_comm_hook(ddp, state, ddpx.hooks.powerSGD_hook)
        out[lag] = [g for g, _ in train(rank, ddp, WIDTHS, steps=5)]
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("backend,world_size,batch_same_shape",
                         [("nccl", 1, False), ("nccl", 1, True), ("gloo", 2, False)],
                         ids=["nccl-layerwise", "nccl-batch", "gloo-layerwise"])
def test_cuda_powersgd_round_two_waits_when_the_gpu_lags(backend, world_size, batch_same_shape):
    res = run_ranks(rank_powersgd, world_size, args=(batch_same_shape,), backend=backend,
                    timeout=300)
    for r in range(world_size):
        for step, (a, b) in enumerate(zip(res[r][0], res[r][LAG_CYCLES])):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b), (r, step)
            assert torch.equal(a, res[0][0][step]), (r, step)  # every rank the same bits


# ---- the chunked gather's completion (NCCL, world size 1) and the reduce-scatter exchange's ------
# ---- second round (Gloo on CUDA tensors, 3 ranks) ----------------------------------------------

BIG = [1200, 2000, 8]  # 2.4M weights in one bucket: above the 2^21 elements that chunking needs


def rank_exchange(rank, world_size, mode):
    """Per lag, 3 steps of (DDP gradients, local gradients) with the native fp16 hook."""
    torch.cuda.set_device(0)
    out = {}
    for lag in LAGS:
        torch.manual_seed(0)
        local = Lagged(BIG, 0).cuda()
        torch.manual_seed(0)
        ddp = DDP(Lagged(BIG, lag).cuda(), device_ids=[0], bucket_cap_mb=4)
        C.register_comm_hook(ddp.reducer, C.compress_hook(dist.group.WORLD, torch.float16,
                                                          getattr(C.ExchangeMode, mode)))
        out[lag] = train(rank, ddp, BIG, steps=3, local=local)
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("backend,world_size,mode",
                         [("nccl", 1, "ALLGATHER"), ("gloo", 3, "REDUCE_SCATTER")],
                         ids=["nccl-chunked-gather", "gloo-reduce-scatter"])
def test_cuda_exchange_waits_when_the_gpu_lags(backend, world_size, mode):
    """fp16 over an explicit ALLGATHER on NCCL (the chunks complete inside runHook, and their
    completion waits on a pool stream) and over REDUCE_SCATTER on 3 Gloo ranks (the second
    round deferred to the next bucket's runHook): each step's gradients are the closed form."""
    res = run_ranks(rank_exchange, world_size, args=(mode,), backend=backend, timeout=300)
    for lag in LAGS:
        for step in range(3):
            local = [res[r][lag][step][1] for r in range(world_size)]
            assert local[0].numel() > 2 ** 21
            expected = dc.ref_compress_hook(local, torch.float16)
            for r in range(world_size):
                assert torch.equal(res[r][lag][step][0], expected), (lag, step, r)
