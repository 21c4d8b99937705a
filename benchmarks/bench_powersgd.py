#!/usr/bin/env python3
"""PowerSGD step time: torch's powerSGD_hook and ddpx's (drop-in and native), side by side.

Every configuration runs in the same process group, on the same model (same initial weights),
the same per-rank data and the same DDP bucket layout. Each configuration gets its own DDP
instance and its own PowerSGDState (start_powerSGD_iter=2 by default), all built up front:

  none                  no hook (DDP's C++ fp32 allreduce)
  ddpx_noop_native      ddpx noop hook, native: forward + backward, no communication (baseline)
  torch_allreduce       torch's default_hooks.allreduce_hook
  torch_psgd_r{R}       torch's powerSGD_hook, matrix_approximation_rank R (R in --ranks)
  ddpx_psgd_r{R}_dropin ddpx.hooks.powerSGD_hook via ddp.register_comm_hook
  ddpx_psgd_r{R}_native ddpx.hooks.powerSGD_hook via ddpx.register_comm_hook
  ddpx_batched_r1_native    ddpx.hooks.batched_powerSGD_hook, rank 1, native
  ddpx_fp16_psgd_r1_native  ddpx.hooks.fp16_compress_wrapper(powerSGD_hook), rank 1, native

Each config first runs its start_powerSGD_iter plain-allreduce steps, then its first compressed
step (whose gradients verify() compares), then --warmup compressed steps: none of these is
timed. Timing then interleaves the configs in rounds (R rounds x K steps of each, the order
rotated every round), as bench_hooks.py does. A step is forward + backward (DDP's backward
returns once the bucket futures have completed; on CUDA closed by torch.cuda.synchronize());
the step time is the slowest rank's, the figure the median over the timed steps.

Hook overhead = step - ddpx native noop step, paired per round (per round: the config's median
step minus the noop's median step in that round; then the median over rounds). The ratio
ddpx/torch is taken on these paired overheads (target on CPU: <= 0.5 for ddpx native).

Bytes per step come from the states' compression statistics (numel after compression, counted
over the timed steps and divided by their number): payload = elements after compression x
element size (4 for fp32, 2 under the fp16 wrapper), i.e. the P, Q and uncompressed elements one
rank contributes to its allreduces; "ring bytes sent per rank" = payload x 2(W-1)/W, what a ring
allreduce sends per rank (Gloo and NCCL pick other algorithms too; this is the model, not a
measurement; 0 for W = 1). For none / allreduce the payload is the whole bucket (all gradients).
Compression rate = numel before / numel after (torch's compression_stats()).

torch's powerSGD_hook on Gloo with several buckets is racy: it issues its second and third
allreduce from future callbacks (Gloo threads) while the autograd thread already issues the next
bucket's first one, so ranks can issue collectives in different orders and the job aborts
(gloo::EnforceNotMet) or hangs. The timed run therefore uses ONE bucket for every config (torch's
and ddpx's alike: --bucket-cap-mb one, the default on Gloo with several ranks, sets both DDP's
bucket cap and its first-bucket cap above the model size). --race-trials N measures the race
separately: N short jobs of torch's hook, then N of ddpx's, with DDP's default 25 MB buckets,
each in its own mp.spawn under a timeout, counting aborts and hangs; nothing there can stop the
benchmark. torch's batched_powerSGD_hook is probed once on a world-size-1 group (it raises an
AssertionError in torch 1.13) and reported as unsupported when it fails.

verify() (before timing): after the first compressed step, ddpx's gradients (drop-in and native)
agree with torch's within 1e-5 relative (max |ddpx - torch| / max |torch|) at rank 1 (ddpx
reproduces torch's random Q exactly); drop-in == native bit for bit at every rank; every rank
holds the same gradients; ranks 2, 4, 32 and the batched / fp16 configs are reported (ddpx runs
a second Gram-Schmidt pass above rank 2, on purpose, so it differs from torch there), with each
config's distance from the exact mean gradient.

A memory-bandwidth floor is printed beside the overhead: a device copy of the model's gradient
bytes is timed in the same run (bandwidth = bytes read + written / time); PowerSGD must read
every compressed gradient matrix twice (P = M Q, Q = M^T P) and write it once (M = P Q^T): 3
passes; fused error feedback adds 4 (read the residual, write M + residual, read M for the new
residual, write the residual): 7 passes. floor = passes x gradient bytes / copy bandwidth.

Usage (CPU, 2 Gloo ranks, 8 x Linear(1024,1024)+ReLU, batch 4, the default):
    PYTHONPATH=build/python /usr/bin/python3 benchmarks/bench_powersgd.py --json out/psgd.json
GPU (NCCL, world size 1, 16 x Linear(4096,4096)+GELU, batch 512):
    PYTHONPATH=build-gpu/python python3 benchmarks/bench_powersgd.py --device cuda
Race count only (no timing):
    PYTHONPATH=build/python /usr/bin/python3 benchmarks/bench_powersgd.py --race-trials 10 \
        --race-only
Summary over repeated runs (median [min, max]):
    python3 benchmarks/bench_powersgd.py --summarize benchmarks/results/cpu/powersgd_run*.json
"""
import copy
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tpsgd
from torch.nn.parallel import DistributedDataParallel as DDP

