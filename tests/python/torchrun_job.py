"""A DDP job launched by torchrun (tests/python/test_torchrun.py): ddpx hooks registered both
ways on a real torchrun launch, each rank writing its gradients and the reference to a file.

    python -m torch.distributed.run --standalone --nproc_per_node=2 torchrun_job.py OUT_DIR
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")  # torchrun's environment: MASTER_ADDR, RANK, WORLD_SIZE
    rank = dist.get_rank()
    out = {"env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
           "ddpx": os.path.dirname(ddpx.__file__)}
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    grads = torch.autograd.grad(torch.nn.functional.mse_loss(base(x), y), list(base.parameters()))
    out["local"] = torch.cat([g.reshape(-1) for g in grads])
    for name, register in (
            ("allreduce_native",
             lambda m: ddpx.register_comm_hook(m, None, ddpx.hooks.allreduce_hook)),
            ("fp16_dropin", lambda m: m.register_comm_hook(None, ddpx.hooks.fp16_compress_hook)),
            ("powersgd_native", lambda m: ddpx.register_comm_hook(
                m, ddpx.hooks.PowerSGDState(None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2), ddpx.hooks.powerSGD_hook))):
        model = DDP(torch.nn.Sequential(*[type(m)(*_ctor_args(m)) for m in base]))
        model.module.load_state_dict(base.state_dict())
        register(model)
        steps = []
        for _ in range(3):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            steps.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        out[name] = steps
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _ctor_args(m: torch.nn.Module):
    return (m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else ()


if __name__ == "__main__":
    main(sys.argv[1])
