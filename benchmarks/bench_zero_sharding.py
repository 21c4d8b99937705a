#!/usr/bin/env python3
"""ZeroRedundancyOptimizer beyond torch: the balanced partition (state shares) and ZeRO-2 gradient
sharding (ddpx.hooks.reduce_scatter_hook: bytes and iteration time), against torch's
ZeroRedundancyOptimizer in the same run.

1. balance (no processes): the largest rank's share of the parameters (= of the optimizer state)
   relative to an even share, for torch's partition (whole tensors, sorted-greedy; ddpx's
   zero_partition, which the tests check equals torch's) and ddpx's partition="balanced", on
   transformer-shaped parameter lists (embedding, per layer qkv / out / two MLP matrices with
   biases and two norms) at 2, 4 and 8 ranks. Target: balanced <= 1.05.

2. state (2 Gloo ranks, measured): after one Adam step on a transformer-shaped model (--vocab,
   --dim, --blocks), each rank's optimizer-state bytes (every tensor of zero.optim.state, summed)
   for torch's ZeroRedundancyOptimizer, ddpx's (torch's partition) and ddpx's balanced: the
   largest rank's over an even share.

3. iteration (2 Gloo ranks, timed, interleaved): forward + backward + step of an MLP
   (--layers x Linear(--width, --width), batch --batch per rank, Adam) under DDP, four ways:
     torch      DDP's all-reduce + torch's ZeroRedundancyOptimizer
     ddpx       DDP's all-reduce + ddpx's ZeroRedundancyOptimizer (ZeRO-1)
     ddpx_rs    reduce_scatter_hook + ddpx's ZeroRedundancyOptimizer (ZeRO-2)
     ddpx_rs_b  the same with partition="balanced"
   R rounds (--rounds) x K iterations (--steps) of each, the order rotated every round, each
   iteration after a barrier; time = slowest rank; reported: the median and the median per-round
   ratio to torch. Bytes each rank sends per iteration, in model sizes (N fp32 elements): the
   all-reduce's 2(W-1)/W (a ring's; Gloo's algorithms send as much or more), the reduce-scatter's
   as measured by the hook (elements it sent), and the exchange's (W-1)/W (each owner's share to
   W-1 ranks, averaged over the ranks). verify: after the same iterations every configuration's
   parameters equal torch's within 1e-5 relative.

Usage (~1 min on 2 cores):
    PYTHONPATH=build/python .venv/bin/python benchmarks/bench_zero_sharding.py \\
        --json benchmarks/results/zero_sharding.json
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import bench_common as bc  # noqa: E402

CONFIGS = ["torch", "ddpx", "ddpx_rs", "ddpx_rs_b"]
BALANCE_TARGET = 1.05
VERIFY_RTOL = 1e-5


def transformer_numels(blocks: int, dim: int, vocab: int, ff: int = 4):
    sizes = [vocab * dim]
    for _ in range(blocks):
        sizes += [3 * dim * dim, 3 * dim, dim * dim, dim, dim, dim, ff * dim * dim, ff * dim,
                  ff * dim * dim, dim, dim, dim]
    return sizes + [dim, dim]


def balance_section() -> list:
    import ddpx
    rows = []
    for name, (blocks, dim, vocab) in {"2x256, vocab 50k": (2, 256, 50000),
                                       "6x512, vocab 30k": (6, 512, 30000),
                                       "12x768, vocab 30k": (12, 768, 30000)}.items():
        numels = transformer_numels(blocks, dim, vocab)
        for world in (2, 4, 8):
            even = sum(numels) / world
            owners = ddpx._C.zero_partition([numels], world)[0]
            greedy = [0] * world
            for n, o in zip(numels, owners):
                greedy[o] += n
            bal = [0] * world
            for row in ddpx._C.zero_partition_balanced(numels, [True] * len(numels), world):
                for b, e, o in row:
                    bal[o] += e - b
            rows.append({"model": name, "params": sum(numels), "world": world,
                         "torch": max(greedy) / even, "balanced": max(bal) / even})
    return rows


class Transformerish(nn.Module):
    """The parameter shapes of a transformer (no attention arithmetic: a benchmark of state)."""

    def __init__(self, vocab, dim, blocks):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList()
        for _ in range(blocks):
            self.blocks.append(nn.ModuleDict({
                "qkv": nn.Linear(dim, 3 * dim), "out": nn.Linear(dim, dim),
                "n1": nn.LayerNorm(dim), "up": nn.Linear(dim, 4 * dim),
                "down": nn.Linear(4 * dim, dim), "n2": nn.LayerNorm(dim)}))
        self.norm = nn.LayerNorm(dim)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b["n1"](x + b["out"](b["qkv"](x)[..., :x.shape[-1]]))
            x = b["n2"](x + b["down"](torch.relu(b["up"](x))))
        return self.norm(x)


def state_bytes(optim) -> int:
    return sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values()
               if torch.is_tensor(v))


def state_section(args, rank, world) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import ddpx
    torch.manual_seed(0)
    base = Transformerish(args.vocab, args.dim, args.blocks)
    idx = torch.randint(0, args.vocab, (2, 16), generator=torch.Generator().manual_seed(rank))
    out = {"params": sum(p.numel() for p in base.parameters())}
    for label, make in (
            ("torch", lambda ps: TorchZero(ps, torch.optim.Adam, lr=1e-3)),
            ("ddpx", lambda ps: ddpx.optim.ZeroRedundancyOptimizer(ps, torch.optim.Adam, lr=1e-3)),
            ("ddpx_balanced", lambda ps: ddpx.optim.ZeroRedundancyOptimizer(
                ps, torch.optim.Adam, lr=1e-3, partition="balanced"))):
        model = copy.deepcopy(base)
        ddp = DDP(model)
        zero = make(ddp.parameters())
        ddp(idx).square().mean().backward()
        zero.step()
        got = [None] * world
        dist.all_gather_object(got, state_bytes(zero.optim))
        out[label] = got
    return out


def build_mlp(layers, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def iteration_section(args, rank, world) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import ddpx
    base = build_mlp(args.layers, args.width)
    n = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    runs = {}
    for name in CONFIGS:
        model = copy.deepcopy(base)
        ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
        if name == "torch":
            zero = TorchZero(ddp.parameters(), torch.optim.Adam, lr=1e-4)
        else:
            zero = ddpx.optim.ZeroRedundancyOptimizer(
                ddp.parameters(), torch.optim.Adam, lr=1e-4,
                partition="balanced" if name == "ddpx_rs_b" else "sorted_greedy")
            if name != "ddpx":
                ddp.register_comm_hook(zero, ddpx.hooks.reduce_scatter_hook)
        runs[name] = (model, ddp, zero)

    def iterate(name):
        model, ddp, zero = runs[name]
        zero.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        zero.step()

    for name in CONFIGS:  # warm-up: Adam's state, DDP's rebuilt buckets
        for _ in range(2):
            iterate(name)
    times = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for name in order:
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                iterate(name)
                times[name].append((time.perf_counter() - t0) * 1e3)
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    out = {"params": n, "configs": {}}
    for name in CONFIGS:
        per = [max(g[name][i] for g in gathered) for i in range(len(times[name]))]
        rounds = [statistics.median(per[k * args.steps:(k + 1) * args.steps])
                  for k in range(args.rounds)]
        out["configs"][name] = {"median_ms": statistics.median(per), "round_medians": rounds}
    ref = out["configs"]["torch"]["round_medians"]
    for name in CONFIGS:
        c = out["configs"][name]
        c["ratio"] = statistics.median(a / b for a, b in zip(c["round_medians"], ref))
    iters = 2 + args.rounds * args.steps
    for name in ("ddpx_rs", "ddpx_rs_b"):
        sent = runs[name][2]._reduce_scatter_state.sent_elements
        got = [None] * world
        dist.all_gather_object(got, sent / iters / n)
        out["configs"][name]["rs_model_sizes"] = got
    ref_params = torch.cat([p.detach().reshape(-1) for p in runs["torch"][0].parameters()])
    errs = {}
    for name in CONFIGS[1:]:
        mine = torch.cat([p.detach().reshape(-1) for p in runs[name][0].parameters()])
        errs[name] = ((mine - ref_params).abs().max() / ref_params.abs().max()).item()
    got = [None] * world
    dist.all_gather_object(got, errs)
    out["verify"] = {name: max(g[name] for g in got) for name in CONFIGS[1:]}
    return out


def worker(rank, args, backend, world, port, out_path):
    bc.init_rank(rank, args, backend, world, port)
    out = {"state": state_section(args, rank, world),
           "iteration": iteration_section(args, rank, world)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.device = "cpu"
    world = args.world_size
    balance = balance_section()
    run = bc.spawn_run(worker, args, "gloo", world)
    run["balance"] = balance
    run["argv"] = sys.argv
    run["torch"] = torch.__version__

    print(f"### ZeRO sharding (torch {torch.__version__}, {world} Gloo ranks)\n")
    print("1. balance: the largest rank's share / an even share (parameters = optimizer state)\n")
    bc.print_table(["model", "params", "ranks", "torch's partition", "ddpx balanced"], "lrrrr",
                   [[r["model"], f"{r['params'] / 1e6:.1f}M", str(r["world"]),
                     f"{r['torch']:.2f}x", f"{r['balanced']:.4f}x"] for r in balance])
    worst = max(r["balanced"] for r in balance)
    print(f"\nTarget balanced <= {BALANCE_TARGET}: {'met' if worst <= BALANCE_TARGET else 'MISSED'}"
          f" (worst {worst:.4f})\n")
    st = run["state"]
    print(f"2. state: Adam state bytes per rank after one step, transformer-shaped "
          f"({st['params'] / 1e6:.1f}M params: vocab {args.vocab}, dim {args.dim}, "
          f"{args.blocks} blocks)\n")
    even = 2 * 4 * st["params"] / world
    rows = []
    for label in ("torch", "ddpx", "ddpx_balanced"):
        per = st[label]
        rows.append([label] + [f"{b / 2**20:.1f} MiB" for b in per]
                    + [f"{max(per) / even:.3f}x"])
    bc.print_table(["ZeRO"] + [f"rank {r}" for r in range(world)] + ["max / even"],
                   "l" + "r" * (world + 1), rows)
    it = run["iteration"]
    n = it["params"]
    print(f"\n3. iteration (forward + backward + Adam step), {args.layers} x Linear({args.width}, "
          f"{args.width}) = {n / 1e6:.1f}M params, batch {args.batch}/rank, {args.rounds} rounds "
          f"x {args.steps}; slowest rank, median\n")
    ar = 2 * (world - 1) / world
    ex = (world - 1) / world
    rows = []
    for name in CONFIGS:
        c = it["configs"][name]
        if "rs_model_sizes" in c:
            grad = statistics.mean(c["rs_model_sizes"])
            grad_s = "/".join(f"{v:.2f}" for v in c["rs_model_sizes"])
        else:
            grad, grad_s = ar, f"{ar:.2f} (all-reduce)"
        rows.append([name, f"{c['median_ms']:.1f}", f"{c['ratio']:.2f}", grad_s,
                     f"{grad + ex:.2f}"])
    bc.print_table(["config", "ms", "/ torch (per-round median)", "grad model sizes sent/rank",
                    "total incl. exchange"], "lrrrr", rows)
    ok = all(v <= VERIFY_RTOL for v in it["verify"].values())
    print(f"\nverify: parameters vs torch's after the same iterations, max rel err "
          f"{max(it['verify'].values()):.2g} ({'ok' if ok else 'FAIL'})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    return 0 if ok and worst <= BALANCE_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
