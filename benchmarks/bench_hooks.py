#!/usr/bin/env python3
"""Step time of DDP with torch's communication hooks and ddpx's, side by side.

Every configuration runs in the same process group, on the same model (same initial weights)
and the same per-rank data. Each configuration gets its own DDP instance (a DDP model takes one
hook), all built up front; timing then interleaves them in rounds (R rounds x K steps of each,
the order rotated every round) so that machine drift hits all of them alike.

A step is forward + backward (DDP's backward ends only when every bucket's hook future has
completed, so the gradients are synchronised when it returns; on CUDA the step is also closed
by torch.cuda.synchronize()). The step time of the job is the slowest rank's time for that
step; the figure reported is the median over all timed steps.

Hook overhead = median step - median step of the ddpx native noop hook (same forward/backward,
no communication, no Python per bucket). The torch noop hook (Python) is reported too. On a
noisy machine the paired overhead is steadier: per round, the config's median step minus the
baseline's median step in that round, then the median over rounds. Ratios and the target check
(16-bit ddpx overhead <= fp32 allreduce overhead) use paired figures.

Before timing, verify() checks the gradients after one backward:
  * ddpx allreduce (drop-in and native) == torch allreduce_hook, bit for bit;
  * ddpx quantization_pertensor/perchannel_hook == torch's, bit for bit (on CPU; torch's
    per-channel hook loops over channels of 512 in Python: select it with --configs on a large
    model only with few rounds);
  * ddpx noop == torch noop (local gradients), bit for bit;
  * ddpx fp16/bf16: |g - exact mean| <= u * mean_r |g_r| + subnormal slack, with u the unit
    round-off of the 16-bit type (one rounding per rank, fp32 sums), and close to torch's
    fp16 hook (whose Gloo sums also round in fp16).

Usage (CPU, 2 Gloo ranks, the default):
    PYTHONPATH=build/python /usr/bin/python3 benchmarks/bench_hooks.py --json out/hooks.json
GPU (NCCL world size 1, then Gloo with 2 ranks sharing the one GPU):
    PYTHONPATH=build-gpu/python python3 benchmarks/bench_hooks.py --device cuda
"""
import copy
import json
import os
import re
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    quantization_hooks,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import bench_common as bc
from bench_common import flat_grads, fmt, step

# name -> (who, path, description)
CONFIGS = {
    "none": ("torch", "builtin", "no hook (DDP's C++ fp32 allreduce)"),
    "torch_noop": ("torch", "python", "debugging_hooks.noop_hook"),
    "ddpx_noop_dropin": ("ddpx", "drop-in", "ddpx.hooks.noop_hook via ddp.register_comm_hook"),
    "ddpx_noop_native": ("ddpx", "native", "ddpx.hooks.noop_hook via ddpx.register_comm_hook"),
    "torch_allreduce": ("torch", "python", "default_hooks.allreduce_hook"),
    "torch_builtin_allreduce": ("torch", "builtin", "BuiltinCommHookType.ALLREDUCE (C++)"),
    "ddpx_allreduce_dropin": ("ddpx", "drop-in", "ddpx.hooks.allreduce_hook"),
    "ddpx_allreduce_native": ("ddpx", "native", "ddpx.hooks.allreduce_hook"),
    "torch_fp16": ("torch", "python", "default_hooks.fp16_compress_hook"),
    "torch_builtin_fp16": ("torch", "builtin", "BuiltinCommHookType.FP16_COMPRESS (C++)"),
    "ddpx_fp16_dropin": ("ddpx", "drop-in", "ddpx.hooks.fp16_compress_hook"),
    "ddpx_fp16_native": ("ddpx", "native", "ddpx.hooks.fp16_compress_hook"),
    "torch_bf16": ("torch", "python", "default_hooks.bf16_compress_hook"),
    "ddpx_bf16_dropin": ("ddpx", "drop-in", "ddpx.hooks.bf16_compress_hook"),
    "ddpx_bf16_native": ("ddpx", "native", "ddpx.hooks.bf16_compress_hook"),
    "torch_qtensor": ("torch", "python", "quantization_hooks.quantization_pertensor_hook"),
    "ddpx_qtensor_dropin": ("ddpx", "drop-in", "ddpx.hooks.quantization_pertensor_hook"),
    "ddpx_qtensor_native": ("ddpx", "native", "ddpx.hooks.quantization_pertensor_hook"),
    "torch_qchannel": ("torch", "python", "quantization_hooks.quantization_perchannel_hook"),
    "ddpx_qchannel_dropin": ("ddpx", "drop-in", "ddpx.hooks.quantization_perchannel_hook"),
    "ddpx_qchannel_native": ("ddpx", "native", "ddpx.hooks.quantization_perchannel_hook"),
    # ddpx's quantized_hook with error feedback from the first step (start_iter=0).
    "ddpx_q8_native": ("ddpx", "native", "ddpx.hooks.quantized_hook, bits=8"),
    "ddpx_q4_native": ("ddpx", "native", "ddpx.hooks.quantized_hook, bits=4"),
    "ddpx_q1_native": ("ddpx", "native", "ddpx.hooks.quantized_hook, bits=1"),
    # The same with the exchange named ("auto": all-gather on 2 ranks, reduce-scatter on more).
    "ddpx_q8rs_native": ("ddpx", "native", "ddpx.hooks.quantized_hook, bits=8, reduce_scatter"),
    "ddpx_q8ag_native": ("ddpx", "native", "ddpx.hooks.quantized_hook, bits=8, allgather"),
    "ddpx_q1rs_native": ("ddpx", "native", "ddpx.hooks.quantized_hook, bits=1, reduce_scatter"),
    "ddpx_q1ag_native": ("ddpx", "native", "ddpx.hooks.quantized_hook, bits=1, allgather"),
}
BASELINE = "ddpx_noop_native"
TORCH_BASELINE = "torch_noop"

