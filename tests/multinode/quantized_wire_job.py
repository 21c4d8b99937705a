"""A job for test_quantized_wire.py, one rank per node: a DDP model with ddpx's quantized_hook
(quantizing from the first step), the bytes this rank's node put on its link during a few steps
(its interface counter, read inside the node), and the bytes the hook's format accounts for.

    torchrun ... quantized_wire_job.py --bits 8 --block-size 256 --out DIR
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts"))
import multinode  # noqa: E402


def tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        return multinode.tx_bytes_of(f.read(), os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 500))
    ddp = DDP(model)
    state = ddpx.hooks.QuantizedState(bits=args.bits, block_size=args.block_size, start_iter=0)
    ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 512, generator=g), torch.randn(16, 500, generator=g)

    def step():
        ddp.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()

    step()  # DDP's first iteration (its initial buckets) and the layouts
    dist.barrier()
    before = tx_bytes()
    for _ in range(args.steps):
        step()
    # A collective returns once its bytes are in the kernel's socket buffers, not on the link: on
    # 2 ranks the last step's all-gather ends, for the rank whose message arrives first, with up
    # to a socket buffer of its own message still queued (one rank read 5% short). The barrier
    # and a pause let the queue drain before the counter is read.
    dist.barrier()
    time.sleep(0.2)
    sent = (tx_bytes() - before) / args.steps
    # What the format puts in every message: per block one fp32 scale and block * bits / 8 bytes
    # of codes; over the two all-to-alls each rank sends on average 2 (W - 1) / W of it all.
    blocks = sum((p.numel() + args.block_size - 1) // args.block_size for p in model.parameters())
    payload = blocks * (4 + args.block_size * args.bits // 8)
    modelled = 2 * (world - 1) / world * payload
    fp32 = sum(p.numel() for p in model.parameters()) * 4
    rows = [None] * world
    dist.all_gather_object(rows, {"rank": rank, "sent": sent})
    if rank == 0:
        with open(os.path.join(args.out, "wire.json"), "w") as f:
            json.dump({"rows": rows, "modelled": modelled, "fp32_bytes": fp32, "world": world},
                      f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
