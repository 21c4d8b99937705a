#!/usr/bin/env python3
"""The collectives under the DDP hooks, alone, on one bucket-sized tensor per rank.

  allreduce_fp32   dist.all_reduce of n fp32 values        (DDP default, allreduce_hook)
  allreduce_fp16   dist.all_reduce of n fp16 values        (torch's fp16 hooks on Gloo)
  allgather_16bit  dist.all_gather of the n 16-bit values as bytes (ddpx's first Gloo exchange)
  alltoall_16bit   all_to_all_single of the n 16-bit values to each peer (splits of 0 to and from
                   self) into a reused output buffer: ddpx's Gloo exchange now
  alltoall_16bit_fresh  the same into a freshly allocated output (page faults included)
  ddpx_fp16_path   ddpx._C.scaled_cast + alltoall_16bit + ddpx._C.sum_rows (close to what the
                   ddpx fp16 hook does per bucket on Gloo, run from Python)
  torch_fp16_path  x.to(fp16).div_(W) + allreduce_fp16 + copy back to fp32 (torch's hook)

Time per call = slowest rank, median over --reps calls; the cases are interleaved.

    PYTHONPATH=build/python /usr/bin/python3 benchmarks/bench_collectives.py
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_common import free_port


def worker(rank, args, world, port, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import ddpx

    rows = []
    for mi in args.sizes:
        n = int(mi * 2**20)
        x = torch.randn(n)
        h = x.half()
        gathered = torch.empty(world, 2 * n, dtype=torch.uint8)
        outs = list(gathered.unbind(0))
        # Peers-only all-to-all, as ddpx's exchange: one row of this rank's values per peer.
        splits = [0 if r == rank else 2 * n for r in range(world)]
        send = torch.empty((world - 1) * 2 * n, dtype=torch.uint8)
        for r in range(world - 1):
            send[r * 2 * n:(r + 1) * 2 * n].copy_(h.view(torch.uint8))
        recv = torch.empty((world - 1) * 2 * n, dtype=torch.uint8)
        summed = torch.empty(world, n, dtype=torch.float16)  # stands for own row + received

        def alltoall(out):
            dist.all_to_all_single(out, send, splits, splits)

        def ddpx_path():
            c = ddpx._C.scaled_cast(x, torch.float16, 1.0 / world)
            send[:2 * n].copy_(c.view(torch.uint8))
            alltoall(recv)
            return ddpx._C.sum_rows(summed, torch.float32)

        def torch_path():
            c = x.to(torch.float16).div_(world)
            dist.all_reduce(c)
            return torch.empty_like(x).copy_(c)

        cases = {
            "allreduce_fp32": lambda: dist.all_reduce(x),
            "allreduce_fp16": lambda: dist.all_reduce(h),
            "allgather_16bit": lambda: dist.all_gather(outs, h.view(torch.uint8)),
            "alltoall_16bit": lambda: alltoall(recv),
            "alltoall_16bit_fresh": lambda: alltoall(torch.empty_like(recv)),
            "ddpx_fp16_path": ddpx_path,
            "torch_fp16_path": torch_path,
        }
        times = {k: [] for k in cases}
        for fn in cases.values():
            dist.barrier()
            fn()
        for _ in range(args.reps):
            for k, fn in cases.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
        all_times = [None] * world
        dist.all_gather_object(all_times, times)
        if rank == 0:
            for k in cases:
                per = [max(t[k][i] for t in all_times) for i in range(args.reps)]
                rows.append({"case": k, "mi": mi, "fp32_mb": n * 4 / 2**20,
                             "median_ms": statistics.median(per)})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default="1,6.5,8",
                   help="Mi elements per rank (6.5M = a 25 MB bucket)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", default="", help="write the raw results (JSON) to this file; "
                   "default: none")
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.spawn(worker, args=(args, args.world_size, free_port(), out), nprocs=args.world_size)
        with open(out) as f:
            rows = json.load(f)
    print(f"# Gloo x {args.world_size} ranks, torch {torch.__version__}; ms per call, slowest "
          f"rank, median of {args.reps}\n")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    print("| elements/rank (fp32 MB) | " + " | ".join(cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for mi in args.sizes:
        sel = {r["case"]: r for r in rows if r["mi"] == mi}
        print(f"| {mi:g}M ({sel[cases[0]]['fp32_mb']:.0f}) | "
              + " | ".join(f"{sel[c]['median_ms']:.1f}" for c in cases) + " |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
