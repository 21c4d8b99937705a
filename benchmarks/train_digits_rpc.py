#!/usr/bin/env python3
"""Model-parallel training of the digits MLP over RPC, stepped by ddpx.optim.DistributedOptimizer.

Three processes (torchrun --nproc_per_node=3): worker1 owns the first layer of the main job's MLP
(64 -> 512, ReLU), worker2 the rest (512 -> 512, ReLU, 512 -> 10); worker0, the trainer, drives
them with distributed autograd: for each batch a forward through both owners, the loss on the
trainer, dist_autograd.backward, and one DistributedOptimizer step, which updates each owner's
parameters on that owner. Same data split, initial weights, SGD (lr 0.03, momentum 0.9), epochs
and batches as benchmarks/train_digits.py: each step's batch is the union of the two DDP ranks'
batches of that step, so the gradient is the one DDP averages, and the run repeats the DDP job's
training (up to rounding: the sums are grouped differently).

Rows: ddpx's DistributedOptimizer (the owners step in C++) and torch's (its TorchScript
functional path for SGD), each from the same initial weights. Prints a table (test accuracy,
ms per step, final loss, max |w - w(other row)|, and, with --compare, max |w - w(DDP job)|) and
writes <out>/results_rpc.md.

    torchrun --standalone --nproc_per_node=3 benchmarks/train_digits_rpc.py --out out/ \
        [--compare out/final_weights.pt]
"""
import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddpx  # noqa: E402,F401  (registers ddpx's operator on every worker)
from ddpx.optim import DistributedOptimizer  # noqa: E402
from train_digits import load_digits_split, make_mlp  # noqa: E402  (the main job's data, model)

DDP_WORLD = 2  # the DDP job's ranks, whose per-step batches one trainer step takes together


class Stage(nn.Module):
    """A slice of the MLP on its owner, with its initial weights."""

    def __init__(self, layers, state):
        super().__init__()
        self.net = nn.Sequential(*layers)
        self.net.load_state_dict(state)

    def forward(self, x):
        return self.net(x)

    def param_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]

    def flat(self):
        return torch.cat([p.detach().reshape(-1) for p in self.parameters()])


def _split(args):
    """The main job's initial MLP (same seed), cut after the first ReLU: (layers, state) x 2."""
    torch.manual_seed(args.seed)
    mlp = make_mlp(args.hidden, args.depth)
    layers = list(mlp)
    first, rest = layers[:2], layers[2:]
    sd = lambda ls: nn.Sequential(*ls).state_dict()  # noqa: E731
    return (first, sd(first)), (rest, sd(rest))


class Row:
    """One optimizer's run: its own two stages (from the same initial weights) and optimizer."""

    def __init__(self, name, optim_factory, args, parts):
        self.name = name
        self.s1 = rpc.remote("worker1", Stage, args=parts[0])
        self.s2 = rpc.remote("worker2", Stage, args=parts[1])
        params = self.s1.rpc_sync().param_rrefs() + self.s2.rpc_sync().param_rrefs()
        self.opt = optim_factory(torch.optim.SGD, params, lr=args.lr, momentum=0.9)
        self.step_ms, self.losses, self.epoch_loss = [], [], []

    def step(self, xb, yb):
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            h = self.s1.rpc_sync().forward(xb)
            out = self.s2.rpc_sync().forward(h)
            loss = nn.functional.cross_entropy(out, yb)
            dist_autograd.backward(cid, [loss])
            self.opt.step(cid)
        self.step_ms.append((time.perf_counter() - t0) * 1e3)
        self.losses.append(loss.item())

    def finish(self, args, x_te, y_te):
        with torch.no_grad():
            pred = self.s2.rpc_sync().forward(self.s1.rpc_sync().forward(x_te)).argmax(dim=1)
        return dict(name=self.name, test_acc=float((pred == y_te).float().mean()),
                    ms_per_step=statistics.median(self.step_ms[args.warmup_steps:]),
                    final_loss=self.epoch_loss[-1],
                    weights=torch.cat([self.s1.rpc_sync().flat(), self.s2.rpc_sync().flat()]))