# (torch config, ddpx config): the ratio torch/ddpx is printed for each pair present.
PAIRS = [
    ("torch_noop", "ddpx_noop_dropin"),
    ("torch_noop", "ddpx_noop_native"),
    ("torch_allreduce", "ddpx_allreduce_dropin"),
    ("torch_allreduce", "ddpx_allreduce_native"),
    ("torch_builtin_allreduce", "ddpx_allreduce_native"),
    ("torch_fp16", "ddpx_fp16_dropin"),
    ("torch_fp16", "ddpx_fp16_native"),
    ("torch_builtin_fp16", "ddpx_fp16_native"),
    ("torch_fp16", "ddpx_bf16_native"),
    ("torch_bf16", "ddpx_bf16_dropin"),
    ("torch_bf16", "ddpx_bf16_native"),
    ("torch_qtensor", "ddpx_qtensor_dropin"),
    ("torch_qtensor", "ddpx_qtensor_native"),
    ("torch_qchannel", "ddpx_qchannel_dropin"),
    ("torch_qchannel", "ddpx_qchannel_native"),
]


def available_configs(backend: str, device: torch.device) -> List[str]:
    names = list(CONFIGS)
    from ddpx._compat import TORCH_BF16_HOOKS_ON_GLOO
    if not ((backend == "nccl" and device.type == "cuda") or
            (backend == "gloo" and TORCH_BF16_HOOKS_ON_GLOO)):
        # torch refuses it without a CUDA build with NCCL >= 2.10, and 1.13's Gloo has no bf16;
        # a torch 2.x CUDA build runs it on Gloo, even without a GPU.
        names.remove("torch_bf16")
    if device.type == "cuda":
        # torch's per-channel hook loops in Python over 512-value channels: on the GPU model
        # (268M gradients) it had not finished one step after 35 s on the H200. Its per-tensor
        # hook stays, except on Gloo, where both of torch's quantization hooks raise IndexError
        # on CUDA buckets (quantize_and_allgather indexes a 0-dim tensor; torch 2.11). ddpx's
        # run on both.
        names.remove("torch_qchannel")
        if backend == "gloo":
            names.remove("torch_qtensor")
    return names


