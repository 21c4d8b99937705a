#!/usr/bin/env python3
"""Parameter averaging (post-local SGD's model averaging step): torch vs ddpx, time and peak
extra memory, on the same parameters in the same process group.

Configurations, all averaging the same list of parameters over the whole group:

  torch_utils         torch.distributed.algorithms.model_averaging.utils.average_parameters
                      (flattens every parameter into one buffer, allreduces it, rebinds p.data
                      to views of that buffer)
  torch_averager      torch's averagers.PeriodicModelAverager.average_parameters at an
                      averaging step (step reset to 0 before each call; period --period)
  ddpx_utils_b{C}     ddpx.model_averaging.average_parameters(params, group, bucket_cap_mb=C),
                      for C in --bucket-cap-mb (in place, bucketed)
  ddpx_averager       ddpx.model_averaging.PeriodicModelAverager(...).average_parameters at an
                      averaging step (bucket_cap_mb 25, the default)

The model (default, >= 50 M fp32 parameters): --layers x (Linear(W, W) + LayerNorm(W)), a
head Linear(W, W/4) and --mid small heads Linear(W, --mid-out), W = --width: big weight
matrices (16 MiB each, which ddpx reduces in their own storage), a medium head weight (4 MiB:
in place at every cap here: ddpx reduces a tensor in place from a quarter bucket or 256 KiB,
whichever is less), 64 small-head weights of 192 KiB (12 MiB together, staged at every cap
here, so they fill several buckets at 1 and 4 MB) and small biases / LayerNorm parameters (staged).
Every parameter has a .grad (zeros) because the averagers skip parameters without one (torch's
get_params_to_average). Each rank starts from its own random values, so the average is not
trivial.

verify() first: from the same starting values, every ddpx configuration and torch's averager
must give torch's utils.average_parameters result (max |ddpx - torch| printed; torch's arithmetic
is divide-then-allreduce, ddpx documents the same, so 0 is expected).

Timing: R rounds (--rounds), each calling every configuration once, the order rotated every
round; each call starts after a barrier; a call's time is the slowest rank's; the figure is the
median over rounds (and the ratio ddpx/torch of the medians; also the median of the per-round
ratios, which cancels drift).

Memory (CPU): the ranks run with MALLOC_MMAP_THRESHOLD_=131072, so every buffer of 128 KiB or
more is mmap'ed and given back to the OS on free; before a call the process's peak RSS is reset
(`echo 5 > /proc/self/clear_refs`) and VmRSS read; after it VmHWM is read: extra = VmHWM -
VmRSS(before), the peak extra resident memory of the call (all of the process: the averaging
code, Gloo's own buffers, Python). Also "retained" = VmRSS(after) - VmRSS(before). torch's
version leaves the parameters as views of its flat buffer; between torch calls every parameter
gets fresh storage again (p.data = p.data.clone(), not timed), so every call starts from the
same memory layout. On CUDA (--device cuda): torch.cuda.reset_peak_memory_stats(), extra =
max_memory_allocated() - memory_allocated(before) (the caching allocator's view; NCCL's own
buffers are not counted).

Usage (CPU, 2 Gloo ranks; ddpx from the CMake build tree). The tables go to stdout; the raw
results (JSON) only with --json (benchmarks/results/ is git-ignored; --json auto names a file
there):
    PYTHONPATH=build/python /usr/bin/python3 benchmarks/bench_averaging.py \\
        --json benchmarks/results/cpu/averaging_run1.json
GPU (NCCL, one rank per GPU; on one GPU: world size 1, or --backend gloo for 2 ranks):
    PYTHONPATH=build-gpu/python python3 benchmarks/bench_averaging.py --device cuda --json ...
Summary over runs (median [min, max]) of the files given:
    python3 benchmarks/bench_averaging.py --summarize benchmarks/results/cpu/averaging_run*.json
"""
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers  # noqa
from torch.distributed.algorithms.model_averaging import utils as torch_ma_utils  # noqa: E402

import bench_common as bc  # noqa: E402

MMAP_THRESHOLD = "131072"


# ---- memory probes --------------------------------------------------------------------------


