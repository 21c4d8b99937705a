#!/usr/bin/env python3
"""ddpx's functional optimizers against torch.optim on the same parameters and gradients.

  SGD   torch.optim.SGD(momentum=0.9)           vs  ddpx._C.FunctionalSGD(momentum=0.9)
  Adam  torch.optim.Adam()                      vs  ddpx._C.FunctionalAdam()
  AdamW torch.optim.AdamW() (weight_decay 1e-2)  vs  ddpx._C.FunctionalAdam(decoupled_weight_decay)
  Adagrad torch.optim.Adagrad()                 vs  ddpx._C.FunctionalAdagrad()
  RMSprop torch.optim.RMSprop(momentum=0.9, centered=True)  vs  ddpx._C.FunctionalRMSprop(same)
  Adadelta, Adamax, RAdam, Rprop (torch's defaults)  vs  ddpx._C.FunctionalAdadelta / ... (the
                                                    elementwise optimizers' generic kernels)

torch runs twice: its default implementation (foreach=None: the single-tensor loop on CPU) and
foreach=True. One step of --mparams Mi fp32 parameters (fractions allowed) split into --tensors
tensors. Each optimizer first takes one step (so state exists), then the variants run
interleaved step by step, --reps times; reported: median wall time per step and median CPU time,
and torch/ddpx.
verify(): after the timed steps (same gradients, same number of steps), ddpx's parameters equal
torch's default implementation's within 1e-6 relative.

Usage:
    PYTHONPATH=build/python .venv/bin/python benchmarks/bench_functional_optim.py \\
        --json benchmarks/results/functional_optim.json
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

import ddpx

C = ddpx._C


def make(name: str, params: List[torch.Tensor], impl: str):
    kw = {"SGD": dict(lr=0.01, momentum=0.9), "Adam": dict(lr=1e-3),
          "AdamW": dict(lr=1e-3, weight_decay=1e-2), "Adagrad": dict(lr=1e-2),
          "RMSprop": dict(lr=1e-2, momentum=0.9, centered=True), "Adadelta": {}, "Adamax": {},
          "RAdam": {}, "Rprop": {}}[name]
    if impl == "ddpx":
        if name in ("Adam", "AdamW"):
            return C.FunctionalAdam(params, decoupled_weight_decay=name == "AdamW", **kw)
        return getattr(C, "Functional" + name)(params, **kw)
    if impl == "torch-foreach":
        kw["foreach"] = True
    return getattr(torch.optim, name)(params, **kw)


def run(name: str, args) -> dict:
    n_total = int(args.mparams * 2**20)
    sizes = [n_total // args.tensors] * args.tensors
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) for n in sizes]
    impls = ["torch", "torch-foreach", "ddpx"]
    params = {k: [p.clone().requires_grad_(k != "ddpx") for p in base] for k in impls}
    for k in impls:
        if k != "ddpx":
            for p, x in zip(params[k], grads):
                p.grad = x
    opts = {k: make(name, params[k], k) for k in impls}
    steps: Dict[str, Callable[[], None]] = {
        k: (lambda o=opts[k]: o.step(grads)) if k == "ddpx" else (lambda o=opts[k]: o.step())
        for k in impls}
    wall: Dict[str, List[float]] = {k: [] for k in impls}
    cpu: Dict[str, List[float]] = {k: [] for k in impls}
    with torch.no_grad():
        for k in impls:
            steps[k]()  # creates the state
        for _ in range(args.reps):
            for k in impls:
                c0, t0 = time.process_time(), time.perf_counter()
                steps[k]()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    err = max(((a - b.detach()).abs().max() / b.detach().abs().max()).item()
              for a, b in zip(params["ddpx"], params["torch"]))
    return {"optimizer": name, "params": n_total, "tensors": args.tensors, "wall_s": med,
            "cpu_s": med_cpu, "verify": {"parity": {"ok": err <= 1e-6,
                                                    "detail": f"max rel err {err:.2g}"}}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mparams", type=float, default=16, help="Mi fp32 parameters in all")
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--optims", default="SGD,Adam,AdamW,Adagrad,RMSprop")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default="", help="write the raw results (JSON) to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [run(name, args) for name in args.optims.split(",")]
    print(f"\n### functional optimizers, {args.mparams}Mi fp32 params in {args.tensors} tensors, "
          f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), median of {args.reps} steps\n")
    print("| optimizer | torch default ms | torch foreach ms | ddpx ms | default/ddpx "
          "| foreach/ddpx | CPU-time default/ddpx | verify |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        w, c = r["wall_s"], r["cpu_s"]
        v = r["verify"]["parity"]
        print(f"| {r['optimizer']} | {w['torch'] * 1e3:.1f} | {w['torch-foreach'] * 1e3:.1f} | "
              f"{w['ddpx'] * 1e3:.1f} | {w['torch'] / w['ddpx']:.2f} | "
              f"{w['torch-foreach'] / w['ddpx']:.2f} | {c['torch'] / c['ddpx']:.2f} | "
              f"{'ok' if v['ok'] else 'FAIL'} ({v['detail']}) |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "runs": runs}, f, indent=1)
    return 0 if all(r["verify"]["parity"]["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