def register(name: str, ddp: DDP, ddpx) -> None:
    H = ddpx.hooks
    if name == "none":
        return
    if name == "torch_noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif name == "torch_allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "torch_builtin_allreduce":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif name == "torch_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "torch_builtin_fp16":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    elif name == "torch_bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "torch_qtensor":
        ddp.register_comm_hook(None, quantization_hooks.quantization_pertensor_hook)
    elif name == "torch_qchannel":
        ddp.register_comm_hook(None, quantization_hooks.quantization_perchannel_hook)
    else:
        _, kind, path = name.split("_")
        m = re.fullmatch(r"q(\d)(rs|ag)?", kind)
        if m:  # quantized_hook, "q<bits>[rs|ag]"
            extra = {"exchange": {"rs": "reduce_scatter", "ag": "allgather"}[m.group(2)]} \
                if m.group(2) else {}
            state = H.QuantizedState(process_group=None, bits=int(m.group(1)), start_iter=0,
                                     **extra)
            bc.register_hook(ddpx, ddp, state, H.quantized_hook, native=path == "native")
            return
        hook = {"noop": H.noop_hook, "allreduce": H.allreduce_hook,
                "fp16": H.fp16_compress_hook, "bf16": H.bf16_compress_hook,
                "qtensor": H.quantization_pertensor_hook,
                "qchannel": H.quantization_perchannel_hook}[kind]
        bc.register_hook(ddpx, ddp, None, hook, native=path == "native")


def verify(ddps: Dict[str, DDP], base: torch.nn.Module, x, y, world: int) -> dict:
    """One backward per DDP instance; compares gradients. Returns {check: {ok, detail}}."""
    # Exact reference: local gradients of a plain copy, summed over ranks in fp64.
    local = copy.deepcopy(base).to(x.device)
    torch.nn.functional.mse_loss(local(x), y).backward()
    g_local = flat_grads(local).double()
    exact = g_local.clone()
    dist.all_reduce(exact)
    exact /= world
    abs_mean = g_local.abs()
    dist.all_reduce(abs_mean)
    abs_mean /= world
    del local

    grads = {}
    for name, ddp in ddps.items():
        step(ddp, x, y)
        grads[name] = flat_grads(ddp.module)
        ddp.zero_grad(set_to_none=True)

    checks = {}

    def record(check: str, ok: bool, detail: str) -> None:
        checks[check] = {"ok": bool(ok), "detail": detail}

    for t, d in [("torch_allreduce", "ddpx_allreduce_dropin"),
                 ("torch_allreduce", "ddpx_allreduce_native"),
                 ("torch_noop", "ddpx_noop_dropin"), ("torch_noop", "ddpx_noop_native"),
                 ("torch_qtensor", "ddpx_qtensor_dropin"), ("torch_qtensor", "ddpx_qtensor_native"),
                 ("torch_qchannel", "ddpx_qchannel_dropin"),
                 ("torch_qchannel", "ddpx_qchannel_native")]:
        if t in grads and d in grads:
            diff = (grads[t] - grads[d]).abs().max().item()
            record(f"{d} == {t} (bitwise)", torch.equal(grads[t], grads[d]),
                   f"max |diff| = {diff:.3g}")
    if "torch_noop" in grads:
        diff = (grads["torch_noop"].double() - g_local).abs().max().item()
        record("torch_noop == local gradient", diff == 0.0, f"max |diff| = {diff:.3g}")

    # 16-bit hooks: one rounding of g_r / W per rank (unit round-off u), fp32 sums after that.
    # Bound |g - exact| <= 2 * (u * mean_r |g_r| + W * half the smallest subnormal) + fp32 slack.
    u_of = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
    tiny_of = {"fp16": 2.0 ** -25, "bf16": 0.0}
    for name, g in grads.items():
        for kind in ("fp16", "bf16"):
            if kind not in name or not name.startswith(("ddpx_", "torch_")):
                continue
            err = (g.double() - exact).abs()
            bound = 2 * (u_of[kind] * abs_mean + world * tiny_of[kind]) + 2.0 ** -22 * exact.abs()
            worst = (err / bound.clamp_min(1e-30)).max().item()
            ok = worst <= 1.0 if name.startswith("ddpx_") else True  # torch: reported only
            record(f"{name} vs exact mean (error/bound)", ok,
                   f"max |err| = {err.max().item():.3g}, worst err/bound = {worst:.3f}")
    # torch's hooks cast *then* divide (a second rounding for values that become fp16
    # subnormals) and their Gloo/NCCL 16-bit sums round (W-1) more times, so this is a loose
    # closeness check; the tight one is against the exact mean.
    for kind in ("fp16", "bf16"):
        t = f"torch_{kind}"
        if t not in grads:
            continue
        ref = grads[t].double()
        for d in (f"ddpx_{kind}_dropin", f"ddpx_{kind}_native"):
            if d in grads:
                diff = (grads[d].double() - ref).abs()
                bound = (4 * world * (u_of[kind] * abs_mean + tiny_of[kind])
                         + 2.0 ** -22 * ref.abs())
                worst = (diff / bound.clamp_min(1e-30)).max().item()
                record(f"{d} ~= {t}", worst <= 1.0,
                       f"max |diff| = {diff.max().item():.3g}, worst diff/bound = {worst:.3f}")
    for a, b in [("ddpx_fp16_dropin", "ddpx_fp16_native"), ("ddpx_bf16_dropin", "ddpx_bf16_native"),
                 ("ddpx_allreduce_dropin", "ddpx_allreduce_native")]:
        if a in grads and b in grads:
            record(f"{a} == {b} (bitwise)", torch.equal(grads[a], grads[b]),
                   f"max |diff| = {(grads[a] - grads[b]).abs().max().item():.3g}")

    # Every rank must hold the same synchronised gradients (noop excluded by design).
    for name, g in grads.items():
        if "noop" in name:
            continue
        g0 = g.clone()
        dist.broadcast(g0, src=0)
        if not torch.equal(g0, g):
            record(f"{name}: ranks agree", False, "rank differs from rank 0")
    return bc.combine_checks(checks, x.device)