def train_all(args, data, parts):
    """Both rows on the same batches, interleaved step by step (rotating which goes first), so
    that a change in the machine's load hits both alike."""
    x_tr, y_tr, x_te, y_te = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.x: its TorchScript path is deprecated
        rows = [Row("ddpx DistributedOptimizer (C++ steps)", DistributedOptimizer, args, parts),
                Row("torch DistributedOptimizer", TorchDistributedOptimizer, args, parts)]
    samplers = [DistributedSampler(range(len(x_tr)), num_replicas=DDP_WORLD, rank=r, shuffle=True,
                                   seed=args.seed, drop_last=True) for r in range(DDP_WORLD)]
    step = 0
    for epoch in range(args.epochs):
        orders = []
        for s in samplers:
            s.set_epoch(epoch)
            orders.append(torch.tensor(list(s), dtype=torch.long))
        for b in range(len(orders[0]) // args.batch_size):
            idx = torch.cat([o[b * args.batch_size:(b + 1) * args.batch_size] for o in orders])
            xb, yb = x_tr[idx], y_tr[idx]
            for r in rows[step % 2:] + rows[:step % 2]:
                r.step(xb, yb)
            step += 1
        for r in rows:
            r.epoch_loss.append(sum(r.losses) / len(r.losses))
            r.losses = []
        print(f"  epoch {epoch + 1}/{args.epochs}: loss "
              + " ".join(f"{r.epoch_loss[-1]:.4f}" for r in rows), flush=True)
    return [r.finish(args, x_te, y_te) for r in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="per DDP rank, as the main job")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--compare", default="", help="the DDP job's --save-final-weights file")
    p.add_argument("--save-final-weights", default="", metavar="FILE",
                   help="the trainer saves each row's final weights (flattened) there")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 3:
        raise SystemExit("train_digits_rpc.py: run it with torchrun --nproc_per_node=3")
    torch.set_num_threads(1)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        data = load_digits_split(args.seed)
        parts = _split(args)
        print(f"train_digits_rpc: model-parallel digits MLP, worker1: {parts[0][0]}, worker2: "
              f"{len(parts[1][0])} layers; trainer worker0; torch {torch.__version__}",
              flush=True)
        rows = train_all(args, data, parts)
        ddp = None
        if args.compare and os.path.exists(args.compare):
            ddp = torch.load(args.compare).get("no hook (DDP default)")
        lines = [
            "Model-parallel digits MLP over RPC (3 workers: a trainer and two owners), "
            f"{args.epochs} epochs, SGD lr {args.lr} momentum 0.9, each step the DDP job's two "
            f"ranks' batches together; ms/step: median after {args.warmup_steps} steps "
            "(forward and backward RPCs included).",
            "",
            "| optimizer | test acc | ms/step | final loss | max abs diff vs the other row |"
            + (" max abs diff vs the DDP job |" if ddp is not None else ""),
            "|---|---:|---:|---:|---:|" + ("---:|" if ddp is not None else ""),
        ]
        for i, r in enumerate(rows):
            other = rows[1 - i]["weights"]
            line = (f"| {r['name']} | {100 * r['test_acc']:.2f}% | {r['ms_per_step']:.2f} | "
                    f"{r['final_loss']:.5f} | {float((r['weights'] - other).abs().max()):.3g} |")
            if ddp is not None:
                line += f" {float((r['weights'] - ddp).abs().max()):.3g} |"
            lines.append(line)
        md = "\n".join(lines) + "\n"
        print("\n" + md, flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results_rpc.md"), "w") as f:
            f.write(md)
        if args.save_final_weights:
            torch.save({r["name"]: r["weights"] for r in rows}, args.save_final_weights)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
