#!/usr/bin/env python3
"""Gloo on loopback: one all-gather of N bytes per rank against the W broadcasts (one per root,
blocking, and asynchronous as ZeRO's exchange issues them) that move the same bytes. The
measurement behind ZeRO's exchange keeping its broadcasts (docs/benchmarks.md, section 7b).

Each of 60 repetitions runs the three variants after a barrier; printed: the median of the last
50 on rank 0, in ms, per size (16 KiB, 256 KiB, 1040 KiB per rank), 1 thread per rank.

    .venv/bin/python benchmarks/bench_gather_vs_broadcast.py            # torch 2.x
    .venv-debian/bin/python benchmarks/bench_gather_vs_broadcast.py     # torch 1.13
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import bench_common as bc  # noqa: E402

REPS, WARMUP = 60, 10
SIZES = (4096, 65536, 266240)  # float32 elements per rank


def run(rank, world, port, n):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    bufs = [torch.randn(n) for _ in range(world)]
    out = [torch.empty(n) for _ in range(world)]
    res = {"broadcasts": [], "async broadcasts": [], "all-gather": []}
    for _ in range(REPS):
        dist.barrier()
        t = time.perf_counter()
        for r in range(world):
            dist.broadcast(bufs[r], r)
        res["broadcasts"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        for w in [dist.broadcast(bufs[r], r, async_op=True) for r in range(world)]:
            w.wait()
        res["async broadcasts"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        dist.all_gather(out, bufs[rank])
        res["all-gather"].append(time.perf_counter() - t)
    if rank == 0:
        print(f"{n * 4 / 1024:.0f} KiB per rank: " + ", ".join(
            f"{k} {statistics.median(v[WARMUP:]) * 1e3:.3f} ms" for k, v in res.items()))
    dist.destroy_process_group()


def main() -> int:
    print(f"torch {torch.__version__}, 2 Gloo ranks, median of {REPS - WARMUP}")
    for n in SIZES:
        mp.spawn(run, args=(2, bc.free_port(), n), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
