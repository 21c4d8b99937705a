#!/usr/bin/env python3
"""ddpx's compression kernels against the torch operations they replace, on the same data.

  compress   ddpx._C.scaled_cast(x, dt, 1/W)   vs  x.to(dt).div_(W)      (torch's fp16/bf16 hook)
  sum_rows   ddpx._C.sum_rows(g16, float32)     vs  g16.float().sum(0)    (Gloo-side fp32 sum)
  decompress ddpx._C.scaled_cast(h, float32)    vs  torch.empty(n).copy_(h)  (torch's hook epilogue)
  orthogonalize  ddpx._C.orthogonalize_(flat, rows, cols)  vs  torch's PowerSGD _orthogonalize
             (batched QR above rank 2, its Python Gram-Schmidt at ranks 1-2), in place, on the
             P shapes of --gs-shapes (tall matrices at high rank, where one block per matrix
             would leave most SMs idle)

Bandwidth is "useful" bytes / time for both sides: the bytes one fused pass must read and write
(compress: 4n read + 2n written; sum_rows: 2*rows*n read + 4n written; decompress: 2n + 4n),
so a ratio of GB/s is a ratio of times. Each op allocates its output, on both sides.

On CUDA the same bytes are also moved by a plain device-to-device copy (dst.copy_(src) of a
uint8 buffer of half the useful bytes, i.e. the same read + write traffic), and each kernel's
bandwidth is reported as a fraction of it (target >= 0.8). Timing: CUDA events around a loop of
--inner launches, median of --reps such loops. CPU: perf_counter (wall) and process_time (CPU)
per call, torch and ddpx interleaved call by call, median of --reps calls; the ratio is also
given on CPU time, steadier on a shared machine.

Usage:
    PYTHONPATH=build/python /usr/bin/python3 benchmarks/bench_kernels.py --json out/kernels.json
    PYTHONPATH=build-gpu/python python3 benchmarks/bench_kernels.py --device cuda
"""
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

