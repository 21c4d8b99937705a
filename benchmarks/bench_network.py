#!/usr/bin/env python3
"""Where compression pays: a DDP step across machines, per hook (torch's and ddpx's side by side),
against the link's speed, with the bytes each rank put on the wire read from its interface.

    sudo .venv/bin/python benchmarks/bench_network.py --out out/bench_network
    sudo .venv/bin/python benchmarks/bench_network.py --nodes 2 --rates 1gbit --models mlp

Each cell (nodes x link speed x model) is one torchrun job on a fresh cluster of network
namespaces (scripts/multinode.py: one Gloo rank per node, one intra-op thread per rank, every
link limited with tc tbf in both directions, "unlimited" = a bare veth). In the job every hook
trains the same model from the same weights on the same per-rank batch: warm-up steps (DDP's
bucket rebuild, PowerSGD's uncompressed start), then timed steps, each started on every rank at
once (a barrier). Per hook: the median step of rank 0 (ms), the bytes each rank sent per step
(the eth0 tx counter of its namespace, /proc/net/dev, over the timed steps, mean over ranks; the
barriers' few hundred bytes included) and the ratio to DDP's default allreduce. torch's
powerSGD_hook is run twice: with one bucket (where it works) and with DDP's default buckets,
alone in its own job, as its Gloo callbacks can crash or hang there; what happens is its result.

Outputs: <out>/bench_network.json (every figure), <out>/bench_network.md (the tables) and
<out>/bench_network.png (step time against link speed per hook). Needs root and iproute2 (the
harness says what is missing); not part of the test suite.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "scripts"))

RATES = ["500mbit", "1gbit", "2500mbit", "10gbit", "unlimited"]
# The hooks in table order; "floor" is the compute floor (noop: no communication at all).
HOOKS = ["noop", "allreduce", "torch_fp16", "ddpx_fp16", "ddpx_fp16_dropin", "ddpx_bf16",
         "torch_powersgd4_1bucket", "ddpx_powersgd4", "ddpx_powersgd4_dropin", "ddpx_powersgd1",
         "ddpx_batched_powersgd4", "ddpx_q8", "ddpx_q4", "ddpx_q1", "torch_qchannel",
         "torch_powersgd4", "diloco_h32_q4", "diloco_h32_q4_p4"]
LABELS = {
    "noop": "noop (compute floor)",
    "allreduce": "DDP default allreduce",
    "torch_fp16": "torch fp16_compress_hook",
    "ddpx_fp16": "ddpx fp16_compress_hook (native)",
    "ddpx_fp16_dropin": "ddpx fp16_compress_hook (drop-in)",
    "ddpx_bf16": "ddpx bf16_compress_hook (native)",
    "torch_powersgd4_1bucket": "torch powerSGD_hook r=4, one bucket",
    "ddpx_powersgd4": "ddpx powerSGD_hook r=4 (native)",
    "ddpx_powersgd4_dropin": "ddpx powerSGD_hook r=4 (drop-in)",
    "ddpx_powersgd1": "ddpx powerSGD_hook r=1 (native)",
    "ddpx_batched_powersgd4": "ddpx batched_powerSGD_hook r=4 (native)",
    "ddpx_q8": "ddpx quantized_hook 8 bits (native)",
    "ddpx_q4": "ddpx quantized_hook 4 bits (native)",
    "ddpx_q1": "ddpx quantized_hook 1 bit (native)",
    "torch_qchannel": "torch quantization_perchannel_hook",
    "torch_powersgd4": "torch powerSGD_hook r=4, DDP's buckets",
    "diloco_h32_q4": "ddpx DiLoCo H=32, 4 bits (mean step over H)",
    "diloco_h32_q4_p4": "ddpx Streaming DiLoCo H=32, 4 bits, 4 fragments, delay 2 (mean over H)",
}
def _gbit(rate: str) -> float:
    """A tc rate ("100mbit", "1gbit", "2500mbit") in Gbit/s; "unlimited" drawn at 40."""
    if rate == "unlimited":
        return 40.0
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"bench_network: a rate like 100mbit or 1gbit, got {rate!r}")


# DiLoCo rows: no DDP (a plain replica per rank), ddpx.optim.DiLoCo over the SGD every row uses;
# they warm up over H steps (a first synchronization: the ranks' agreement, the codec's layouts and
# residuals), then time H steps (one synchronization of every fragment) instead of --steps, and
# report the mean step (ms) beside the longest (ms_max): the exchange lands on a few of the H.
DILOCO = {
    "diloco_h32_q4": dict(sync_every=32, bits=4),
    "diloco_h32_q4_p4": dict(sync_every=32, bits=4, fragments=4, fragment_sync_delay=2,
                             fragment_update_alpha=0.5),
}
# Run alone, in a job of its own: it may take the job down.
ALONE = {"torch_powersgd4", "torch_qchannel"}
PSGD_START = 2  # start_powerSGD_iter: steps 0 and 1 allreduce, the warm-up covers them


# ---------------------------------------------------------------------------------------------
# The worker: one rank of a cell's job (under torchrun, inside a node's namespace).
# ---------------------------------------------------------------------------------------------
def build_model(name: str):
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    if name == "mlp":  # 8 x Linear(2048, 2048): 33.6M parameters, all matrices
        layers: List[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(2048, 2048), nn.ReLU()]
        return nn.Sequential(*layers)
    if name == "transformer":  # embeddings, layer norms, biases: 29.1M parameters

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(32000, 512)
                layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
                self.blocks = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(512)
                self.head = nn.Linear(512, 10)

            def forward(self, tokens):
                return self.head(self.norm(self.blocks(self.embed(tokens))).mean(dim=1))

        return Net()
    raise SystemExit(f"bench_network: unknown model {name!r}")


def make_batch(name: str, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    if name == "mlp":
        return torch.randn(8, 2048, generator=g), torch.randn(8, 2048, generator=g)
    return torch.randint(0, 32000, (8, 64), generator=g), torch.randint(0, 10, (8,), generator=g)


def loss_of(name: str, out, y):
    import torch.nn.functional as F
    return F.mse_loss(out, y) if name == "mlp" else F.cross_entropy(out, y)


def register(hook: str, model, psgd_start: int = PSGD_START):
    """DDP over `model` with `hook` registered; returns the DDP model. PowerSGD's hooks
    allreduce the first `psgd_start` steps (start_powerSGD_iter)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx
    H = ddpx.hooks
    one_bucket = hook == "torch_powersgd4_1bucket"
    kw = dict(bucket_cap_mb=1e6) if one_bucket else {}
    ddp = DDP(model, **kw)
    if hook == "allreduce":
        return ddp
    if hook == "noop":
        ddpx.register_comm_hook(ddp, None, H.noop_hook)
    elif hook == "torch_fp16":
        ddp.register_comm_hook(None, th.fp16_compress_hook)
    elif hook == "ddpx_fp16":
        ddpx.register_comm_hook(ddp, None, H.fp16_compress_hook)
    elif hook == "ddpx_fp16_dropin":
        ddp.register_comm_hook(None, H.fp16_compress_hook)
    elif hook == "ddpx_bf16":
        ddpx.register_comm_hook(ddp, None, H.bf16_compress_hook)
    elif hook.startswith("ddpx_q"):
        st = H.QuantizedState(process_group=None, bits=int(hook[len("ddpx_q"):]),
                              start_iter=psgd_start)
        ddpx.register_comm_hook(ddp, st, H.quantized_hook)
    elif hook == "torch_qchannel":
        from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as tq
        ddp.register_comm_hook(None, tq.quantization_perchannel_hook)
    elif hook.startswith("torch_powersgd4"):
        st = tp.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                              start_powerSGD_iter=psgd_start, random_seed=0)
        ddp.register_comm_hook(st, tp.powerSGD_hook)
    elif hook.startswith("ddpx_"):
        rank = 1 if hook.endswith("powersgd1") else 4
        st = H.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                             start_powerSGD_iter=psgd_start, random_seed=0)
        fn = H.batched_powerSGD_hook if "batched" in hook else H.powerSGD_hook
        if hook.endswith("dropin"):
            ddp.register_comm_hook(st, fn)
        else:
            ddpx.register_comm_hook(ddp, st, fn)
    else:
        raise SystemExit(f"bench_network: unknown hook {hook!r}")
    return ddp


