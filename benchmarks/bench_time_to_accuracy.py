#!/usr/bin/env python3
"""Time to accuracy across machines: how long each hook takes to train the digits task to the
accuracy that DDP's default allreduce reaches, over a rate-limited link between namespace nodes.

    sudo .venv/bin/python benchmarks/bench_time_to_accuracy.py --out out/bench_tta
    sudo .venv/bin/python benchmarks/bench_time_to_accuracy.py --rate 1gbit --nodes 2 --epochs 8

A step-time benchmark (bench_network.py) says how much faster a compressed step is; this one
says whether the speed survives the loss of information: the hooks that compress send fewer
bytes, but may need more steps to reach the same accuracy, or never reach it.

One torchrun job on a fresh cluster of network namespaces (scripts/multinode.py; one Gloo rank
per node, one intra-op thread per rank, every link limited with tc tbf). In the job every hook
trains the same MLP (64 -> hidden -> hidden -> 10, 4.3M parameters at hidden=2048) from the same
weights on sklearn's real `digits` (a fixed stratified 80/20 split, the same shard of the same
permutation per rank and epoch), with SGD and momentum. Every `--eval-every` steps the ranks
stop the clock and score the test set (rank 0's replica: after DDP's averaged gradients every
replica is equal; PowerSGD and the 16-bit hooks keep them equal too). Per hook: the wall time
of the training steps alone (evaluation excluded), the accuracy at each evaluation, the bytes
each rank put on the wire (its interface counter, /proc/net/dev in its namespace), and the time
at which the test accuracy first reaches allreduce's final accuracy (the target); a hook that
never reaches it reports its best accuracy instead.

Outputs: <out>/bench_tta.json (every curve), <out>/bench_tta.md (the table) and
<out>/bench_tta.png (test accuracy against wall time per hook). Needs root and iproute2 (the
harness says what is missing); not part of the test suite.
"""
import argparse
import datetime
import json
import os
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, HERE)

import bench_network  # noqa: E402  (its hooks' registration and its counter reader)

# allreduce first: its final accuracy is every other hook's target.
HOOKS = ["allreduce", "torch_fp16", "ddpx_fp16", "torch_powersgd4_1bucket", "ddpx_powersgd4",
         "ddpx_powersgd1"]