import bench_common as bc
import ddpx

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def timer_cpu(fns: Dict[str, Callable[[], object]], reps: int, inner: int) -> Dict[str, float]:
    """Median seconds per call of each fn, wall clock and process CPU time ("<name>:cpu").

    The fns are interleaved call by call. On a shared machine CPU time is the steadier figure
    (it excludes time the process waited for a core); both are reported.
    """
    times: Dict[str, List[float]] = {k: [] for k in fns}
    cpu: Dict[str, List[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(inner):
                out = fn()
            del out
            times[k].append((time.perf_counter() - t0) / inner)
            cpu[k].append((time.process_time() - c0) / inner)
    res = {k: statistics.median(v) for k, v in times.items()}
    res.update({k + ":cpu": statistics.median(v) for k, v in cpu.items()})
    return res


def timer_cuda(fns: Dict[str, Callable[[], object]], reps: int, inner: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        for k, fn in fns.items():
            start.record()
            for _ in range(inner):
                fn()
            stop.record()
            stop.synchronize()
            times[k].append(start.elapsed_time(stop) / 1e3 / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def run(args) -> dict:
    cuda = args.device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    timer = timer_cuda if cuda else timer_cpu
    inner = args.inner if cuda else 1
    W = args.world
    rows = []
    gen = torch.Generator().manual_seed(0)
    for mi in args.sizes:
        n = int(mi * 2**20)
        x = torch.randn(n, generator=gen).to(dev)
        for dname in args.dtypes:
            dt = DTYPES[dname]
            g16 = (torch.randn(W, n, generator=gen) / W).to(dt).to(dev)
            h = g16[0].clone()
            out32 = torch.empty(n, device=dev)
            cases = {
                "compress": (
                    6 * n,
                    {"torch": lambda: x.to(dt).div_(W),
                     "ddpx": lambda: ddpx._C.scaled_cast(x, dt, 1.0 / W)},
                ),
                "sum_rows": (
                    2 * W * n + 4 * n,
                    {"torch": lambda: g16.float().sum(0),
                     "ddpx": lambda: ddpx._C.sum_rows(g16, torch.float32)},
                ),
                "decompress": (
                    6 * n,
                    {"torch": lambda: torch.empty(n, device=dev).copy_(h),
                     "ddpx": lambda: ddpx._C.scaled_cast(h, torch.float32, 1.0)},
                ),
            }
            # Same numbers on both sides (checked once per size and dtype).
            # (scale-then-round vs round-then-divide: equal but for fp16 subnormals / ties.)
            assert torch.allclose(ddpx._C.scaled_cast(x, dt, 1.0 / W).float(),
                                  x.to(dt).div_(W).float(), rtol=2**-7, atol=2**-23)
            assert torch.allclose(ddpx._C.sum_rows(g16, torch.float32), g16.float().sum(0),
                                  rtol=1e-6, atol=1e-6)
            assert torch.equal(ddpx._C.scaled_cast(h, torch.float32, 1.0), h.float())
            for op, (nbytes, fns) in cases.items():
                if op not in args.ops:
                    continue
                if cuda:
                    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
                    dst = torch.empty_like(src)
                    fns = dict(fns, copy=lambda: dst.copy_(src))
                t = timer(fns, args.reps, inner)
                row = {"op": op, "dtype": dname, "n": n, "mi": mi, "bytes": nbytes,
                       "torch_ms": t["torch"] * 1e3, "ddpx_ms": t["ddpx"] * 1e3,
                       "torch_gbs": nbytes / t["torch"] / 1e9,
                       "ddpx_gbs": nbytes / t["ddpx"] / 1e9,
                       "ratio": t["torch"] / t["ddpx"]}
                if not cuda:
                    row["torch_cpu_ms"] = t["torch:cpu"] * 1e3
                    row["ddpx_cpu_ms"] = t["ddpx:cpu"] * 1e3
                    row["ratio_cpu"] = t["torch:cpu"] / max(t["ddpx:cpu"], 1e-9)
                if cuda:
                    row["copy_gbs"] = nbytes / t["copy"] / 1e9
                    row["ddpx_frac_copy"] = row["ddpx_gbs"] / row["copy_gbs"]
                    row["torch_frac_copy"] = row["torch_gbs"] / row["copy_gbs"]
                rows.append(row)
                print_row(row, cuda)
            del out32
            g16 = h = None  # frees them (the lambdas above read them by name)
        x = None
    if "orthogonalize" in args.ops:
        rows.extend(run_orthogonalize(args, dev, timer, inner))
    info = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name() if cuda else (platform.processor()
                                                                 or platform.machine()),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "ddpx_cpu_fast_half": bool(ddpx._C.cpu_has_fast_half()), "world": W,
        "reps": args.reps, "inner": inner,
    }
    return {"info": info, "rows": rows}


def run_orthogonalize(args, dev, timer, inner) -> List[dict]:
    """PowerSGD's orthogonalisation of `count` n x r matrices (one bucket's Ps), in place."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
    out = []
    gen = torch.Generator().manual_seed(1)
    cuda = dev.type == "cuda"
    # On CUDA also ddpx with one block per matrix (spread=False), for what spreading a tall
    # matrix over several blocks gains.
    print("\n| orthogonalize | matrices | torch ms | ddpx ms | torch/ddpx |"
          + (" ddpx one block/matrix ms | one block / ddpx |" if cuda else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if cuda else ""))
    for shape in args.gs_shapes:
        n, r, count = (int(v) for v in shape.split("x"))
        batch = torch.randn(count, n, r, generator=gen).to(dev)
        flat = batch.reshape(-1).clone()
        rows_, cols_ = [n] * count, [r] * count
        # The same orthonormal basis on both sides (up to column signs, which QR leaves open).
        want, got = batch.clone(), flat.clone()
        _orthogonalize(want)
        ddpx._C.orthogonalize_(got, rows_, cols_)
        got = got.view(count, n, r)
        diff = (want.abs() - got.abs()).abs().max().item()
        assert diff < 1e-3, f"{shape}: ddpx and torch differ by {diff}"
        # The descriptors uploaded once, outside the timing, as the hook does once per bucket
        # layout (orthogonalize_ itself uploads them, synchronously, on every call).
        spread = ddpx._C.prepare_orthogonalize_(flat, rows_, cols_)
        fns = {"torch": lambda: _orthogonalize(batch), "ddpx": lambda: spread(flat)}
        if cuda:
            one_block = ddpx._C.prepare_orthogonalize_(flat, rows_, cols_, spread=False)
            fns["one_block"] = lambda: one_block(flat)
        t = timer(fns, args.reps, inner)
        row = {"op": "orthogonalize", "shape": shape, "n": n, "rank": r, "count": count,
               "torch_ms": t["torch"] * 1e3, "ddpx_ms": t["ddpx"] * 1e3,
               "ratio": t["torch"] / t["ddpx"]}
        line = (f"| {n} x {r} | {count} | {row['torch_ms']:.3f} | {row['ddpx_ms']:.3f} | "
                f"{row['ratio']:.2f} |")
        if cuda:
            row["one_block_ms"] = t["one_block"] * 1e3
            row["one_block_ratio"] = t["one_block"] / t["ddpx"]
            line += f" {row['one_block_ms']:.3f} | {row['one_block_ratio']:.2f} |"
        out.append(row)
        print(line)
        sys.stdout.flush()
    return out


_header_done = False


def print_row(r: dict, cuda: bool) -> None:
    global _header_done
    if not _header_done:
        h = "| op | dtype | elements | torch ms | ddpx ms | torch GB/s | ddpx GB/s | torch/ddpx |"
        s = "|---|---|---:|---:|---:|---:|---:|---:|"
        if cuda:
            h += " copy GB/s | ddpx / copy | torch / copy |"
            s += "---:|---:|---:|"
        else:
            h += " torch/ddpx (CPU time) |"
            s += "---:|"
        print(h)
        print(s)
        _header_done = True
    line = (f"| {r['op']} | {r['dtype']} | {r['mi']:g}M | {r['torch_ms']:.3f} | "
            f"{r['ddpx_ms']:.3f} | "
            f"{r['torch_gbs']:.1f} | {r['ddpx_gbs']:.1f} | {r['ratio']:.2f} |")
    if cuda:
        line += f" {r['copy_gbs']:.0f} | {r['ddpx_frac_copy']:.2f} | {r['torch_frac_copy']:.2f} |"
    else:
        line += f" {r['ratio_cpu']:.2f} |"
    print(line)
    sys.stdout.flush()


def main(argv=None) -> int:
    p = bc.arg_parser(__doc__)
    p.add_argument("--sizes", default="1,2,4,8,16,32", help="Mi elements (2**20), comma-separated")
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--ops", default="compress,sum_rows,decompress,orthogonalize")
    p.add_argument("--gs-shapes", default="4096x32x1,4096x4x1,4096x1x1,1024x32x16,256x32x64",
                   help="orthogonalize: n x rank x matrices, comma-separated")
    p.add_argument("--world", type=int, default=2, help="W: the 1/W scale and the rows summed")
    p.add_argument("--reps", type=int, default=None, help="default 7 (cpu) / 20 (cuda)")
    p.add_argument("--inner", type=int, default=20, help="launches per CUDA-event timing")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default="", help="write the raw results (JSON) to this file; "
                   "empty: write none")
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.ops = args.ops.split(",")
    args.gs_shapes = args.gs_shapes.split(",")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch.cuda.is_available() is False")
        if not ddpx._C.with_cuda:
            raise SystemExit("--device cuda: this ddpx build has no CUDA kernels")
    args.reps = args.reps or (20 if args.device == "cuda" else 7)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"# kernels on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"torch thread(s) (ddpx CPU kernels: 1 thread, F16C "
          f"{'on' if ddpx._C.cpu_has_fast_half() else 'off'}), W = {args.world}; GB/s = useful "
          f"bytes (one fused pass) / time; medians\n")
    result = run(args)
    result["argv"] = sys.argv
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
