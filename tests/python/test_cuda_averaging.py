"""CUDA: post-local SGD on GPU tensors. Parameter averaging with Gloo on CUDA tensors (2 ranks on
the one GPU; mixed CPU/CUDA parameters, in place, staged and 16-bit) against the mean computed
on the CPU, and a DDP post-local SGD run with NCCL (world size 1: NCCL refuses two ranks on one
GPU) against torch's. Skipped without a GPU.
"""
import pytest
import torch
import torch.distributed as dist

import ddpx
from dist_utils import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tensors(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    big = torch.randn(300_000, generator=g)          # in place (>= a quarter bucket)
    small = torch.randn(37, generator=g)             # staged
    half = torch.randn(1000, generator=g).half()     # staged; summed in fp32 on Gloo
    wide = torch.randn(64, 48, generator=g).t()      # non-contiguous
    cpu = torch.randn(513, generator=g)              # stays on the CPU
    return [big.cuda(), small.cuda(), half.cuda(), wide.cuda(), cpu]


def rank_cuda_average(rank: int, world_size: int):
    params = _tensors(rank)
    ptrs = [p.data_ptr() for p in params]
    stats = ddpx.model_averaging.average_parameters(params, None, bucket_cap_mb=0.5)
    torch.cuda.synchronize()
    # The expected mean, on the CPU: every rank's inputs, promoted, divided, summed in rank order.
    inputs = [_tensors(r) for r in range(world_size)]
    expected = []
    for i, _p in enumerate(params):
        acc = sum(inputs[r][i].cpu().double() / world_size for r in range(world_size))
        expected.append(acc)
    errors = [((p.cpu().double() - e).abs().max().item()) for p, e in zip(params, expected)]
    return {
        "in_place": ptrs == [p.data_ptr() for p in params],
        "devices": [p.device.type for p in params],
        "errors": errors,
        "stats": stats,
    }


def test_cuda_average_parameters_gloo():
    res = run_ranks(rank_cuda_average, 2, backend="gloo")
    for r in res:
        assert r["in_place"]
        assert r["devices"] == ["cuda", "cuda", "cuda", "cuda", "cpu"]
        big, small, half, wide, cpu = r["errors"]
        assert max(big, small, wide, cpu) <= 1e-6, r["errors"]
        assert half <= 2e-3, r["errors"]  # one fp16 rounding of the mean
        assert r["stats"]["inplace_tensors"] >= 1 and r["stats"]["staged_tensors"] >= 3


def rank_cuda_post_local(rank: int, world_size: int):
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as tp
    from torch.distributed.algorithms.model_averaging import averagers as ta
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchOpt

    out = {}
    for impl in ("torch", "ddpx"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 8)).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        if impl == "torch":
            state = tp.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=3)
            ddp.register_comm_hook(state, tp.post_localSGD_hook)
            opt = TorchOpt(torch.optim.SGD(ddp.parameters(), lr=0.1),
                           ta.PeriodicModelAverager(period=2, warmup_steps=3))
        else:
            state = ddpx.hooks.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=3)
            ddpx.register_comm_hook(ddp, state, ddpx.hooks.post_localSGD_hook)
            opt = ddpx.PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1),
                                             ddpx.PeriodicModelAverager(period=2, warmup_steps=3))
        g = torch.Generator().manual_seed(7)
        for _ in range(8):
            x, y = torch.randn(16, 32, generator=g).cuda(), torch.randn(16, 8, generator=g).cuda()
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[impl] = [p.detach().cpu() for p in model.parameters()]
    return out


def test_cuda_post_local_sgd_nccl_world_size_1():
    (res,) = run_ranks(rank_cuda_post_local, 1, backend="nccl")
    for t, d in zip(res["torch"], res["ddpx"]):
        assert torch.equal(t, d)


def _queue_gpu_work(seconds: float) -> None:
    """Queues about `seconds` of GPU time (torch.cuda._sleep spins for a number of cycles) on the
    current stream, calibrated here."""
    torch.cuda._sleep(1000)  # first launch out of the way
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    stop.record()
    stop.synchronize()
    cycles_per_s = 10_000_000 / (start.elapsed_time(stop) / 1e3)
    torch.cuda._sleep(int(cycles_per_s * seconds))


def rank_agreement_no_drain(rank: int, world_size: int):
    """The agreement before averaging's collectives must not wait for the work queued on the
    current stream (as an upload and read-back through that stream would). With 1 s queued,
    the agreement on CUDA tensors returns long before, on a side stream ("device", as for NCCL)
    and on the host ("auto" for a Gloo group)."""
    import time
    out = {}
    dev = torch.device("cuda", 0)
    for where in ("device", "auto"):
        ddpx._C._all_ranks_agree([5, 6], dist.group.WORLD, dev, where)  # warm-up
        torch.cuda.synchronize()
        dist.barrier()
        _queue_gpu_work(1.0)
        t0 = time.perf_counter()
        same = ddpx._C._all_ranks_agree([5, 6 + rank], dist.group.WORLD, dev, where)
        elapsed = time.perf_counter() - t0
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        out[where] = (same, elapsed, busy)
    return out


def test_cuda_agreement_does_not_wait_for_queued_work():
    for res in run_ranks(rank_agreement_no_drain, 2, backend="gloo"):
        for where, (same, elapsed, busy) in res.items():
            assert same == [True, False], (where, same)
            assert busy, f"{where}: the queued work was done when the agreement returned"
            assert elapsed < 0.5, f"{where}: the agreement waited {elapsed:.2f} s"