def tx_bytes(ifname: str) -> int:
    """This namespace's counter (a worker runs inside its node)."""
    import multinode
    with open("/proc/net/dev") as f:
        return multinode.tx_bytes_of(f.read(), ifname)


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.job_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    x, y = make_batch(args.model, rank)
    rows = []
    for hook in args.hooks.split(","):
        model = build_model(args.model)
        n_params = sum(p.numel() for p in model.parameters())
        row: Dict[str, Any] = dict(hook=hook, params=n_params)
        diloco = DILOCO.get(hook)
        timed = diloco["sync_every"] if diloco else args.steps
        try:
            if diloco:
                import ddpx
                ddp = model
                opt = ddpx.optim.DiLoCo(torch.optim.SGD(model.parameters(), lr=1e-4), **diloco)
            else:
                ddp = register(hook, model)
                opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

            def one_step():
                opt.zero_grad(set_to_none=True)
                loss_of(args.model, ddp(x), y).backward()
                opt.step()

            for _ in range(diloco["sync_every"] if diloco else args.warmup):
                one_step()
            dist.barrier()
            times, t_sent = [], tx_bytes(ifname)
            for _ in range(timed):
                dist.barrier()
                t0 = time.perf_counter()
                one_step()
                times.append((time.perf_counter() - t0) * 1e3)
            if diloco:  # what is still in flight belongs to the timed steps' bytes
                opt.state_dict()
                dist.barrier()
                time.sleep(0.2)
            sent = (tx_bytes(ifname) - t_sent) / timed
            ms = statistics.mean(times) if diloco else statistics.median(times)
            row.update(status="ok", ms=ms, ms_all=times, ms_max=max(times), sent=sent)
            ddp = opt = None  # frees them (one_step above reads them by name)
        except Exception as exc:  # noqa: BLE001 - a hook's failure is its row's result
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, row)
        if rank == 0:
            mean_sent = [g.get("sent") for g in gathered]
            row["sent_per_rank"] = mean_sent
            if all(s is not None for s in mean_sent):
                row["sent"] = sum(mean_sent) / world
            rows.append(row)
            print(f"bench_network: {hook}: {row.get('status')} "
                  f"{row.get('ms', float('nan')):.1f} ms/step (longest "
                  f"{row.get('ms_max', float('nan')):.1f}), "
                  f"{row.get('sent', float('nan')) / 1e6:.2f} MB/step", flush=True)
    if rank == 0:
        print("BENCH_RESULT " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# The driver: clusters, cells, tables, the picture.
# ---------------------------------------------------------------------------------------------
def run_cell(nodes: int, rate: str, model: str, hooks: List[str], args) -> List[Dict[str, Any]]:
    import multinode
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"
    common = [os.path.abspath(__file__), "--worker", "--model", model, "--steps",
              str(args.steps), "--warmup", str(args.warmup), "--job-timeout",
              str(args.job_timeout)]
    groups = [[h for h in hooks if h not in ALONE]] + [[h] for h in hooks if h in ALONE]
    rows: List[Dict[str, Any]] = []
    for group in (g for g in groups if g):
        # A hook run alone may hang (torch's PowerSGD on DDP's buckets): its job gets the time
        # the group's steps need, not the whole job timeout.
        timeout = args.alone_timeout if group[0] in ALONE else args.job_timeout + 60
        with multinode.Cluster(nodes, rate=None if rate == "unlimited" else rate) as cluster:
            t0 = time.monotonic()
            try:
                results = cluster.torchrun(common + ["--hooks", ",".join(group)],
                                           timeout=timeout, env=env, python=args.python)
                outs = [r.stdout or "" for r in results]
                failed = [i for i, r in enumerate(results) if r.returncode != 0]
            except TimeoutError as exc:
                outs, failed = [str(exc)], list(range(nodes))
        found = None
        for out in outs:
            for line in out.splitlines():
                if line.startswith("BENCH_RESULT "):
                    found = json.loads(line[len("BENCH_RESULT "):])
        if found is not None:
            rows += found
        else:
            # The first line that says what went wrong (gloo's enforce, an abort, a Python
            # error), else the output's end.
            said = [ln.strip() for out in outs for ln in out.splitlines()
                    if any(k in ln for k in ("EnforceNotMet", "terminate called", "what():",
                                             "Error:", "Timed out"))]
            tail = said[0] if said else " ".join(" ".join(outs).split()[-40:])
            what = (f"hangs (killed after {timeout:.0f} s)" if "still runs" in " ".join(outs)
                    else f"crashes (nodes {failed} failed)")
            for h in group:
                rows.append(dict(hook=h, status=what, error=tail[-400:]))
        print(f"bench_network: {nodes} nodes, {rate}, {model}: {', '.join(group)} in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    return rows


def render(cells: List[Dict[str, Any]]) -> str:
    lines = []
    by_key: Dict[tuple, List[Dict[str, Any]]] = {}
    for c in cells:
        by_key.setdefault((c["model"], c["nodes"]), []).append(c)
    for (model, nodes), group in by_key.items():
        params = next((r["params"] for c in group for r in c["rows"] if "params" in r), 0)
        lines += [f"### {model} ({params / 1e6:.1f}M parameters), {nodes} nodes", "",
                  "ms per step (median), MB sent per rank per step, and the step's speed-up over "
                  "DDP's default allreduce at the same link speed", ""]
        rates = [c["rate"] for c in group]
        lines.append("| hook | " + " | ".join(rates) + " | MB/step |")
        lines.append("|---|" + "---:|" * (len(rates) + 1))
        hooks = [h for h in HOOKS if any(r["hook"] == h for c in group for r in c["rows"])]
        for h in hooks:
            cellv, mb = [], None
            for c in group:
                rows = {r["hook"]: r for r in c["rows"]}
                r, base = rows.get(h), rows.get("allreduce")
                if r is None:
                    cellv.append("")
                elif r.get("status") != "ok":
                    cellv.append(r["status"].split(" (")[0])
                else:
                    ratio = (f" ({base['ms'] / r['ms']:.2f}x)" if base and base.get("status") ==
                             "ok" and h != "allreduce" else "")
                    cellv.append(f"{r['ms']:.0f}{ratio}")
                    mb = r["sent"] / 1e6 if mb is None else mb
            lines.append(f"| {LABELS[h]} | " + " | ".join(cellv) + " | "
                         + (f"{mb:.2f}" if mb is not None else "") + " |")
        lines.append("")
    return "\n".join(lines)


def plot(cells: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(c["model"], c["nodes"]) for c in cells})
    # Two panels a row: four side by side are too small to read at a README's width.
    ncols = min(2, len(keys))
    nrows = (len(keys) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.6 * ncols, 4.6 * nrows + 1.0),
                             squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    speed = {c["rate"]: _gbit(c["rate"]) for c in cells}
    handles: Dict[str, Any] = {}
    for ax, (model, nodes) in zip(axes.flat, keys):
        group = [c for c in cells if c["model"] == model and c["nodes"] == nodes]
        for h in HOOKS:
            pts = [(speed[c["rate"]], r["ms"]) for c in group for r in c["rows"]
                   if r["hook"] == h and r.get("status") == "ok"]
            if not pts:
                continue
            pts.sort()
            style = dict(ls="--" if h.startswith("torch") else "-",
                         lw=2.4 if h in ("allreduce", "ddpx_powersgd4") else 1.4,
                         color="0.35" if h == "noop" else None, marker="o", ms=3)
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=LABELS[h],
                              **style)
            handles.setdefault(LABELS[h], line)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([0.5, 1, 2.5, 10, 40])
        ax.set_xticklabels(["0.5", "1", "2.5", "10", "unlimited"])
        ax.set_xlabel("link speed per node, Gbit/s (tc tbf; unlimited: a bare veth)")
        ax.set_ylabel("ms per training step (median)")
        params = next((r["params"] for c in group for r in c["rows"] if "params" in r), 0)
        ax.set_title(f"{model}, {params / 1e6:.1f}M parameters, {nodes} nodes (1 rank each)")
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=3,
               fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 1.1 / (4.6 * nrows + 1.0), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    p.add_argument("--hooks", default=",".join(HOOKS), help="comma-separated, of: "
                   + ", ".join(HOOKS))
    p.add_argument("--nodes", default="2,3")
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--steps", type=int, default=8, help="timed steps per hook")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per hook")
    p.add_argument("--job-timeout", type=float, default=900.0,
                   help="seconds a cell's job may take (also the group timeout)")
    p.add_argument("--alone-timeout", type=float, default=150.0,
                   help="seconds the job of a hook run alone (torch's PowerSGD on DDP's "
                   "buckets) may take before it counts as hung")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", default="out/bench_network")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="no run: the tables and the picture of these bench_network.json files "
                   "together (cells of later files replace earlier ones)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.merge:
        merged: Dict[tuple, Dict[str, Any]] = {}
        metas = []
        for path in args.merge:
            with open(path) as f:
                blob = json.load(f)
            metas.append(blob["meta"])
            for c in blob["cells"]:
                merged[(c["model"], c["nodes"], c["rate"])] = c
        order = {r: i for i, r in enumerate(RATES)}
        cells = sorted(merged.values(), key=lambda c: (c["model"] != "mlp", c["nodes"],
                                                       order.get(c["rate"], 99)))
        _write(args.out, dict(merged_from=args.merge, runs=metas), cells)
        return 0
    import multinode
    why = multinode.why_not_available()
    if why:
        print(f"bench_network: {why}", file=sys.stderr)
        return 2
    hooks = args.hooks.split(",")
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown:
        p.error(f"unknown hooks {unknown}; known: {HOOKS}")
    import torch
    cells: List[Dict[str, Any]] = []
    t_all = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    meta = dict(torch=torch.__version__, steps=args.steps, warmup=args.warmup,
                cores=os.cpu_count(), threads_per_rank=1, command=" ".join(sys.argv))
    for model in args.models.split(","):
        for nodes in (int(n) for n in args.nodes.split(",")):
            for rate in args.rates.split(","):
                rows = run_cell(nodes, rate, model, hooks, args)
                cells.append(dict(model=model, nodes=nodes, rate=rate, rows=rows))
                # After every cell: a run cut short keeps what it measured.
                meta["wall_s"] = time.monotonic() - t_all
                with open(os.path.join(args.out, "bench_network.json"), "w") as f:
                    json.dump(dict(meta=meta, cells=cells), f, indent=1)
    _write(args.out, meta, cells)
    print(f"bench_network: {len(cells)} cells in {meta['wall_s']:.0f} s")
    return 0


def _write(out: str, meta: Dict[str, Any], cells: List[Dict[str, Any]]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_network.json"), "w") as f:
        json.dump(dict(meta=meta, cells=cells), f, indent=1)
    md = render(cells)
    with open(os.path.join(out, "bench_network.md"), "w") as f:
        f.write(md)
    plot(cells, os.path.join(out, "bench_network.png"))
    print(md)
    print(f"bench_network: wrote {out}/bench_network.{{json,md,png}}")


if __name__ == "__main__":
    sys.exit(main())