def worker(rank: int, args, backend: str, world: int, port: int, out_path: str) -> None:
    device = bc.init_rank(rank, args, backend, world, port)
    import ddpx  # after init: a clear ImportError here names the torch mismatch

    base = bc.build_model(args).to(device)  # copies below are made on the device
    x, y = bc.make_data(args, rank, device)

    names = bc.select_configs(available_configs(backend, device), CONFIGS, args.configs)
    ddps: Dict[str, DDP] = {}
    for name in names:
        ddp = bc.make_ddp(base, device, args.bucket_cap_mb)
        register(name, ddp, ddpx)
        ddps[name] = ddp

    sync = bc.sync_of(device)
    checks = {} if args.no_verify else verify(ddps, base, x, y, world)

    for ddp in ddps.values():  # warm-up (the verify step was the first)
        dist.barrier()
        for _ in range(args.warmup):
            step(ddp, x, y)
            ddp.zero_grad(set_to_none=True)
        sync()

    times, wall = bc.timed_rounds(ddps, names, args, x, y, sync)

    gathered = bc.gather_times(times, world)
    if rank == 0:
        results = {}
        for name in names:
            results[name] = {"who": CONFIGS[name][0], "path": CONFIGS[name][1],
                             "hook": CONFIGS[name][2], **bc.step_stats(name, gathered, args)}
        nparams = sum(p.numel() for p in base.parameters())
        info = bc.run_info(args, backend, world, device, nparams)
        info.update({
            "bucket_cap_mb": args.bucket_cap_mb, "rounds": args.rounds, "steps": args.steps,
            "timed_wall_s": wall, "ddpx_cpu_fast_half": bool(ddpx._C.cpu_has_fast_half()),
        })
        with open(out_path, "w") as f:
            json.dump({"info": info, "verify": checks, "results": results}, f)
    dist.barrier()
    dist.destroy_process_group()


def analyse(run: dict) -> dict:
    res = run["results"]
    base = res.get(BASELINE, {}).get("median_ms")
    tbase = res.get(TORCH_BASELINE, {}).get("median_ms")
    for r in res.values():
        r["overhead_ms"] = r["median_ms"] - base if base is not None else None
        r["overhead_vs_torch_noop_ms"] = r["median_ms"] - tbase if tbase is not None else None
        # Paired in time: per round, this config's median step minus the baseline's median
        # step in the same round; the median over rounds cancels slow drift of the machine.
        r["overhead_paired_ms"] = (bc.paired_median(r["round_medians_ms"],
                                                    res[BASELINE]["round_medians_ms"])
                                   if base is not None else None)
    ratios = []
    for t, d in PAIRS:
        if t in res and d in res:
            entry = {"torch": t, "ddpx": d,
                     "step_ratio": res[t]["median_ms"] / res[d]["median_ms"]}
            ot, od = res[t]["overhead_paired_ms"], res[d]["overhead_paired_ms"]
            entry["overhead_torch_ms"], entry["overhead_ddpx_ms"] = ot, od
            entry["overhead_ratio"] = (ot / od) if (ot is not None and od and od > 0.5) else None
            ratios.append(entry)
    run["ratios"] = ratios
    # Target: compressed ddpx hooks add no more than the fp32 allreduce does.
    targets = []
    fp32 = [n for n in ("none", "torch_allreduce", "ddpx_allreduce_native") if n in res]
    for d in ("ddpx_fp16_native", "ddpx_fp16_dropin", "ddpx_bf16_native", "ddpx_bf16_dropin"):
        if d not in res or res[d]["overhead_paired_ms"] is None:
            continue
        for ref in fp32:
            # Paired per round as well: (16-bit config - fp32 config) in the same round.
            diff = bc.paired_median(res[d]["round_medians_ms"], res[ref]["round_medians_ms"])
            targets.append({
                "ddpx": d, "fp32_ref": ref, "ddpx_overhead_ms": res[d]["overhead_paired_ms"],
                "fp32_overhead_ms": res[ref]["overhead_paired_ms"], "paired_diff_ms": diff,
                "met": diff <= 0.0})
    run["targets"] = targets
    return run


