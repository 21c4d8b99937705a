"""CUDA: ddpx.optim.DiLoCo on GPU parameters. 2 Gloo ranks on the one GPU (fp32, bf16 and 4-bit
outer gradients, streaming with a fragment in flight) against the same run on the CPU, replicas
bit-identical after each synchronization; and with NCCL at world size 1 (NCCL refuses two ranks
on one GPU), the outer step on the device. Skipped without a GPU.
"""
import pytest
import torch
import torch.nn as nn

import ddpx
from dist_utils import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(rank, device, bits, steps=8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 3)).to(device)
    opt = ddpx.optim.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), sync_every=4,
                            fragments=2, fragment_sync_delay=1, bits=bits, block_size=64)
    traj = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * rank + s)
        x, y = torch.randn(8, 10, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        traj.append(torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    glob = torch.cat([t.reshape(-1).cpu() for t in opt.global_params])
    return torch.stack(traj), [t.device.type for t in opt.global_params], glob


def rank_gloo(rank, world_size):
    out = {}
    for bits in (32, 16, 4):
        out[bits] = {"cuda": _train(rank, torch.device("cuda"), bits),
                     "cpu": _train(rank, torch.device("cpu"), bits)}
    return out


def test_cuda_diloco_gloo_matches_cpu():
    res = run_ranks(rank_gloo, 2, timeout=240)
    for bits in (32, 16, 4):
        for r in res:
            (gpu, where, _), (cpu, _, _) = r[bits]["cuda"], r[bits]["cpu"]
            assert where == ["cuda"] * len(where), where
            # SGD and the codecs on the device against the CPU's: the same within rounding
            assert torch.allclose(gpu, cpu, rtol=1e-4, atol=1e-5), (bits, (gpu - cpu).abs().max())
        # the global parameters: bit-identical on both ranks
        assert torch.equal(res[0][bits]["cuda"][2], res[1][bits]["cuda"][2]), bits


def rank_nccl(rank, world_size):
    return _train(rank, torch.device("cuda"), 4)


def test_cuda_diloco_nccl_world_one():
    traj, where, _ = run_ranks(rank_nccl, 1, backend="nccl", timeout=120)[0]
    assert where == ["cuda"] * len(where)
    assert torch.isfinite(traj).all() and not torch.equal(traj[0], traj[-1])
