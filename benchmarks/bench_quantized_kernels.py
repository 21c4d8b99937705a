#!/usr/bin/env python3
"""quantized_hook's kernels on one thread against memcpy, on the same machine in one run: the
block quantization with error feedback (reads the values and the residual, writes the residual
and the message) and the decode (reads the message, writes fp32 values), per bit width, with
preallocated outputs; 2 bits without error feedback, with the max|v| and the fitted scale; and
every width without error feedback rotated (quantized_hook's rotation) and not.
Bandwidth is the bytes one pass must move over its time; the issue's target is >= 50% of
memcpy's (which moves 8 bytes per fp32 value: read and write).

    .venv/bin/python benchmarks/bench_quantized_kernels.py [--n 16777216] [--reps 5]
        [--device cpu|cuda] [--json FILE]
"""
import argparse
import json
import time

import torch

import ddpx
from ddpx._loader import _C


def best_of(fn, reps: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1 << 24)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = args.n
    x = torch.randn(n, device=dev)
    r = torch.zeros(n, device=dev)
    out = torch.empty(n, device=dev)
    memcpy = best_of(lambda: out.copy_(x), args.reps, sync)
    rows = [{"op": "memcpy", "ms": memcpy * 1e3, "gbs": 8 * n / memcpy / 1e9}]
    print(f"ddpx {ddpx.__version__}, torch {torch.__version__}, {dev}, n = {n}, one thread")
    print(f"memcpy: {memcpy * 1e3:.1f} ms, {8 * n / memcpy / 1e9:.1f} GB/s")
    for bits in (8, 4, 2, 1):
        m = _C.quantize_ef_(x, r, bits, args.block)
        tq = best_of(lambda: _C.quantize_ef_(x, r, bits, args.block, out=m), args.reps, sync)
        td = best_of(lambda: _C.dequantize_(m, bits, args.block, out), args.reps, sync)
        q_gbs = (12 * n + m.numel()) / tq / 1e9
        d_gbs = (4 * n + m.numel()) / td / 1e9
        rows.append({"op": "quantize_ef", "bits": bits, "ms": tq * 1e3, "gbs": q_gbs})
        rows.append({"op": "dequantize", "bits": bits, "ms": td * 1e3, "gbs": d_gbs})
        print(f"{bits} bits: quantize + error feedback {tq * 1e3:.1f} ms, {q_gbs:.1f} GB/s "
              f"({q_gbs / rows[0]['gbs']:.0%} of memcpy); dequantize {td * 1e3:.1f} ms, "
              f"{d_gbs:.1f} GB/s ({d_gbs / rows[0]['gbs']:.0%})")
    # 2 bits without error feedback (quantized_hook's use_error_feedback=False): no residual to
    # read or write, and the scale either max|v| or fitted to the block, which costs one more
    # pass over the block's values (in cache).
    for fit in (False, True):
        m = _C.quantize_ef_(x, None, 2, args.block, fitted_ternary=fit)
        tq = best_of(lambda: _C.quantize_ef_(x, None, 2, args.block, out=m, fitted_ternary=fit),
                     args.reps, sync)
        gbs = (4 * n + m.numel()) / tq / 1e9
        scale = "fitted" if fit else "max|v|"
        rows.append({"op": "quantize", "bits": 2, "scale": scale, "ms": tq * 1e3, "gbs": gbs})
        print(f"2 bits without error feedback, {scale} scale: quantize {tq * 1e3:.1f} ms, "
              f"{gbs:.1f} GB/s ({gbs / rows[0]['gbs']:.0%} of memcpy)")
    # Without error feedback quantized_hook rotates every block (rotation="auto"): the values go
    # through a random-sign Hadamard transform before the codes (fitted at 2 bits, the unbiased
    # scale at 1), and every decode rotates back. Against the same passes unrotated.
    for bits in (8, 4, 2, 1):
        times = {}
        for rot in (False, True):
            kw = dict(fitted_ternary=bits == 2, rotate=rot, unbiased_sign=rot and bits == 1)
            m = _C.quantize_ef_(x, None, bits, args.block, **kw)
            tq = best_of(lambda: _C.quantize_ef_(x, None, bits, args.block, out=m, **kw),
                         args.reps, sync)
            td = best_of(lambda: _C.dequantize_(m, bits, args.block, out, rotate=rot),
                         args.reps, sync)
            times[rot] = (tq, td)
            rows.append({"op": "quantize", "bits": bits, "rotated": rot, "ms": tq * 1e3,
                         "gbs": (4 * n + m.numel()) / tq / 1e9})
            rows.append({"op": "dequantize", "bits": bits, "rotated": rot, "ms": td * 1e3,
                         "gbs": (4 * n + m.numel()) / td / 1e9})
        (q0, d0), (q1, d1) = times[False], times[True]
        print(f"{bits} bit{'s' if bits > 1 else ''} without error feedback, rotated: quantize "
              f"{q1 * 1e3:.1f} ms (unrotated {q0 * 1e3:.1f}, {q1 / q0:.2f}x; "
              f"{(4 * n) / q1 / 1e9 / rows[0]['gbs']:.0%} of memcpy), dequantize "
              f"{d1 * 1e3:.1f} ms (unrotated {d0 * 1e3:.1f}, {d1 / d0:.2f}x; "
              f"{(4 * n) / d1 / 1e9 / rows[0]['gbs']:.0%} of memcpy)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