def print_report(run: dict) -> None:
    i = run["info"]
    bc.print_run_header("", i, f"bucket_cap_mb {i['bucket_cap_mb']}")
    bc.print_checks("verify (one backward, gradients):", run["verify"])
    bc.print_table(
        ["config", "hook", "path", "median ms", "p25-p75 ms", "overhead vs ddpx noop (ms)",
         "paired overhead (ms)", "overhead vs torch noop (ms)"], "lllrrrrr",
        ([name, r["hook"], r["path"], f"{r['median_ms']:.1f}",
          f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}", fmt(r["overhead_ms"]),
          fmt(r["overhead_paired_ms"]), fmt(r["overhead_vs_torch_noop_ms"])]
         for name, r in run["results"].items()))
    if run["ratios"]:
        print()
        bc.print_table(
            ["torch", "ddpx", "step ratio torch/ddpx", "paired overhead torch / ddpx (ms)",
             "overhead ratio"], "llrrr",
            ([e["torch"], e["ddpx"], f"{e['step_ratio']:.2f}",
              f"{fmt(e['overhead_torch_ms'])} / {fmt(e['overhead_ddpx_ms'])}",
              fmt(e["overhead_ratio"], ".2f")] for e in run["ratios"]))
    if run["targets"]:
        print("\ntarget: 16-bit ddpx hook overhead <= fp32 allreduce overhead (paired per round: "
              "median over rounds of the step-time difference)")
        for t in run["targets"]:
            print(f"  [{'met' if t['met'] else 'NOT met'}] {t['ddpx']} "
                  f"{t['ddpx_overhead_ms']:.1f} ms "
                  f"vs {t['fp32_ref']} {t['fp32_overhead_ms']:.1f} ms: difference "
                  f"{t['paired_diff_ms']:+.1f} ms/step")
    sys.stdout.flush()


def main(argv=None) -> int:
    p = bc.arg_parser(__doc__)
    p.add_argument("--backends", default=None,
                   help="comma-separated; default gloo on cpu, nccl,gloo on cuda")
    p.add_argument("--world-size", type=int, default=2, help="ranks for gloo (nccl: GPUs, max)")
    bc.add_model_args(p)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="steps per config per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per config")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: cpu_count // ranks on cpu, torch's default "
                        "on cuda)")
    p.add_argument("--configs", default="", help=f"subset of: {','.join(CONFIGS)}")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--json", default="", help="write the raw results (JSON) to this file; "
                   "empty: write none")
    args = p.parse_args(argv)

    cuda = bc.model_defaults(args)
    backends = (args.backends or ("nccl,gloo" if cuda else "gloo")).split(",")

    runs = []
    for backend in backends:
        world = bc.world_of(backend, args, cuda)
        if args.threads == 0 and not cuda:
            args.threads = max(1, (os.cpu_count() or 1) // world)
        t0 = time.perf_counter()
        run = analyse(bc.spawn_run(worker, args, backend, world))
        run["info"]["total_wall_s"] = time.perf_counter() - t0
        print_report(run)
        runs.append(run)

    if args.json:
        bc.write_json(args.json, runs)
    return bc.report_failed(runs)


if __name__ == "__main__":
    sys.exit(main())