def make_model(hidden: int, seed: int):
    import torch
    import torch.nn as nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.job_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    from train_digits import load_digits_split  # the main job's split and scaling
    x_tr, y_tr, x_te, y_te = load_digits_split(args.seed)
    per_rank = len(x_tr) // world
    steps_per_epoch = per_rank // args.batch_size
    results = []
    for hook in args.hooks.split(","):
        model = make_model(args.hidden, args.seed)
        ddp = bench_network.register(hook, model, psgd_start=args.powersgd_start)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        curve: List[List[float]] = []  # [step, seconds of training so far, test accuracy]
        trained_s, step = 0.0, 0
        dist.barrier()
        sent0 = bench_network.tx_bytes(ifname)
        for epoch in range(args.epochs):
            order = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(epoch))
            mine = order[rank * per_rank:(rank + 1) * per_rank]
            for b in range(steps_per_epoch):
                idx = mine[b * args.batch_size:(b + 1) * args.batch_size]
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x_tr[idx]), y_tr[idx]).backward()
                opt.step()
                trained_s += time.perf_counter() - t0
                step += 1
                last = epoch == args.epochs - 1 and b == steps_per_epoch - 1
                if step % args.eval_every == 0 or last:
                    with torch.no_grad():
                        acc = float((model(x_te).argmax(1) == y_te).float().mean())
                    curve.append([step, trained_s, acc])
                    # The next step starts on every rank at once, as it did before the pause.
                    dist.barrier()
        sent = (bench_network.tx_bytes(ifname) - sent0) / step
        row = dict(hook=hook, steps=step, seconds=trained_s, curve=curve, sent=sent,
                   final_accuracy=curve[-1][2])
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, row)
        if rank == 0:
            row["sent"] = sum(g["sent"] for g in gathered) / world
            # The replicas must agree (their accuracy): a hook that lets them drift would score
            # rank 0's model only.
            row["replicas_agree"] = all(g["final_accuracy"] == row["final_accuracy"]
                                        for g in gathered)
            results.append(row)
            print(f"bench_tta: {hook}: {trained_s:.1f} s for {step} steps, final accuracy "
                  f"{row['final_accuracy']:.4f}, {row['sent'] / 1e6:.2f} MB/step", flush=True)
        del ddp, opt
    if rank == 0:
        print("BENCH_RESULT " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def time_to(curve: List[List[float]], target: float):
    """(seconds, step) of the first evaluation at or above `target`, or None."""
    for step, seconds, acc in curve:
        if acc >= target:
            return seconds, int(step)
    return None


def _rate_words(rate: str) -> str:
    """tc's form in words: 1gbit -> 1 Gbit/s, 500mbit -> 0.5 Gbit/s."""
    for suffix, scale in (("gbit", 1.0), ("mbit", 1e-3)):
        if rate.endswith(suffix):
            return f"{float(rate[:-len(suffix)]) * scale:g} Gbit/s"
    return rate


def render(meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    base = next((r for r in rows if r["hook"] == "allreduce"), None)
    if base is None:
        return "no allreduce row: no target\n"
    target = base["final_accuracy"]
    t_base = time_to(base["curve"], target)
    lines = [f"### digits, MLP 64-{meta['hidden']}-{meta['hidden']}-10 "
             f"({meta['params'] / 1e6:.1f}M parameters), {meta['nodes']} nodes, "
             f"{_rate_words(meta['rate'])}",
             "", f"target: allreduce's final test accuracy, {target:.4f}; time = the training "
             "steps' wall time (evaluation excluded); MB/step = what each rank's interface sent, "
             "over the whole run (PowerSGD's uncompressed first steps included)", "",
             "| hook | time to target (s) | steps to target | speed-up | final accuracy | "
             "total (s) | MB/step |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hit = time_to(r["curve"], target)
        label = bench_network.LABELS.get(r["hook"], r["hook"])
        if hit is None:
            best = max(a for _, _, a in r["curve"])
            cells = [f"not reached (best {best:.4f})", "", ""]
        else:
            cells = [f"{hit[0]:.1f}", str(hit[1]), f"{t_base[0] / hit[0]:.2f}x"]
        agree = "" if r.get("replicas_agree", True) else " (replicas differ)"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['final_accuracy']:.4f}"
                     f"{agree} | {r['seconds']:.1f} | {r['sent'] / 1e6:.2f} |")
    return "\n".join(lines) + "\n"


def plot(meta: Dict[str, Any], rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in rows:
        xs = [c[1] for c in r["curve"]]
        ys = [100 * c[2] for c in r["curve"]]
        ax.plot(xs, ys, ls="--" if r["hook"].startswith("torch") else "-",
                lw=2.2 if r["hook"] in ("allreduce", "ddpx_powersgd4") else 1.3,
                label=bench_network.LABELS.get(r["hook"], r["hook"]))
    base = next((r for r in rows if r["hook"] == "allreduce"), None)
    if base is not None:
        ax.axhline(100 * base["final_accuracy"], color="0.5", lw=0.8, ls=":",
                   label="target: allreduce's final accuracy")
    ax.set_xlabel("seconds of training (evaluation excluded)")
    ax.set_ylabel("test accuracy, %")
    ax.set_ylim(80, 100)
    ax.set_title(f"digits, {meta['params'] / 1e6:.1f}M-parameter MLP, {meta['nodes']} nodes, "
                 f"{_rate_words(meta['rate'])} links")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hooks", default=",".join(HOOKS),
                   help="comma-separated, allreduce first; of: " + ", ".join(bench_network.HOOKS))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="per-link limit (tc's form) or 'unlimited'")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="start_powerSGD_iter: the steps before it allreduce")
    p.add_argument("--eval-every", type=int, default=4, help="steps between test evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job-timeout", type=float, default=1200.0)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", default="out/bench_tta")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    hooks = args.hooks.split(",")
    if hooks[0] != "allreduce" or any(h not in bench_network.HOOKS for h in hooks):
        p.error(f"--hooks must start with allreduce (the target) and name hooks of "
                f"{bench_network.HOOKS}, got {hooks}")
    if any(h in bench_network.ALONE for h in hooks):
        p.error(f"{sorted(bench_network.ALONE)} may take the job down: run it in bench_network")
    import multinode
    why = multinode.why_not_available()
    if why:
        print(f"bench_tta: {why}", file=sys.stderr)
        return 2
    import torch
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"
    script = [os.path.abspath(__file__), "--worker", "--hooks", ",".join(hooks)]
    for name in ("epochs", "batch_size", "hidden", "lr", "powersgd_start", "eval_every", "seed",
                 "job_timeout"):
        script += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    t0 = time.monotonic()
    rate = None if args.rate == "unlimited" else args.rate
    with multinode.Cluster(args.nodes, rate=rate) as cluster:
        results = cluster.torchrun(script, timeout=args.job_timeout + 120, env=env,
                                   python=args.python)
    found = None
    for r in results:
        for line in (r.stdout or "").splitlines():
            if line.startswith("BENCH_RESULT "):
                found = json.loads(line[len("BENCH_RESULT "):])
    if found is None or any(r.returncode != 0 for r in results):
        tail = "\n".join((r.stdout or "")[-3000:] for r in results)
        print(f"bench_tta: the job failed (exit codes {[r.returncode for r in results]}):\n"
              f"{tail}", file=sys.stderr)
        return 1
    params = sum(p.numel() for p in make_model(args.hidden, args.seed).parameters())
    meta = dict(torch=torch.__version__, nodes=args.nodes, rate=args.rate, epochs=args.epochs,
                batch_size=args.batch_size, hidden=args.hidden, lr=args.lr, params=params,
                powersgd_start=args.powersgd_start, eval_every=args.eval_every,
                cores=os.cpu_count(), threads_per_rank=1, wall_s=time.monotonic() - t0,
                command=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_tta.json"), "w") as f:
        json.dump(dict(meta=meta, rows=found), f, indent=1)
    md = render(meta, found)
    with open(os.path.join(args.out, "bench_tta.md"), "w") as f:
        f.write(md)
    plot(meta, found, os.path.join(args.out, "bench_tta.png"))
    print(md)
    print(f"bench_tta: wrote {args.out}/bench_tta.{{json,md,png}} in {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