class CpuMem:
    """Peak extra resident memory of a call (bytes), from /proc/self/{clear_refs,status}."""

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        self.rss0 = bc.status_kib("VmRSS")["VmRSS"] * 1024

    def stop(self) -> Dict[str, int]:
        s = bc.status_kib("VmRSS", "VmHWM")
        return {"extra": s["VmHWM"] * 1024 - self.rss0, "retained": s["VmRSS"] * 1024 - self.rss0,
                "base": self.rss0}


class CudaMem:
    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.a0 = torch.cuda.memory_allocated(self.device)

    def stop(self) -> Dict[str, int]:
        torch.cuda.synchronize(self.device)
        return {"extra": torch.cuda.max_memory_allocated(self.device) - self.a0,
                "retained": torch.cuda.memory_allocated(self.device) - self.a0, "base": self.a0}


# ---- the model ------------------------------------------------------------------------------
def build_params(args, rank: int, device) -> List[torch.nn.Parameter]:
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.LayerNorm(args.width)]
    if args.head:
        layers.append(torch.nn.Linear(args.width, args.head))
    layers += [torch.nn.Linear(args.width, args.mid_out) for _ in range(args.mid)]
    model = torch.nn.ModuleList(layers).to(device)  # parameters only: never run forward
    params = list(model.parameters())
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    with torch.no_grad():
        for p in params:  # per-rank values: the average is not trivial
            p.copy_(torch.randn(p.shape, generator=gen, device=device))
            if args.noncontiguous and p.dim() == 2:  # same shape and values, transposed strides
                p.data = p.data.t().contiguous().t()
            p.grad = torch.zeros_like(p)
    return params


def set_values(params, values) -> None:
    """Fresh storage for every parameter, holding `values` (also undoes torch's rebinding)."""
    for p, v in zip(params, values):
        p.data = v.clone()  # clone keeps v's strides


# ---- the configurations ---------------------------------------------------------------------
def make_configs(args, params, group, ddpx) -> Dict[str, dict]:
    """name -> {fn, torch(bool), desc, stats()}"""
    cfgs: Dict[str, dict] = {}
    cfgs["torch_utils"] = dict(
        fn=lambda: torch_ma_utils.average_parameters(params, group), torch=True,
        desc="torch model_averaging.utils.average_parameters")
    t_avg = torch_averagers.PeriodicModelAverager(period=args.period, warmup_steps=0,
                                                  process_group=group)

    def torch_averager():
        t_avg.step = 0  # an averaging step
        t_avg.average_parameters(params)
    cfgs["torch_averager"] = dict(fn=torch_averager, torch=True,
                                  desc=f"torch PeriodicModelAverager(period={args.period})"
                                       ".average_parameters")
    if ddpx is None:
        return cfgs
    ma = ddpx.model_averaging
    for cap in args.caps:
        cfgs[f"ddpx_utils_b{cap:g}"] = dict(
            fn=(lambda cap=cap: ma.average_parameters(params, group, bucket_cap_mb=cap)),
            torch=False, desc=f"ddpx model_averaging.average_parameters(bucket_cap_mb={cap:g})")
    d_avg = ma.PeriodicModelAverager(period=args.period, warmup_steps=0, process_group=group)

    def ddpx_averager():
        d_avg.step = 0
        d_avg.average_parameters(params)
    cfgs["ddpx_averager"] = dict(fn=ddpx_averager, torch=False,
                                 desc=f"ddpx PeriodicModelAverager(period={args.period})"
                                      ".average_parameters (bucket_cap_mb 25)",
                                 stats=lambda: dict(d_avg.last_stats))
    return cfgs


def verify(cfgs, params, init, sync) -> Dict[str, dict]:
    """Every config from the same start must give torch_utils' result."""
    set_values(params, init)
    cfgs["torch_utils"]["fn"]()
    sync()
    ref = [p.detach().clone() for p in params]
    out = {}
    for name, c in cfgs.items():
        if name == "torch_utils":
            continue
        set_values(params, init)
        ret = c["fn"]()
        sync()
        diff = max(float((p.detach() - r).abs().max()) for p, r in zip(params, ref))
        ident = all(torch.equal(p.detach(), r) for p, r in zip(params, ref))
        out[name] = {"max_abs_diff": diff, "bit_identical": ident, "ok": diff <= 1e-6}
        if isinstance(ret, dict):
            out[name]["returned"] = ret
        if "stats" in c:
            out[name]["last_stats"] = c["stats"]()
    # the reference itself: did the ranks end equal? (max over ranks of |rank value - rank 0's|)
    flat = torch.cat([r.reshape(-1) for r in ref])
    r0 = flat.clone()
    dist.broadcast(r0, 0)
    spread = (flat - r0).abs().max().reshape(1)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    out["torch_utils"] = {"max_abs_diff": 0.0, "bit_identical": True,
                          "ok": float(spread) == 0.0, "rank_spread": float(spread)}
    del ref, flat, r0
    set_values(params, init)
    return out


