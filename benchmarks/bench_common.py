"""Pieces shared by bench_hooks.py and bench_powersgd.py: rank setup and launch, the model and
data, interleaved timing rounds, per-step statistics, paired overheads and output helpers.

Both scripts put their own directory on sys.path (they run as `python benchmarks/...py`), so
`import bench_common` works in the spawned ranks too.
"""
import argparse
import copy
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    act = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU}[args.activation]
    layers: List[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), act()]
    return torch.nn.Sequential(*layers)


def make_data(args, rank: int, device=None):
    """The rank's (x, y): the same for every configuration of a run."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).float() for p in model.parameters()])


def step(ddp: DDP, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()


def init_rank(rank: int, args, backend: str, world: int, port: int) -> torch.device:
    """Threads, device and process group of one spawned rank; returns its device."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(0 if backend == "gloo" else rank)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world)
    return device


def select_configs(names: List[str], known, configs: str, keep: str = "") -> List[str]:
    """names filtered by the comma-separated --configs (all when empty); `keep` always stays."""
    if not configs:
        return names
    wanted = configs.split(",")
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(known)}")
    return [n for n in names if n in wanted or n == keep]


def make_ddp(base: torch.nn.Module, device: torch.device, bucket_cap_mb: float) -> DDP:
    """A DDP instance over a copy of base (same initial weights for every configuration)."""
    kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    return DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, **kw)


def sync_of(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def timed_rounds(ddps: Dict[str, DDP], names: List[str], args, x, y, sync):
    """R rounds x K steps of each config, the order rotated every round. Returns ({name: [ms
    per step]}, wall seconds)."""
    times: Dict[str, List[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            ddp = ddps[name]
            dist.barrier()  # a noop config lets ranks drift apart: start each block together
            sync()
            for _ in range(args.steps):
                ddp.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                step(ddp, x, y)
                sync()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times, time.perf_counter() - t_start


def gather_times(times: Dict[str, List[float]], world: int) -> List[Dict[str, List[float]]]:
    gathered: List[Dict[str, List[float]]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, times)
    return gathered


def step_stats(name: str, gathered: List[Dict[str, List[float]]], args) -> dict:
    """The job's step time (slowest rank per step): median, quartiles, per-round medians, and
    each rank's own median."""
    n = len(gathered[0][name])
    per_step = [max(ts[name][i] for ts in gathered) for i in range(n)]
    q = statistics.quantiles(per_step, n=4) if len(per_step) >= 2 else [per_step[0]] * 3
    return {
        "median_ms": statistics.median(per_step), "p25_ms": q[0], "p75_ms": q[2],
        "steps": len(per_step),
        "round_medians_ms": [statistics.median(per_step[k * args.steps:(k + 1) * args.steps])
                             for k in range(args.rounds)],
        "rank_medians_ms": [statistics.median(ts[name]) for ts in gathered],
    }


def run_info(args, backend: str, world: int, device: torch.device, nparams: int) -> dict:
    """The run description both scripts record (each adds its own fields)."""
    return {
        "backend": backend, "world_size": world, "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch": torch.__version__, "python": platform.python_version(),
        "threads_per_rank": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "model": f"{args.layers} x Linear({args.width},{args.width})+{args.activation}",
        "params": nparams, "grad_mb": nparams * 4 / 2**20, "batch": args.batch,
    }


def combine_checks(checks: dict, device) -> dict:
    """A check fails if it fails on any rank (NCCL reduces device tensors only)."""
    flags = torch.tensor([0.0 if c["ok"] else 1.0 for c in checks.values()],
                         dtype=torch.float64, device=device)
    dist.all_reduce(flags)
    for c, f in zip(checks.values(), flags.tolist()):
        c["ok"] = f == 0.0
    return checks


def paired_median(a_rounds: List[float], b_rounds: List[float]) -> float:
    """Median over rounds of (a's round median - b's round median): cancels slow drift."""
    return statistics.median(a - b for a, b in zip(a_rounds, b_rounds))


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def print_run_header(title: str, i: dict, settings: str) -> None:
    """A run's heading and set-up line, from run_info()'s fields (plus rounds and steps) and the
    script's own settings."""
    print(f"\n### {title}{i['backend']} x {i['world_size']} ranks on {i['device']} "
          f"({i['device_name']}), torch {i['torch']}\n")
    print(f"model {i['model']}, {i['params'] / 1e6:.1f}M params ({i['grad_mb']:.0f} MB fp32 "
          f"grads), batch {i['batch']}/rank, {settings}, {i['threads_per_rank']} thread(s)/rank, "
          f"{i['rounds']} rounds x {i['steps']} steps; step = forward+backward; time = slowest "
          f"rank per step, median over steps\n")


def print_table(header: List[str], align: str, rows) -> None:
    """A Markdown table: the header's cells, one alignment letter per column ('l' or 'r'), and
    rows of cells (strings)."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_checks(title: str, checks: dict) -> None:
    """verify()'s checks, one line each: [ok], [FAIL], or [info] for a check not enforced."""
    if not checks:
        return
    print(title)
    for check, c in checks.items():
        tag = ("ok" if c["ok"] else "FAIL") if c.get("enforced", True) else "info"
        print(f"  [{tag}] {check}: {c['detail']}")
    print()


def register_hook(ddpx, ddp: DDP, state, hook, native: bool) -> None:
    """A ddpx hook on ddp: natively (ddpx.register_comm_hook) or drop-in."""
    if native:
        ddpx.register_comm_hook(ddp, state, hook)
    else:
        ddp.register_comm_hook(state, hook)


# ---- the launching process -------------------------------------------------------------------

def arg_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph, defaults in --help, --device."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return p


def add_model_args(p) -> None:
    p.add_argument("--layers", type=int, default=None, help="default 8 (cpu) / 16 (cuda)")
    p.add_argument("--width", type=int, default=None, help="default 1024 (cpu) / 4096 (cuda)")
    p.add_argument("--batch", type=int, default=None, help="per rank; default 4 (cpu) / 512 (cuda)")
    p.add_argument("--activation", choices=["relu", "gelu"], default=None,
                   help="default relu (cpu) / gelu (cuda)")


def model_defaults(args) -> bool:
    """Checks --device cuda and fills the model's device-dependent defaults; returns cuda."""
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    args.layers = args.layers or (16 if cuda else 8)
    args.width = args.width or (4096 if cuda else 1024)
    args.batch = args.batch or (512 if cuda else 4)
    args.activation = args.activation or ("gelu" if cuda else "relu")
    return cuda


def world_of(backend: str, args, cuda: bool) -> int:
    if backend == "nccl":
        if not cuda:
            raise SystemExit("nccl needs --device cuda")
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
        return max(1, min(args.world_size, torch.cuda.device_count()))
    return args.world_size


def spawn_run(worker, args, backend: str, world: int) -> dict:
    """Runs worker(rank, args, backend, world, port, out_path) on `world` ranks; returns what
    rank 0 wrote to out_path."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(worker, args=(args, backend, world, free_port(), out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def write_json(path: str, runs: List[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"argv": sys.argv, "runs": runs}, f, indent=1)


def report_failed(runs: List[dict]) -> int:
    failed = [c for run in runs for c, v in run.get("verify", {}).items() if not v["ok"]]
    if failed:
        print(f"\nverify FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


def status_kib(*keys: str) -> Dict[str, int]:
    """Fields of /proc/self/status in KiB (e.g. "VmRSS", "VmHWM"): the memory probes of
    bench_averaging.py and bench_zero.py."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out
