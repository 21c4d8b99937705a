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

3. iteration (--world-size Gloo ranks, 2 by default, timed, interleaved): forward + backward +
   step of an MLP (--layers x Linear(--width, --width), batch --batch per rank, Adam) under DDP,
   by default four ways (--configs):
     torch      DDP's all-reduce + torch's ZeroRedundancyOptimizer
     ddpx       DDP's all-reduce + ddpx's ZeroRedundancyOptimizer (ZeRO-1)
     ddpx_rs    reduce_scatter_hook + ddpx's ZeroRedundancyOptimizer (ZeRO-2)
     ddpx_rs_b  the same with partition="balanced"
   and, named with --configs, the quantized ones (registered with ddpx.register_comm_hook, no
   Python per bucket; on a ddpx whose reduce_scatter_hook is Python, through a named function
   with ddp.register_comm_hook, and the table says so):
     ddpx_rs32  reduce_scatter_hook, natively + ddpx's ZeroRedundancyOptimizer (ZeRO-2)
     ddpx_rs<b> the same with bits=<b> (8, 4, 2 or 1): quantized ZeRO-2
     ddpx_q<b>  quantized_hook, QuantizedState(bits=<b>, start_iter=0) + ddpx's
                ZeroRedundancyOptimizer (ZeRO-1): the quantized all-reduce at the same bits
   R rounds (--rounds) x K iterations (--steps) of each, the order rotated every round, each
   iteration after a barrier; time = slowest rank; reported: the median and the median per-round
   ratio to torch, and for every bits b with both ddpx_rs<b> and ddpx_q<b>, the median
   per-round ratio of the quantized ZeRO-2's iteration to the hook's (< 1: ZeRO-2 faster).
   Bytes each rank sends per iteration, in model sizes (N fp32 elements): the all-reduce's
   2(W-1)/W (a ring's; Gloo's algorithms send as much or more), the reduce-scatter's as measured
   by the hook (elements it sent), and the exchange's (W-1)/W (each owner's share to W-1 ranks,
   averaged over the ranks); quantized, the bytes the reduce-scatter hook sent over
   4N, and for quantized_hook its nominal bytes (codes and a 4-byte scale per block of 256:
   all-gather on 2 ranks, (W-1) buckets; reduce-scatter on more, 2(W-1)/W). verify: after the
   same iterations every unquantized configuration's parameters equal torch's within 1e-5
   relative; a quantized one's update (parameters minus the initial ones) is within 0.5 of
   torch's update (relative L2 norm).

Usage (~1 min on 2 cores):
    PYTHONPATH=build/python .venv/bin/python benchmarks/bench_zero_sharding.py \\
        --json benchmarks/results/zero_sharding.json
quantized ZeRO-2 against quantized_hook + ZeRO-1 (3 ranks: --world-size 3):
    PYTHONPATH=build/python .venv/bin/python benchmarks/bench_zero_sharding.py \\
        --configs torch,ddpx,ddpx_rs32,ddpx_rs8,ddpx_q8,ddpx_rs4,ddpx_q4