def worker(rank: int, args, backend: str, world: int, port: int, out_path: str) -> None:
    try:
        _worker(rank, args, backend, world, port, out_path)
    except Exception:
        traceback.print_exc()
        raise


def _worker(rank, args, backend, world, port, out_path):
    device = bc.init_rank(rank, args, backend, world, port)
    try:
        import ddpx  # noqa: F401
        ddpx_err = None if hasattr(ddpx, "model_averaging") else "ddpx has no model_averaging"
        if ddpx_err:
            ddpx = None
    except ImportError as exc:
        ddpx, ddpx_err = None, f"import ddpx: {exc}"
    if args.torch_only:
        ddpx, ddpx_err = None, "--torch-only"
    group = dist.group.WORLD
    sync = bc.sync_of(device)
    mem = CudaMem(device) if device.type == "cuda" else CpuMem()
    params = build_params(args, rank, device)
    init = [p.detach().clone() for p in params]  # clone keeps the (transposed) strides
    init_layout = [not p.is_contiguous() for p in params]
    nparams = sum(p.numel() for p in params)
    cfgs = make_configs(args, params, group, ddpx)
    names = [n for n in cfgs if not args.configs or n in args.configs.split(",")]
    checks = {} if args.no_verify else bc.combine_checks(verify(cfgs, params, init, sync), device)
    del init
    gc.collect()

    times: Dict[str, List[float]] = {n: [] for n in names}
    mems: Dict[str, List[Dict[str, int]]] = {n: [] for n in names}
    t_start = time.perf_counter()
    for r in range(args.rounds + args.warmup):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            c = cfgs[name]
            gc.collect()
            sync()
            dist.barrier()
            mem.start()
            t0 = time.perf_counter()
            c["fn"]()
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            m = mem.stop()
            if c["torch"]:  # fresh storage per parameter again (torch left views of its buffer)
                for p, layout in zip(params, init_layout):
                    p.data = (p.data.t().contiguous().t() if layout else p.data.clone())
            if r >= args.warmup:
                times[name].append(dt)
                mems[name].append(m)
    wall = time.perf_counter() - t_start

    gathered = [None] * world
    dist.all_gather_object(gathered, {"times": times, "mems": mems})
    if rank == 0:
        results = {}
        for name in names:
            per_call = [max(g["times"][name][i] for g in gathered) for i in range(args.rounds)]
            extra = [max(g["mems"][name][i]["extra"] for g in gathered)
                     for i in range(args.rounds)]
            retained = [max(g["mems"][name][i]["retained"] for g in gathered)
                        for i in range(args.rounds)]
            results[name] = {
                "desc": cfgs[name]["desc"], "median_ms": statistics.median(per_call),
                "min_ms": min(per_call), "max_ms": max(per_call), "ms": per_call,
                "extra_bytes_median": statistics.median(extra), "extra_bytes_max": max(extra),
                "retained_bytes_median": statistics.median(retained),
                "rank_median_ms": [statistics.median(g["times"][name]) for g in gathered],
            }
        ratios = []
        for d, t in (("ddpx_utils_b25", "torch_utils"), ("ddpx_averager", "torch_averager")) + \
                tuple((f"ddpx_utils_b{c:g}", "torch_utils") for c in args.caps if c != 25):
            if d in results and t in results:
                per_round = [a / b for a, b in zip(results[d]["ms"], results[t]["ms"])]
                ratios.append({"ddpx": d, "torch": t,
                               "ratio_of_medians": results[d]["median_ms"] /
                               results[t]["median_ms"],
                               "median_round_ratio": statistics.median(per_round),
                               "extra_mem_ratio": (results[d]["extra_bytes_median"] /
                                                   max(1, results[t]["extra_bytes_median"]))})
        info = {
            "backend": backend, "world_size": world, "device": str(device),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else bc.platform.processor() or bc.platform.machine()),
            "torch": torch.__version__, "python": bc.platform.python_version(),
            "threads_per_rank": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "model": f"{args.layers} x (Linear({args.width},{args.width}) + LayerNorm"
                     f"({args.width}))" + (f" + Linear({args.width},{args.head})"
                                           if args.head else "")
                     + (f" + {args.mid} x Linear({args.width},{args.mid_out})"
                        if args.mid else ""),
            "params": nparams, "param_bytes": nparams * 4, "tensors": len(params),
            "noncontiguous_tensors": sum(not p.is_contiguous() for p in params),
            "rounds": args.rounds, "warmup_rounds": args.warmup, "period": args.period,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "memory_probe": ("cuda max_memory_allocated" if device.type == "cuda"
                             else "/proc VmHWM - VmRSS after clear_refs 5"),
            "ddpx": (None if ddpx is None else os.path.dirname(ddpx.__file__)),
            "ddpx_missing": ddpx_err, "wall_s": wall,
            "date_utc": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M:%S"),
            "loadavg": os.getloadavg(),
        }
        with open(out_path, "w") as f:
            json.dump({"info": info, "results": results, "ratios": ratios, "verify": checks}, f)
    dist.barrier()
    dist.destroy_process_group()