import bench_common as bc
from bench_common import flat_grads, fmt, free_port, step

BASELINE = "ddpx_noop_native"
VERIFY_RTOL = 1e-5


def config_table(ranks: List[int]) -> Dict[str, dict]:
    """name -> {who, path, hook, rank (None: no PowerSGD), esize}."""
    c = {
        "none": dict(who="torch", path="builtin", hook="no hook (DDP's C++ fp32 allreduce)"),
        "ddpx_noop_native": dict(who="ddpx", path="native", hook="noop_hook"),
        "torch_allreduce": dict(who="torch", path="python", hook="default_hooks.allreduce_hook"),
    }
    for r in ranks:
        c[f"torch_psgd_r{r}"] = dict(who="torch", path="python", hook="powerSGD_hook", rank=r)
        c[f"ddpx_psgd_r{r}_dropin"] = dict(who="ddpx", path="drop-in", hook="powerSGD_hook",
                                          rank=r)
        c[f"ddpx_psgd_r{r}_native"] = dict(who="ddpx", path="native", hook="powerSGD_hook",
                                          rank=r)
    c["ddpx_batched_r1_native"] = dict(who="ddpx", path="native", hook="batched_powerSGD_hook",
                                       rank=1)
    c["ddpx_fp16_psgd_r1_native"] = dict(who="ddpx", path="native",
                                         hook="fp16_compress_wrapper(powerSGD_hook)", rank=1,
                                         esize=2)
    for v in c.values():
        v.setdefault("rank", None)
        v.setdefault("esize", 4)
    return c


def bucket_settings(args, nparams: int) -> float:
    """The bucket cap in MB; in one-bucket mode also lifts DDP's first-bucket cap (used for the
    rebuilt buckets from the second iteration on) above the model size."""
    if args.bucket_cap_mb == "one":
        cap = math.ceil(nparams * 4 / 2**20) + 1.0
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(cap * 2**20)
        return cap
    return float(args.bucket_cap_mb)


def make_state(name: str, cfg: dict, args, ddpx):
    if cfg["rank"] is None:
        return None
    kw = dict(matrix_approximation_rank=cfg["rank"], start_powerSGD_iter=args.start_iter,
              min_compression_rate=args.min_compression_rate)
    if cfg["who"] == "torch":
        return tpsgd.PowerSGDState(None, **kw)
    return ddpx.hooks.PowerSGDState(None, **kw)


