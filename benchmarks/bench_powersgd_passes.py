#!/usr/bin/env python3
"""Where PowerSGD's time goes on one CPU thread: each pass ddpx's layer-wise hook makes over a
bucket, timed alone, beside the memory traffic that bounds it and torch's equivalent ops.

    .venv/bin/python benchmarks/bench_powersgd_passes.py                 # the 33.6M MLP
    .venv/bin/python benchmarks/bench_powersgd_passes.py --n 1024 --m 1024 --count 8 --rank 4

The shapes are bench_network.py's MLP by default (8 x Linear(2048, 2048): eight 2048 x 2048
gradients, rank 4), the bucket as one flat fp32 buffer with its error memory. Per pass: the
median of --reps runs (ms), the bytes it moves to and from memory (its reads and writes of the
gradients and the memory: the factors are a few KB and stay in cache), and the rate that gives.
A copy of the bucket (torch's copy_, one read and one write) is the memory floor; the sum of
the passes is what the hook spends per step on one thread besides the orthogonalisation and the
collectives. torch's ops for the same step (the compensation as add_ and clone, three matmuls,
the residual as a subtraction) run beside them. Not part of the test suite.
"""
import argparse
import statistics
import time

import torch

from ddpx import _C


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048, help="rows per gradient")
    p.add_argument("--m", type=int, default=2048, help="columns per gradient")
    p.add_argument("--count", type=int, default=8, help="gradients in the bucket")
    p.add_argument("--rank", type=int, default=4, help="matrix_approximation_rank")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, n, m, r = args.count, args.n, args.m, args.rank
    grads = torch.randn(b, n, m)
    err = torch.randn(b, n, m) * 0.01
    q = torch.randn(b, m, r)
    pf = torch.empty(b, n, r)
    spare = torch.empty_like(grads)
    size = grads.numel() * grads.element_size()

    rows = []  # (what, ms, bytes moved)
    rows.append(("copy of the bucket (memory floor)", timed(lambda: spare.copy_(grads), args.reps),
                 2 * size))
    rows.append(("compensate + P = M Q (one pass)",
                 timed(lambda: _C.lowrank_("project", grads, q, pf, err), args.reps), 4 * size))
    rows.append(("Q = M^T P", timed(lambda: _C.lowrank_("project_t", grads, pf, q), args.reps),
                 size))
    rows.append(("M = P Q^T + err -= M (one pass)",
                 timed(lambda: _C.lowrank_("reconstruct", pf, q, grads, err), args.reps),
                 3 * size))
    ddpx_total = sum(ms for _, ms, _ in rows[1:])

    torch_rows = [
        ("torch: M += err; err = M.clone()", timed(lambda: (grads.add_(err), err.copy_(grads)),
                                                   args.reps)),
        ("torch: P = M Q", timed(lambda: torch.bmm(grads, q, out=pf), args.reps)),
        ("torch: Q = M^T P", timed(lambda: torch.bmm(grads.transpose(1, 2), pf, out=q),
                                   args.reps)),
        ("torch: M = P Q^T", timed(lambda: torch.bmm(pf, q.transpose(1, 2), out=grads),
                                   args.reps)),
        ("torch: err = err - M", timed(lambda: err.sub_(grads), args.reps)),
    ]
    torch_total = sum(ms for _, ms in torch_rows)

    print(f"PowerSGD's passes over a bucket of {b} x {n} x {m} fp32 gradients "
          f"({size / 1e6:.1f} MB), rank {r}, {args.threads} thread(s), torch {torch.__version__}")
    print()
    print("| pass | ms | MB moved | GB/s |")
    print("|---|---:|---:|---:|")
    for what, ms, moved in rows:
        print(f"| ddpx {what} | {ms:.1f} | {moved / 1e6:.0f} | {moved / ms / 1e6:.1f} |")
    print(f"| **ddpx, the step's passes** | **{ddpx_total:.1f}** | | |")
    for what, ms in torch_rows:
        print(f"| {what} | {ms:.1f} | | |")
    print(f"| **torch, the same step** | **{torch_total:.1f}** | | |")
    print()
    print(f"ddpx / torch: {ddpx_total / torch_total:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