"""
import argparse
import copy
import functools
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import bench_common as bc  # noqa: E402

CONFIGS = ["torch", "ddpx", "ddpx_rs", "ddpx_rs_b"]  # the default --configs
QUANTIZED = re.compile(r"ddpx_(rs|q)(32|8|4|2|1)")  # ddpx_rs<bits> and ddpx_q<bits>
BALANCE_TARGET = 1.05
VERIFY_RTOL = 1e-5
VERIFY_QUANTIZED = 0.5  # a quantized config's update against torch's, relative L2 norm
BLOCK = 256  # the quantized hooks' block_size (their default)


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


def register_quantized(ddpx, name: str, ddp, zero) -> str:
    """Registers ddpx_rs<bits> or ddpx_q<bits> on ``ddp``; returns how (for the table)."""
    kind, bits = QUANTIZED.fullmatch(name).groups()
    bits = int(bits)
    H = ddpx.hooks
    if kind == "q":
        state = H.QuantizedState(process_group=None, bits=bits, start_iter=0)
        ddpx.register_comm_hook(ddp, state, H.quantized_hook)
        zero._bench_quantized_state = state  # kept alive with the run
        return "native"
    if getattr(H.reduce_scatter_hook, "_ddpx_factory", None) is not None:
        ddpx.register_comm_hook(ddp, zero, functools.partial(H.reduce_scatter_hook, bits=bits))
        return "native"

    def reduce_scatter_bits(state, bucket):  # a ddpx whose reduce_scatter_hook is Python
        return H.reduce_scatter_hook(state, bucket, bits=bits)

    ddp.register_comm_hook(zero, reduce_scatter_bits)
    return "Python hook"


def iteration_section(args, rank, world) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import ddpx
    configs = args.config_list
    base = build_mlp(args.layers, args.width)
    n = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    runs, paths = {}, {}
    for name in configs:
        model = copy.deepcopy(base)
        ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
        if name == "torch":
            zero = TorchZero(ddp.parameters(), torch.optim.Adam, lr=1e-4)
        else:
            zero = ddpx.optim.ZeroRedundancyOptimizer(
                ddp.parameters(), torch.optim.Adam, lr=1e-4,
                partition="balanced" if name == "ddpx_rs_b" else "sorted_greedy")
            if QUANTIZED.fullmatch(name):
                paths[name] = register_quantized(ddpx, name, ddp, zero)
            elif name != "ddpx":
                ddp.register_comm_hook(zero, ddpx.hooks.reduce_scatter_hook)
                paths[name] = "drop-in"
        runs[name] = (model, ddp, zero)

    def iterate(name):
        model, ddp, zero = runs[name]
        zero.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        zero.step()

    for name in configs:  # warm-up: Adam's state, DDP's rebuilt buckets
        for _ in range(2):
            iterate(name)
    times = {name: [] for name in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for name in order:
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                iterate(name)
                times[name].append((time.perf_counter() - t0) * 1e3)
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    out = {"params": n, "configs": {}}
    for name in configs:
        per = [max(g[name][i] for g in gathered) for i in range(len(times[name]))]
        rounds = [statistics.median(per[k * args.steps:(k + 1) * args.steps])
                  for k in range(args.rounds)]
        out["configs"][name] = {"median_ms": statistics.median(per), "round_medians": rounds}
        if name in paths:
            out["configs"][name]["path"] = paths[name]
    ref = out["configs"]["torch"]["round_medians"]
    for name in configs:
        c = out["configs"][name]
        c["ratio"] = statistics.median(a / b for a, b in zip(c["round_medians"], ref))
    # Quantized ZeRO-2 against quantized_hook + ZeRO-1 at the same bits, paired per round.
    out["zero2_vs_hook"] = {}
    for bits in (8, 4, 2, 1):
        rs, q = f"ddpx_rs{bits}", f"ddpx_q{bits}"
        if rs in configs and q in configs:
            a, b = out["configs"][rs]["round_medians"], out["configs"][q]["round_medians"]
            out["zero2_vs_hook"][str(bits)] = statistics.median(x / y for x, y in zip(a, b))
    iters = 2 + args.rounds * args.steps
    for name in configs:
        m = QUANTIZED.fullmatch(name)
        if name in ("ddpx_rs", "ddpx_rs_b") or (m and m.group(1) == "rs"):
            hs = runs[name][2]._reduce_scatter_state
            got = [None] * world
            dist.all_gather_object(got, (hs.sent_elements / iters / n,
                                         hs.sent_bytes / iters / (4 * n)))
            out["configs"][name]["rs_model_sizes"] = [g[0] for g in got]
            out["configs"][name]["rs_byte_model_sizes"] = [g[1] for g in got]
    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    ref_params = flat(runs["torch"][0])
    ref_update = ref_params - flat(base)
    errs = {}
    for name in configs[1:]:
        mine = flat(runs[name][0])
        m = QUANTIZED.fullmatch(name)
        if m and m.group(2) != "32":  # quantized: the update against torch's
            errs[name] = ((mine - flat(base) - ref_update).norm() / ref_update.norm()).item()
        else:
            errs[name] = ((mine - ref_params).abs().max() / ref_params.abs().max()).item()
    got = [None] * world
    dist.all_gather_object(got, errs)
    out["verify"] = {name: max(g[name] for g in got) for name in configs[1:]}
    return out


def verify_bound(name: str) -> float:
    m = QUANTIZED.fullmatch(name)
    return VERIFY_QUANTIZED if m and m.group(2) != "32" else VERIFY_RTOL


def grad_model_sizes(name: str, c: dict, world: int):
    """(model sizes sent per rank for the gradients, its text) of config ``name``."""
    ar = 2 * (world - 1) / world
    m = QUANTIZED.fullmatch(name)
    if "rs_byte_model_sizes" in c and m and m.group(2) != "32":
        sizes = c["rs_byte_model_sizes"]  # quantized messages: their bytes over 4N
        return statistics.mean(sizes), "/".join(f"{v:.3f}" for v in sizes) + " (bytes)"
    if "rs_model_sizes" in c:
        return statistics.mean(c["rs_model_sizes"]), "/".join(f"{v:.2f}" for v in
                                                               c["rs_model_sizes"])
    if m and m.group(1) == "q":
        bits = int(m.group(2))
        per = (bits + 32 / BLOCK) / 32  # codes and a float scale per block, per value
        size = per * ((world - 1) if world == 2 else 2 * (world - 1) / world)
        return size, f"{size:.3f} (nominal)"
    return ar, f"{ar:.2f} (all-reduce)"


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
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated, torch first: torch, ddpx, ddpx_rs, ddpx_rs_b, "
                   "ddpx_rs<bits> (reduce_scatter_hook natively, bits 32, 8, 4, 2 or 1), "
                   "ddpx_q<bits> (quantized_hook, bits 8, 4, 2 or 1, with ZeRO-1)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.device = "cpu"
    args.config_list = args.configs.split(",")
    for name in args.config_list:
        m = QUANTIZED.fullmatch(name)
        if not (name in CONFIGS or (m and not (m.group(1) == "q" and m.group(2) == "32"))):
            p.error(f"unknown config {name!r}")
    if args.config_list[0] != "torch":
        p.error("--configs must start with torch (the reference of the ratios and verify)")
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
    ex = (world - 1) / world
    rows = []
    for name in args.config_list:
        c = it["configs"][name]
        grad, grad_s = grad_model_sizes(name, c, world)
        label = f"{name} ({c['path']})" if "path" in c else name
        rows.append([label, f"{c['median_ms']:.1f}", f"{c['ratio']:.2f}", grad_s,
                     f"{grad + ex:.2f}"])
    bc.print_table(["config", "ms", "/ torch (per-round median)", "grad model sizes sent/rank",
                    "total incl. exchange"], "lrrrr", rows)
    if it["zero2_vs_hook"]:
        print("\nquantized ZeRO-2 (ddpx_rs<bits>) against quantized_hook + ZeRO-1 (ddpx_q<bits>),"
              " median per-round ratio of the iterations (< 1: ZeRO-2 faster)\n")
        bc.print_table(["bits", "ZeRO-2 ms", "hook + ZeRO-1 ms", "ZeRO-2 / hook"], "rrrr",
                       [[b, f"{it['configs'][f'ddpx_rs{b}']['median_ms']:.1f}",
                         f"{it['configs'][f'ddpx_q{b}']['median_ms']:.1f}", f"{r:.3f}"]
                        for b, r in it["zero2_vs_hook"].items()])
    ok = all(v <= verify_bound(k) for k, v in it["verify"].items())
    exact = [v for k, v in it["verify"].items() if verify_bound(k) == VERIFY_RTOL]
    quant = {k: v for k, v in it["verify"].items() if verify_bound(k) != VERIFY_RTOL}
    said = "" if not quant else (
        f"; quantized, update vs torch's (rel L2, bound {VERIFY_QUANTIZED}): "
        + ", ".join(f"{k} {v:.3f}" for k, v in quant.items()))
    print(f"\nverify: parameters vs torch's after the same iterations, max rel err "
          f"{max(exact, default=0.0):.2g}{said} ({'ok' if ok else 'FAIL'})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    return 0 if ok and worst <= BALANCE_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
