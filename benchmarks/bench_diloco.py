#!/usr/bin/env python3
"""DiLoCo's accuracy and bytes on the char-level LM (train_charlm.py's text and model), beside
data-parallel allreduce at the same inner steps and per-rank batch.

Every configuration trains the same CharMLP from the same weights, each rank on its own shard of
the training windows (the same shards for every configuration), AdamW (--lr) as the optimizer
(DiLoCo's inner one), for --epochs over the shard:

  allreduce        DDP's allreduce of every step's gradients
  diloco H=.. b=.. ddpx.optim.DiLoCo on the plain module (no DDP): H inner steps, then the outer
                   gradients averaged (bits 32 fp32, 16 bf16, 8/4/2/1 quantized with error
                   feedback unless "noef"), outer SGD lr 0.7, Nesterov 0.9
  streaming ...    the same with fragments / fragment_sync_delay / fragment_update_alpha

Reported per row: the test loss (nats per character, rank 0's model after the last step, which
every row ends on a synchronization of every fragment) and its ratio to allreduce's, the
next-byte accuracy, the bytes each rank sends per inner step and allreduce's over the row's.
Bytes per rank: allreduce's ring, 2 (W - 1) / W x 4 bytes per value per step; DiLoCo's messages
(DiLoCo.message_bytes: values x 4 or 2, quantized the blocks' codes and scales), sent once to the
peer on 2 ranks (all-gather) and 2 (W - 1) / W of them from 3 ranks on (reduce-scatter style,
fp32 and bf16 by the ring allreduce), per inner step. (Modelled from what each rank hands the
group; benchmarks/bench_network.py measures bytes on links.)

Launch (2 ranks, ~2 min on 2 cores)::

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        benchmarks/bench_diloco.py --json benchmarks/results/diloco_w2.json
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_charlm as tc  # noqa: E402

# name -> DiLoCo arguments (None: the allreduce baseline)
CONFIGS = {
    "allreduce": None,
    "diloco H=32 b=32": dict(sync_every=32, bits=32),
    "diloco H=32 b=16": dict(sync_every=32, bits=16),
    "diloco H=32 b=4": dict(sync_every=32, bits=4),
    "diloco H=32 b=4 noef": dict(sync_every=32, bits=4, use_error_feedback=False),
    "diloco H=64 b=2": dict(sync_every=64, bits=2),
    "diloco H=64 b=2 noef": dict(sync_every=64, bits=2, use_error_feedback=False),
    "streaming H=32 P=4 tau=2 b=4": dict(sync_every=32, fragments=4, fragment_sync_delay=2,
                                         fragment_update_alpha=0.5, bits=4),
}


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x[i:i + 2048]) for i in range(0, len(x), 2048)])
    model.train()
    loss = nn.functional.cross_entropy(logits, y).item()
    acc = (logits.argmax(1) == y).float().mean().item()
    return loss, acc


def run(name, cfg, args, data, rank, world):
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(args.seed)
    model = tc.CharMLP(args.context, args.embed, args.hidden, args.depth)
    n = sum(p.numel() for p in model.parameters())
    shard = torch.arange(rank, len(x_tr), world)
    steps_per_epoch = len(shard) // args.batch_size
    steps = args.epochs * steps_per_epoch
    steps -= steps % 64  # every row ends on a synchronization of every fragment
    if cfg is None:
        net = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:
        net = model
        import ddpx
        opt = ddpx.optim.DiLoCo(torch.optim.AdamW(model.parameters(), lr=args.lr), **cfg)
    g = torch.Generator().manual_seed(args.seed + 1)
    t0 = time.perf_counter()
    step = 0
    while step < steps:
        order = shard[torch.randperm(len(shard), generator=g)]
        for k in range(steps_per_epoch):
            if step == steps:
                break
            idx = order[k * args.batch_size:(k + 1) * args.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(net(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
            step += 1
    wall = time.perf_counter() - t0
    loss, acc = evaluate(model, x_te, y_te)
    ring = 2.0 * (world - 1) / world
    if cfg is None:
        per_step = ring * 4 * n
    else:
        factor = (world - 1) if (world == 2 and cfg.get("bits", 32) <= 8) else ring
        per_step = factor * opt.message_bytes / steps
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(t, gathered[0]) for t in gathered)
    return dict(name=name, loss=loss, acc=acc, bytes_per_step=per_step, steps=steps,
                params=n, wall_s=wall, replicas_identical=same)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chars", type=int, default=2_000_000)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--embed", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--train-samples", type=int, default=160_000)
    p.add_argument("--test-samples", type=int, default=8_192)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's (the inner optimizer's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated substrings of row names")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    text, _ = tc.stdlib_text(args.chars)
    data = tc.charlm_split(text, args.seed, args.context, args.train_samples, args.test_samples)
    wanted = [s for s in args.only.split(",") if s]
    rows = []
    for name, cfg in CONFIGS.items():
        if wanted and name != "allreduce" and not any(s in name for s in wanted):
            continue
        rows.append(run(name, cfg, args, data, rank, world))
    if rank == 0:
        base = rows[0]
        print(f"### DiLoCo on the char LM ({world} Gloo ranks, torch {torch.__version__}, "
              f"{base['params']:,} parameters, {base['steps']} inner steps, batch "
              f"{args.batch_size}/rank, AdamW lr {args.lr})\n")
        print("| row | test loss | / allreduce | accuracy | bytes/step/rank | allreduce / row "
              "| wall s | replicas identical |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            r["loss_ratio"] = r["loss"] / base["loss"]
            r["bytes_ratio"] = base["bytes_per_step"] / r["bytes_per_step"]
            print(f"| {r['name']} | {r['loss']:.4f} | {r['loss_ratio']:.3f} | {r['acc']:.3f} | "
                  f"{r['bytes_per_step']:,.0f} | {r['bytes_ratio']:.0f}x | {r['wall_s']:.1f} | "
                  f"{r['replicas_identical']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "argv": sys.argv, "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