def register(name: str, cfg: dict, ddp: DDP, state, ddpx) -> None:
    H = ddpx.hooks
    if name == "none":
        return
    if name == "torch_allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return
    if name == "ddpx_noop_native":
        ddpx.register_comm_hook(ddp, None, H.noop_hook)
        return
    if cfg["who"] == "torch":
        ddp.register_comm_hook(state, tpsgd.powerSGD_hook)
        return
    hook = {"powerSGD_hook": H.powerSGD_hook, "batched_powerSGD_hook": H.batched_powerSGD_hook,
            "fp16_compress_wrapper(powerSGD_hook)": H.fp16_compress_wrapper(H.powerSGD_hook)
            }[cfg["hook"]]
    bc.register_hook(ddpx, ddp, state, hook, native=cfg["path"] == "native")


def stats_of(state) -> Optional[List[int]]:
    if state is None:
        return None
    _, before, after = state.compression_stats()
    return [int(before), int(after)]


def copy_bandwidth(nbytes: int, device: torch.device, reps: int) -> float:
    """Bytes read + written per second of dst.copy_(src) for an nbytes fp32 tensor."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            dst.copy_(src)
        for _ in range(reps):
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
    else:
        dst.copy_(src)
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / statistics.median(times)


def verify(grads: Dict[str, torch.Tensor], exact: torch.Tensor, cfgs: Dict[str, dict],
           device, world: int) -> dict:
    """Compares the gradients after the first compressed step (CPU copies). Returns {check:
    {ok, detail, enforced}}; a check fails if it fails on any rank."""
    checks = {}

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    def record(check, ok, detail, enforced=True):
        checks[check] = {"ok": bool(ok), "detail": detail, "enforced": enforced}

    for name, g in grads.items():
        cfg = cfgs[name]
        if cfg["who"] != "ddpx" or cfg["rank"] is None or not name.startswith("ddpx_psgd_"):
            continue
        t = f"torch_psgd_r{cfg['rank']}"
        if t in grads:
            d = rel(g, grads[t])
            enforced = cfg["rank"] == 1
            ok = d <= VERIFY_RTOL if enforced else True
            record(f"{name} ~= {t} (rel <= {VERIFY_RTOL:g})" if enforced
                   else f"{name} vs {t} (reported)", ok, f"max|diff|/max|torch| = {d:.3g}",
                   enforced)
    for name in grads:
        if name.endswith("_dropin"):
            other = name[:-len("_dropin")] + "_native"
            if other in grads:
                record(f"{name} == {other} (bitwise)", torch.equal(grads[name], grads[other]),
                       f"max |diff| = {(grads[name] - grads[other]).abs().max().item():.3g}")
    for name, g in grads.items():
        if name == BASELINE:
            continue
        record(f"{name}: distance from the exact mean (reported)", True,
               f"max|g - mean|/max|mean| = {rel(g, exact):.3g}", False)
        if world > 1:
            g0 = g.to(device)
            dist.broadcast(g0, src=0)
            if not torch.equal(g0.cpu(), g):
                record(f"{name}: ranks agree", False, "rank differs from rank 0")
    return bc.combine_checks(checks, device)


def worker(rank: int, args, backend: str, world: int, port: int, out_path: str) -> None:
    device = bc.init_rank(rank, args, backend, world, port)
    import ddpx  # after init: a clear ImportError here names the torch mismatch

    base = bc.build_model(args).to(device)
    nparams = sum(p.numel() for p in base.parameters())
    cap = bucket_settings(args, nparams)
    x, y = bc.make_data(args, rank, device)
    sync = bc.sync_of(device)

    cfgs = config_table(args.ranks)
    names = bc.select_configs(list(cfgs), cfgs, args.configs, keep=BASELINE)

    # Floor: copy bandwidth, measured on rank 0 alone (the other ranks wait).
    copy_bw = None
    if rank == 0:
        copy_bw = copy_bandwidth(nparams * 4, device, args.copy_reps)
    dist.barrier()

    ddps: Dict[str, DDP] = {}
    states = {}
    for name in names:
        ddp = bc.make_ddp(base, device, cap)
        states[name] = make_state(name, cfgs[name], args, ddpx)
        register(name, cfgs[name], ddp, states[name], ddpx)
        ddps[name] = ddp

    # Exact mean gradient (fp64), for the report.
    local = copy.deepcopy(base)
    torch.nn.functional.mse_loss(local(x), y).backward()
    exact = flat_grads(local).double()
    dist.all_reduce(exact)
    exact = (exact / world).cpu()
    del local

    # Untimed: start_iter plain-allreduce steps, the first compressed step (kept for verify()),
    # then --warmup compressed steps.
    first: Dict[str, torch.Tensor] = {}
    for name, ddp in ddps.items():
        dist.barrier()
        for _i in range(args.start_iter + 1):
            ddp.zero_grad(set_to_none=True)
            step(ddp, x, y)
        sync()
        first[name] = flat_grads(ddp.module).cpu()  # on the host: 17 x 1 GB on the GPU model
        for _ in range(args.warmup):
            ddp.zero_grad(set_to_none=True)
            step(ddp, x, y)
        sync()
    buckets = {n: len(s.error_dict) for n, s in states.items()
               if s is not None and cfgs[n]["who"] == "torch"}
    checks = {} if args.no_verify else verify(first, exact, {n: cfgs[n] for n in names}, device,
                                                world)
    del first

    stats0 = {n: stats_of(states[n]) for n in names}
    times, wall = bc.timed_rounds(ddps, names, args, x, y, sync)
    stats1 = {n: stats_of(states[n]) for n in names}

    gathered = bc.gather_times(times, world)
    if rank == 0:
        timed = args.rounds * args.steps
        ring = 2 * (world - 1) / world
        results = {}
        for name in names:
            cfg = cfgs[name]
            if cfg["rank"] is not None:
                before = (stats1[name][0] - stats0[name][0]) / timed
                after = (stats1[name][1] - stats0[name][1]) / timed
            elif name == BASELINE:
                before, after = float(nparams), 0.0
            else:
                before, after = float(nparams), float(nparams)
            payload = after * cfg["esize"]
            results[name] = dict(
                cfg, **bc.step_stats(name, gathered, args),
                numel_before_per_step=before, numel_after_per_step=after,
                compression_rate=(before / after) if after else None,
                payload_bytes_per_step=payload, ring_bytes_sent_per_rank=payload * ring,
            )
        info = bc.run_info(args, backend, world, device, nparams)
        info.update({
            "bucket_cap_mb": cap, "bucket_mode": args.bucket_cap_mb,
            "buckets_per_step": sorted(set(buckets.values())) if buckets else None,
            "start_powerSGD_iter": args.start_iter, "warmup": args.warmup,
            "min_compression_rate": args.min_compression_rate,
            "rounds": args.rounds, "steps": args.steps, "timed_wall_s": wall,
            "copy_bw_gbs": copy_bw / 1e9, "ring_factor": ring,
            "ddpx_commit": os.environ.get("DDPX_COMMIT", ""),
        })
        with open(out_path, "w") as f:
            json.dump({"info": info, "verify": checks, "results": results}, f)
    dist.barrier()
    del ddps, states
    dist.destroy_process_group()


# ---- the race: torch's hook with several buckets, each trial its own job ----------------------

def race_worker(rank: int, args, impl: str, world: int, port: int, steps: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import ddpx
    model = bc.build_model(args)
    x, y = bc.make_data(args, rank)
    ddp = DDP(model, bucket_cap_mb=args.race_bucket_cap_mb)  # DDP's default buckets
    kw = dict(matrix_approximation_rank=1, start_powerSGD_iter=args.start_iter)
    if impl == "torch":
        ddp.register_comm_hook(tpsgd.PowerSGDState(None, **kw), tpsgd.powerSGD_hook)
    else:
        ddpx.register_comm_hook(ddp, ddpx.hooks.PowerSGDState(None, **kw),
                                ddpx.hooks.powerSGD_hook)
    for _ in range(steps):
        ddp.zero_grad(set_to_none=True)
        step(ddp, x, y)
    dist.barrier()
    dist.destroy_process_group()


def race_trial(args, impl: str, world: int) -> str:
    """One job: 'ok', 'abort: ...' or 'hang' (killed after --race-timeout s)."""
    ctx = mp.start_processes(race_worker, args=(args, impl, world, free_port(),
                                                args.start_iter + args.race_steps),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.time() + args.race_timeout
    try:
        while True:
            try:
                if ctx.join(timeout=1):
                    return "ok"
            except mp.ProcessRaisedException as e:
                lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
                return "abort: " + (lines[-1][:160] if lines else "exception")
            except mp.ProcessExitedException as e:
                sig = {-6: " (SIGABRT)", -9: " (SIGKILL)", -11: " (SIGSEGV)"}.get(e.exit_code, "")
                return f"abort: exit code {e.exit_code}{sig}"
            if time.time() > deadline:
                return "hang"
    finally:
        for p in ctx.processes:  # only the processes this trial started
            if p.is_alive():
                p.kill()
                p.join(5)


def race_check(args, world: int) -> dict:
    out = {"trials": args.race_trials, "bucket_cap_mb": args.race_bucket_cap_mb,
           "steps": args.start_iter + args.race_steps, "rank": 1, "timeout_s": args.race_timeout}
    for impl in ("torch", "ddpx"):
        outcomes = []
        t0 = time.perf_counter()
        for i in range(args.race_trials):
            o = race_trial(args, impl, world)
            outcomes.append(o)
            print(f"  race trial {impl} {i + 1}/{args.race_trials}: {o}", flush=True)
        out[impl] = {"outcomes": outcomes, "ok": outcomes.count("ok"),
                     "abort": sum(o.startswith("abort") for o in outcomes),
                     "hang": outcomes.count("hang"), "wall_s": time.perf_counter() - t0}
    return out


def probe_torch_batched(device: str) -> dict:
    """torch's batched_powerSGD_hook on a world-size-1 Gloo group (in this process): one
    compressed step; no peer can hang."""
    port = free_port()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    except Exception as e:  # pragma: no cover
        return {"supported": None, "error": f"could not init a probe group: {e!r}"}
    try:
        torch.manual_seed(0)
        dev = torch.device(device)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 64)).to(dev)
        ddp = DDP(model, device_ids=[0] if dev.type == "cuda" else None)
        state = tpsgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, tpsgd.batched_powerSGD_hook)
        x = torch.randn(8, 64, device=dev)
        for _ in range(4):
            ddp.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
        return {"supported": True, "error": None}
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        where = [ln.strip() for ln in tb if "powerSGD_hook.py" in ln]
        msg = (str(e).strip().splitlines() or [""])[0]
        return {"supported": False, "error": f"{type(e).__name__}: {msg[:200]}",
                "where": where[-1] if where else ""}
    finally:
        dist.destroy_process_group()


# ---- analysis and report ----------------------------------------------------------------------

def analyse(run: dict) -> dict:
    res = run["results"]
    base = res[BASELINE]
    for r in res.values():
        r["overhead_ms"] = r["median_ms"] - base["median_ms"]
        r["overhead_paired_ms"] = bc.paired_median(r["round_medians_ms"],
                                                   base["round_medians_ms"])
    info = run["info"]
    gb = info["params"] * 4
    bw = info["copy_bw_gbs"] * 1e9
    info["floor_ms"] = {"3 passes (P=MQ, Q=M^T P, M=PQ^T)": 3 * gb / bw * 1e3,
                        "7 passes (+ fused error feedback)": 7 * gb / bw * 1e3}
    ratios = []
    for name, r in res.items():
        if r["who"] != "ddpx" or not name.startswith("ddpx_psgd_"):
            continue
        t = f"torch_psgd_r{r['rank']}"
        if t not in res:
            continue
        ot, od = res[t]["overhead_paired_ms"], r["overhead_paired_ms"]
        ratios.append({"torch": t, "ddpx": name, "rank": r["rank"], "path": r["path"],
                       "overhead_torch_ms": ot, "overhead_ddpx_ms": od,
                       "overhead_ratio_ddpx_over_torch": od / ot if ot > 0 else None,
                       "step_ratio_torch_over_ddpx": res[t]["median_ms"] / r["median_ms"]})
    run["ratios"] = ratios
    targets = []
    if info["device"].startswith("cuda"):
        for name, r in res.items():
            if name.startswith("ddpx_psgd_") and r["path"] == "native" and r["rank"] <= 4:
                targets.append({"what": f"{name} overhead <= 2 ms",
                                "value": r["overhead_paired_ms"],
                                "met": r["overhead_paired_ms"] <= 2.0})
    else:
        for e in ratios:
            if e["path"] == "native":
                v = e["overhead_ratio_ddpx_over_torch"]
                targets.append({"what": f"{e['ddpx']} overhead <= 0.5 x {e['torch']}'s",
                                "value": v, "met": v is not None and v <= 0.5})
    run["targets"] = targets
    return run


def mb(v):
    return "-" if v is None else f"{v / 2**20:.2f}"


def rate_of(r: dict) -> str:
    return "-" if r["compression_rate"] is None else f"{r['compression_rate']:.1f}x"


def print_report(run: dict) -> None:
    i = run["info"]
    bc.print_run_header(
        "PowerSGD: ", i,
        f"bucket_cap_mb {i['bucket_cap_mb']:g} "
        f"({'one bucket' if i['bucket_mode'] == 'one' else 'DDP buckets'}; torch's PowerSGD saw "
        f"{i['buckets_per_step']} bucket(s)/step), start_powerSGD_iter "
        f"{i['start_powerSGD_iter']} + {i['warmup']} compressed warm-up steps untimed")
    bc.print_checks("verify (gradients after the first compressed step):", run["verify"])
    bc.print_table(
        ["config", "hook", "path", "rank", "median ms", "p25-p75 ms",
         "paired overhead vs noop (ms)", "elements sent/step", "payload MiB/step",
         "ring MiB sent/rank/step", "compression"], "lllrrrrrrrr",
        ([name, r["hook"], r["path"], str(r["rank"] or "-"), f"{r['median_ms']:.1f}",
          f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}", f"{r['overhead_paired_ms']:.1f}",
          f"{r['numel_after_per_step']:.0f}", mb(r["payload_bytes_per_step"]),
          mb(r["ring_bytes_sent_per_rank"]), rate_of(r)]
         for name, r in run["results"].items()))
    print(f"\npayload = elements after compression (compression_stats, per timed step) x element "
          f"size; ring = payload x 2(W-1)/W = x{i['ring_factor']:.2f}")
    if run["ratios"]:
        print()
        bc.print_table(
            ["rank", "torch", "ddpx", "paired overhead torch / ddpx (ms)", "ddpx/torch overhead",
             "step ratio torch/ddpx"], "rllrrr",
            ([str(e["rank"]), e["torch"], e["ddpx"],
              f"{e['overhead_torch_ms']:.1f} / {e['overhead_ddpx_ms']:.1f}",
              fmt(e["overhead_ratio_ddpx_over_torch"], ".2f"),
              f"{e['step_ratio_torch_over_ddpx']:.2f}"] for e in run["ratios"]))
    print(f"\nmemory-bandwidth floor: copy bandwidth {i['copy_bw_gbs']:.1f} GB/s (read + write, "
          f"{i['grad_mb']:.0f} MB)")
    for k, v in i["floor_ms"].items():
        print(f"  {k}: {v:.2f} ms/step")
    if "loadavg_1m_start_end" in i:
        print(f"\nmachine: 1-minute load average {i['loadavg_1m_start_end'][0]:.1f} at start, "
              f"{i['loadavg_1m_start_end'][1]:.1f} at end ({i['cpu_count']} cores); run took "
              f"{i['total_wall_s']:.0f} s")
    if run["targets"]:
        print("\ntargets:")
        for t in run["targets"]:
            print(f"  [{'met' if t['met'] else 'NOT met'}] {t['what']}: {fmt(t['value'], '.2f')}")
    if run.get("torch_batched"):
        tb = run["torch_batched"]
        print(f"\ntorch batched_powerSGD_hook: "
              f"{'supported' if tb['supported'] else 'UNSUPPORTED'}"
              f"{(' - ' + tb['error'] + ' at ' + tb.get('where', '')) if tb.get('error') else ''}")
    if run.get("race"):
        print_report_race_only(run)
    sys.stdout.flush()


def rng(vals, spec=".1f"):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    return (f"{format(statistics.median(vals), spec)} "
            f"[{format(min(vals), spec)}, {format(max(vals), spec)}]")


def summarize(paths: List[str]) -> None:
    runs = []
    for p in paths:
        with open(p) as f:
            runs += json.load(f)["runs"]
    i = runs[0]["info"]
    n = len(runs)
    print(f"\n#### PowerSGD, {i['backend']} x {i['world_size']} ranks on {i['device']}: "
          f"{i['model']}, batch {i['batch']}/rank, {n} runs (median [min, max] over runs)\n")
    print("| config | rank | step ms | paired overhead vs noop (ms) | payload MiB/step "
          "| ring MiB sent/rank | compression |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r0 in runs[0]["results"].items():
        rs = [run["results"][name] for run in runs if name in run["results"]]
        print(f"| {name} | {r0['rank'] or '-'} | {rng([r['median_ms'] for r in rs])} | "
              f"{rng([r['overhead_paired_ms'] for r in rs])} | {mb(r0['payload_bytes_per_step'])} "
              f"| {mb(r0['ring_bytes_sent_per_rank'])} | {rate_of(r0)} |")
    print("\n| rank | torch | ddpx | overhead torch (ms) | overhead ddpx (ms) "
          "| ddpx/torch overhead | runs with ratio <= 0.5 |")
    print("|---:|---|---|---:|---:|---:|---:|")
    keys = [(e["torch"], e["ddpx"], e["rank"]) for e in runs[0]["ratios"]]
    for t, d, rk in keys:
        es = [e for run in runs for e in run["ratios"] if e["torch"] == t and e["ddpx"] == d]
        rs = [e["overhead_ratio_ddpx_over_torch"] for e in es]
        met = sum(1 for v in rs if v is not None and v <= 0.5)
        print(f"| {rk} | {t} | {d} | {rng([e['overhead_torch_ms'] for e in es])} | "
              f"{rng([e['overhead_ddpx_ms'] for e in es])} | {rng(rs, '.2f')} | {met}/{len(es)} |")
    fl = [run["info"]["floor_ms"] for run in runs]
    print(f"\ncopy bandwidth {rng([run['info']['copy_bw_gbs'] for run in runs])} GB/s; floor "
          + "; ".join(f"{k}: {rng([f[k] for f in fl], '.2f')} ms" for k in fl[0]))
    ver = {}
    for run in runs:
        for c, v in run["verify"].items():
            ver.setdefault(c, []).append(v)
    if ver:
        print("\nverify over runs:")
        for c, vs in ver.items():
            tag = (f"ok {sum(v['ok'] for v in vs)}/{len(vs)}" if vs[0].get("enforced", True)
                   else "info")
            details = list(dict.fromkeys(v["detail"] for v in vs))
            print(f"  [{tag}] {c}: {details[0] if len(details) == 1 else ' | '.join(details)}")


def main(argv=None) -> int:
    p = bc.arg_parser(__doc__)
    p.add_argument("--backend", default=None, help="default gloo (cpu) / nccl (cuda)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (nccl: 1 per GPU, max)")
    bc.add_model_args(p)
    p.add_argument("--ranks", default="1,2,4,32", help="matrix_approximation_rank values")
    p.add_argument("--start-iter", type=int, default=2, help="start_powerSGD_iter")
    p.add_argument("--min-compression-rate", type=float, default=2.0)
    p.add_argument("--bucket-cap-mb", default=None,
                   help="'one' (a single bucket for the whole model, torch's and ddpx's alike) "
                        "or MB; default 'one' on gloo with several ranks (torch's hook races "
                        "there with several buckets), 25 otherwise")
    p.add_argument("--rounds", type=int, default=None, help="default 5 (cpu) / 6 (cuda)")
    p.add_argument("--steps", type=int, default=None, help="steps per config per round; "
                   "default 2 (cpu) / 4 (cuda)")
    p.add_argument("--warmup", type=int, default=1, help="untimed compressed steps per config")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: cpu_count // ranks on cpu)")
    p.add_argument("--configs", default="", help="subset (the ddpx noop baseline is always run)")
    p.add_argument("--copy-reps", type=int, default=None, help="default 7 (cpu) / 20 (cuda)")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the probe of torch's batched_powerSGD_hook")
    p.add_argument("--race-trials", type=int, default=0,
                   help="jobs of torch's (then ddpx's) powerSGD_hook with several buckets, each "
                        "its own spawn, counting aborts and hangs (gloo only)")
    p.add_argument("--race-only", action="store_true", help="only the race check")
    p.add_argument("--race-steps", type=int, default=20, help="compressed steps per race job")
    p.add_argument("--race-timeout", type=float, default=40.0, help="s per race job")
    p.add_argument("--race-bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--json", default="", help="write the raw results (JSON) to this file; "
                   "empty: write none")
    p.add_argument("--summarize", nargs="+", metavar="JSON",
                   help="print median [min, max] over these --json files and exit")
    args = p.parse_args(argv)

    if args.summarize:
        summarize(args.summarize)
        return 0
    cuda = bc.model_defaults(args)
    args.rounds = args.rounds or (6 if cuda else 5)
    args.steps = args.steps or (4 if cuda else 2)
    args.copy_reps = args.copy_reps or (20 if cuda else 7)
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if args.start_iter < 2:
        raise SystemExit("--start-iter must be >= 2 (torch's PowerSGDState requires it with "
                         "error feedback)")
    backend = args.backend or ("nccl" if cuda else "gloo")
    world = bc.world_of(backend, args, cuda)
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = "one" if (backend == "gloo" and world > 1) else "25"
    if args.threads == 0 and not cuda:
        args.threads = max(1, (os.cpu_count() or 1) // world)

    run: dict = {}
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    if not args.race_only:
        run = analyse(bc.spawn_run(worker, args, backend, world))
        if not args.no_probe:
            run["torch_batched"] = probe_torch_batched("cuda:0" if cuda else "cpu")
    if args.race_trials > 0:
        if backend != "gloo" or world < 2:
            print("race check skipped: it needs gloo with several ranks", file=sys.stderr)
        else:
            print(f"race check: {args.race_trials} jobs of torch's powerSGD_hook, then ddpx's, "
                  f"bucket_cap_mb {args.race_bucket_cap_mb:g}", flush=True)
            run["race"] = race_check(args, world)
    if not run:
        return 0
    run.setdefault("info", {})["total_wall_s"] = time.perf_counter() - t0
    run["info"]["loadavg_1m_start_end"] = [load0[0], os.getloadavg()[0]]
    if "results" in run:
        print_report(run)
    elif "race" in run:
        print_report_race_only(run)
    if args.json:
        bc.write_json(args.json, [run])
    return bc.report_failed([run])


def print_report_race_only(run: dict) -> None:
    rc = run["race"]
    print(f"\nrace check ({rc['trials']} jobs each, rank 1, {rc['steps']} steps, bucket_cap_mb "
          f"{rc['bucket_cap_mb']:g}, timeout {rc['timeout_s']} s):")
    for impl in ("torch", "ddpx"):
        d = rc[impl]
        print(f"  {impl} powerSGD_hook: ok {d['ok']}, abort {d['abort']}, hang {d['hang']} "
              f"({d['wall_s']:.0f} s)")
        for o in sorted(set(o for o in d["outcomes"] if o != "ok")):
            print(f"    {o}")


if __name__ == "__main__":
    sys.exit(main())
