#!/usr/bin/env python3
"""C++ training program vs Python: DDP step time of ddpx::ddp::DistributedDataParallel in a libtorch
program (benchmarks/bench_cpp_ddp.cpp) against torch's Python DistributedDataParallel, same model,
hook, optimizer, batch and thread count, 2 Gloo ranks under torchrun, timed per phase:

* forward: ``zero_grad`` + DDP's forward (its per-iteration Reducer set-up) + the loss;
* backward: autograd with the Reducer's hooks and the gradient communication;
* step: SGD with momentum (torch.optim.SGD vs torch::optim::SGD).

A "local" row trains the module alone (no DDP, no communication) on both sides: the cost of
the language around the same ATen work. A "join" row (not in the default list) times uneven
inputs: rank 0 stops after half the timed steps and joins (Python's ``Join([ddp])``, C++'s
``ddp.join(loop)``), and the other ranks' steps of the second half, which the joined rank
shadows, are timed (no barrier there). Both sides use the same C++ hook objects (the Python
side registers ddpx's hooks natively with ``ddpx.register_comm_hook``; "allreduce" is DDP's
default), so what differs is the Python around
them: DDP.forward's Python code, nn.Module.__call__, the optimizer's Python loop.

The two sides cannot share a process (one is a C++ program): each round launches the Python job
and the C++ job once each (alternating which goes first), and the figures are medians over the
rounds of each job's per-step medians.

    python benchmarks/bench_cpp_ddp.py --cpp build/benchmarks/bench_cpp_ddp [--rounds 5]
(ddpx importable: PYTHONPATH=build/python, or a pip install)
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.abspath(__file__)


# ---- the Python worker (one torchrun job) -------------------------------------------------
def worker(args) -> int:
    import torch.distributed as dist
    import torch.distributed.algorithms.join  # noqa: F401  (Join, for the "join" rows)
    import torch.nn as nn

    import ddpx

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for model in args.models.split(","):
        widths = [int(w) for w in model.split("-")]
        for hook in args.hooks.split(","):
            torch.manual_seed(0)
            layers = []
            for i in range(len(widths) - 1):
                if i > 0:
                    layers.append(nn.ReLU())
                layers.append(nn.Linear(widths[i], widths[i + 1]))
            net = nn.Sequential(*layers)
            # "local": the module alone, no DDP and no communication.
            ddp = net if hook == "local" else nn.parallel.DistributedDataParallel(net)
            join = hook == "join"
            if hook == "fp16":
                ddpx.register_comm_hook(ddp, None, ddpx.hooks.fp16_compress_hook)
            elif hook == "powersgd":
                state = ddpx.hooks.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                 start_powerSGD_iter=2)
                ddpx.register_comm_hook(ddp, state, ddpx.hooks.powerSGD_hook)
            elif hook not in ("allreduce", "local", "join"):
                raise SystemExit(f"unknown hook {hook}")
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
            g = torch.Generator().manual_seed(rank + 1)
            x = torch.randn(args.batch, widths[0], generator=g)
            y = torch.randint(widths[-1], (args.batch,), generator=g)
            times = {"total": [], "forward": [], "backward": [], "step": []}
            bar = torch.zeros(1)
            # "join": rank 0 has half the timed steps and joins; the others' second half is
            # timed while it shadows them (no barrier: a joined rank shadows DDP's collectives
            # only).
            half = args.warmup + args.steps // 2
            mine = half if join and rank == 0 else args.warmup + args.steps
            ctx = (torch.distributed.algorithms.join.Join([ddp]) if join
                   else contextlib.nullcontext())
            with ctx:
                for i in range(mine):
                    if not join:
                        dist.all_reduce(bar)  # the same barrier as the C++ side
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(ddp(x), y)
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    opt.step()
                    t3 = time.perf_counter()
                    if i < (half if join else args.warmup):
                        continue
                    for k, v in (("total", t3 - t0), ("forward", t1 - t0),
                                 ("backward", t2 - t1), ("step", t3 - t2)):
                        times[k].append(v * 1e3)
            # join: the ranks that trained on (rank 0 contributes nothing).
            timed = world - 1 if join else world
            med = torch.tensor([statistics.median(times[k]) if times[k] else 0.0 for k in
                                ("total", "forward", "backward", "step")], dtype=torch.float64)
            dist.all_reduce(med)
            med /= timed
            if rank == 0:
                print(json.dumps(dict(side="python", model=model, hook=hook,
                                      total=med[0].item(), forward=med[1].item(),
                                      backward=med[2].item(), step=med[3].item())), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---- the driver ----------------------------------------------------------------------------
def torchrun(program, no_python=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if torch.__version__ < "2":
        cmd += ["--redirects", "1", "--tee", "1"]  # torch 1.13's torchrun on Python 3.11
    if no_python:
        cmd.append("--no-python" if torch.__version__ >= "2" else "--no_python")
    return cmd + program


def launch(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = []
    for line in done.stdout.splitlines():
        line = line.split("]:", 1)[-1].strip()  # torch 1.13's --tee prefix
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpp", help="the built bench_cpp_ddp (driver mode)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--models", default="64-32-10,64-512-512-10")
    p.add_argument("--hooks", default="local,allreduce,fp16,powersgd",
                   help="local = the module without DDP (no communication); join = the default "
                        "allreduce with uneven inputs: rank 0 joins after half the timed steps, "
                        "the other ranks' second half is timed while it shadows them")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the per-round figures there")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not args.cpp:
        p.error("--cpp is required (build/benchmarks/bench_cpp_ddp)")
    common = ["--models", args.models, "--hooks", args.hooks, "--batch", str(args.batch),
              "--steps", str(args.steps), "--warmup", str(args.warmup)]
    jobs = {"python": torchrun([HERE, "--worker"] + common),
            "cpp": torchrun([os.path.abspath(args.cpp)] + common, no_python=True)}
    print(f"bench_cpp_ddp: torch {torch.__version__}, 2 Gloo ranks (torchrun), batch "
          f"{args.batch}/rank, SGD momentum 0.9, {args.steps} timed steps after {args.warmup}, "
          f"{args.rounds} rounds, {os.cpu_count()} cores", flush=True)
    runs = []
    for r in range(args.rounds):
        order = ["python", "cpp"] if r % 2 == 0 else ["cpp", "python"]
        for side in order:
            runs += launch(jobs[side])
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)

    def med(side, model, hook, key):
        return statistics.median(x[key] for x in runs
                                 if (x["side"], x["model"], x["hook"]) == (side, model, hook))

    print()
    print("| model | hook | Python DDP ms/step | C++ DDP ms/step | Python / C++ | "
          "Python fwd / bwd / step | C++ fwd / bwd / step | saved per step |")
    print("|---|---|---:|---:|---:|---|---|---:|")
    for model in args.models.split(","):
        for hook in args.hooks.split(","):
            py = {k: med("python", model, hook, k)
                  for k in ("total", "forward", "backward", "step")}
            cc = {k: med("cpp", model, hook, k) for k in ("total", "forward", "backward", "step")}
            print(f"| {model} | {hook} | {py['total']:.3f} | {cc['total']:.3f} | "
                  f"{py['total'] / cc['total']:.2f}x | "
                  f"{py['forward']:.3f} / {py['backward']:.3f} / {py['step']:.3f} | "
                  f"{cc['forward']:.3f} / {cc['backward']:.3f} / {cc['step']:.3f} | "
                  f"{py['total'] - cc['total']:.3f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