# ---- output ---------------------------------------------------------------------------------
def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def render(run: dict) -> str:
    i = run["info"]
    lines = [f"#### averaging, {i['backend']} x {i['world_size']} ranks on {i['device']}: "
             f"{i['model']} = {i['params']:,} params ({mib(i['param_bytes'])} MiB fp32, "
             f"{i['tensors']} tensors"
             + (f", {i['noncontiguous_tensors']} of them non-contiguous"
                if i.get("noncontiguous_tensors") else "") + f"), {i['rounds']} rounds", "",
             "| config | what | median ms | min-max ms | peak extra MiB (median) | max | "
             "retained MiB |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, r in run["results"].items():
        lines.append(f"| {name} | {r['desc']} | {r['median_ms']:.1f} | {r['min_ms']:.1f}-"
                     f"{r['max_ms']:.1f} | {mib(r['extra_bytes_median'])} | "
                     f"{mib(r['extra_bytes_max'])} | {mib(r['retained_bytes_median'])} |")
    if run["ratios"]:
        lines += ["", "| ddpx | torch | time ratio (medians) | median per-round ratio | "
                  "extra memory ratio |", "|---|---|---:|---:|---:|"]
        for e in run["ratios"]:
            lines.append(f"| {e['ddpx']} | {e['torch']} | {e['ratio_of_medians']:.3f} | "
                         f"{e['median_round_ratio']:.3f} | {e['extra_mem_ratio']:.3f} |")
    if run["verify"]:
        lines += ["", "verify (same start, compared with torch_utils' result): " + ", ".join(
            f"{n} {'ok' if v['ok'] else 'FAILED'} (max abs diff {v['max_abs_diff']:.3g}"
            f"{', bit-identical' if v.get('bit_identical') else ''})"
            for n, v in run["verify"].items())]
        st = [(n, v.get("returned") or v.get("last_stats")) for n, v in run["verify"].items()
              if v.get("returned") or v.get("last_stats")]
        for n, s in st:
            lines.append(f"{n} stats: {s}")
    if i.get("ddpx_missing"):
        lines.append(f"ddpx configs not run: {i['ddpx_missing']}")
    lines.append(f"(wall {i['wall_s']:.0f} s, {i['date_utc']} UTC, load average "
                 f"{', '.join(f'{x:.1f}' for x in i['loadavg'])})")
    return "\n".join(lines) + "\n"


def summarize(paths: List[str]) -> str:
    runs = []
    for p in paths:
        with open(p) as f:
            runs += json.load(f)["runs"]
    rng = lambda v, s=".1f": (f"{format(statistics.median(v), s)} "  # noqa: E731
                              f"[{format(min(v), s)}, {format(max(v), s)}]")
    i = runs[0]["info"]
    names = list(runs[0]["results"])
    lines = [f"#### averaging, {i['backend']} x {i['world_size']} ranks on {i['device']}: "
             f"{i['model']} = {i['params']:,} params ({mib(i['param_bytes'])} MiB"
             + (f", {i['noncontiguous_tensors']} tensors non-contiguous"
                if i.get("noncontiguous_tensors") else "")
             + f"), {len(runs)} runs (median [min, max] over runs of each run's median)", "",
             "| config | ms per call | peak extra MiB | retained MiB |", "|---|---:|---:|---:|"]
    for n in names:
        rs = [r["results"][n] for r in runs if n in r["results"]]
        lines.append(f"| {n} | {rng([r['median_ms'] for r in rs])} | "
                     f"{rng([r['extra_bytes_median'] / 2**20 for r in rs])} | "
                     f"{rng([r['retained_bytes_median'] / 2**20 for r in rs])} |")
    keys = [(e["ddpx"], e["torch"]) for e in runs[0]["ratios"]]
    if keys:
        lines += ["", "| ddpx / torch | time (ratio of medians) | median per-round ratio | "
                  "peak extra memory |", "|---|---:|---:|---:|"]
        for d, t in keys:
            es = [e for r in runs for e in r["ratios"] if (e["ddpx"], e["torch"]) == (d, t)]
            lines.append(f"| {d} / {t} | {rng([e['ratio_of_medians'] for e in es], '.3f')} | "
                         f"{rng([e['median_round_ratio'] for e in es], '.3f')} | "
                         f"{rng([e['extra_mem_ratio'] for e in es], '.3f')} |")
    diffs = {}
    for r in runs:
        for n, v in r["verify"].items():
            diffs.setdefault(n, []).append(v["max_abs_diff"])
    if diffs:
        lines += ["", "verify, max |x - torch_utils| over runs: " + ", ".join(
            f"{n} {max(v):.3g}" for n, v in diffs.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = bc.arg_parser(__doc__)
    p.add_argument("--backend", default=None, help="default gloo (cpu) / nccl (cuda)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (nccl: 1 per GPU)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--head", type=int, default=None, help="head Linear(W, H); default W/4, 0: none")
    p.add_argument("--mid", type=int, default=64, help="number of small heads Linear(W, --mid-out)")
    p.add_argument("--mid-out", type=int, default=24)
    p.add_argument("--noncontiguous", action="store_true", help="store every 2-D weight "
                   "transposed (same shape and values, non-contiguous)")
    p.add_argument("--period", type=int, default=4, help="the averagers' period")
    p.add_argument("--bucket-cap-mb", default="1,4,25", help="ddpx bucket caps (comma-separated)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: default)")
    p.add_argument("--configs", default="", help="subset of the config names")
    p.add_argument("--torch-only", action="store_true", help="skip the ddpx configs")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--json", default="", help="write the raw results (JSON) to this file; "
                   "auto: benchmarks/results/<cpu|gpu>/averaging_<UTC date-time>.json "
                   "(git-ignored); empty: write none")
    p.add_argument("--summarize", nargs="+", metavar="JSON")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    args.head = args.width // 4 if args.head is None else args.head
    args.caps = [float(c) for c in args.bucket_cap_mb.split(",") if c]
    if 25.0 not in args.caps:
        args.caps.append(25.0)
    if not args.torch_only:  # fail here, not with a table of torch's rows only
        try:
            import ddpx
            ddpx.model_averaging  # noqa: B018
        except (ImportError, AttributeError) as exc:
            raise SystemExit(f"cannot use ddpx.model_averaging ({exc}); --torch-only runs "
                             "torch's configurations alone") from None
    backend = args.backend or ("nccl" if cuda else "gloo")
    world = bc.world_of(backend, args, cuda)
    # Read by glibc at start-up: the spawned ranks inherit it.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    run = bc.spawn_run(worker, args, backend, world)
    print(render(run))
    if args.json:
        path = args.json
        if path == "auto":
            here = os.path.dirname(os.path.abspath(__file__))
            path = os.path.join(here, "results", "gpu" if cuda else "cpu", "averaging_" +
                                datetime.datetime.utcnow().strftime("%Y-%m-%d_%H%M%S") + ".json")
        bc.write_json(path, [run])
        print(f"wrote {path}")
    return bc.report_failed([run])


if __name__ == "__main__":
    sys.exit(main())
