#!/usr/bin/env python3
"""Combines repeated runs of bench_hooks.py / bench_kernels.py (their --json files) into one
Markdown table: per figure, the median over runs and the range [min, max] of the runs.

    python3 benchmarks/summarize.py hooks benchmarks/results/cpu/hooks_run*.json
    python3 benchmarks/summarize.py kernels benchmarks/results/cpu/kernels_run*.json
    python3 benchmarks/summarize.py collectives benchmarks/results/cpu/collectives_run*.json
"""
import json
import statistics
import sys
from collections import defaultdict


def rng(vals, spec=".1f"):
    return (f"{format(statistics.median(vals), spec)} "
            f"[{format(min(vals), spec)}, {format(max(vals), spec)}]")


def hooks(paths):
    # (backend, world) -> config -> list of (median_ms, overhead_ms) over runs
    by_run = defaultdict(lambda: defaultdict(list))
    ratios = defaultdict(lambda: defaultdict(list))
    targets = defaultdict(lambda: defaultdict(list))
    infos = {}
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        for run in data["runs"]:
            key = (run["info"]["backend"], run["info"]["world_size"], run["info"]["device"])
            infos[key] = run["info"]
            for name, r in run["results"].items():
                by_run[key][name].append(r)
            for e in run["ratios"]:
                ratios[key][(e["torch"], e["ddpx"])].append(e)
            for t in run["targets"]:
                targets[key][(t["ddpx"], t["fp32_ref"])].append(t)
    for key, configs in by_run.items():
        i = infos[key]
        n = len(next(iter(configs.values())))
        print(f"\n#### {key[0]} x {key[1]} ranks on {key[2]}: {i['model']}, "
              f"batch {i['batch']}/rank, "
              f"{n} runs (median [min, max] over runs of each run's median step)\n")
        print("| config | hook | path | step ms | overhead vs ddpx noop, paired (ms) "
              "| overhead vs torch noop (ms) |")
        print("|---|---|---|---:|---:|---:|")
        for name, rs in configs.items():
            ov = [r.get("overhead_paired_ms", r["overhead_ms"]) for r in rs
                  if r["overhead_ms"] is not None]
            ovt = [r["overhead_vs_torch_noop_ms"] for r in rs
                   if r["overhead_vs_torch_noop_ms"] is not None]
            print(f"| {name} | {rs[0]['hook']} | {rs[0]['path']} | "
                  f"{rng([r['median_ms'] for r in rs])} | {rng(ov) if ov else '-'} | "
                  f"{rng(ovt) if ovt else '-'} |")
        print("\n| torch | ddpx | step ratio torch/ddpx | overhead ratio torch/ddpx |")
        print("|---|---|---:|---:|")
        for (t, d), es in ratios[key].items():
            ors = [e["overhead_ratio"] for e in es if e["overhead_ratio"] is not None]
            print(f"| {t} | {d} | {rng([e['step_ratio'] for e in es], '.2f')} | "
                  f"{rng(ors, '.2f') if len(ors) == len(es) else '- (overhead within noise)'} |")
        print("\ntarget (16-bit ddpx overhead <= fp32 allreduce overhead): per-step difference "
              "16-bit - fp32 (ms, paired per round; median [min, max] over runs), runs where met")
        for (d, ref), ts in targets[key].items():
            diffs = [t["paired_diff_ms"] for t in ts if "paired_diff_ms" in t]
            met = sum(t["met"] for t in ts)
            print(f"  {d} - {ref}: {rng(diffs) if diffs else '-'} ms, met in {met}/{len(ts)}")


def kernels(paths):
    rows = defaultdict(list)
    info = None
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        info = data["info"]
        for r in data["rows"]:
            rows[(r["op"], r["dtype"], r["mi"])].append(r)
    cuda = info["device"].startswith("cuda")
    print(f"\n{info['device']} ({info['device_name']}), torch {info['torch']}, "
          f"{info['threads']} torch thread(s), {len(paths)} runs: median [min, max] over runs\n")
    head = "| op | dtype | elements | torch GB/s | ddpx GB/s | torch/ddpx (wall) |"
    sep = "|---|---|---:|---:|---:|---:|"
    if cuda:
        head += " copy GB/s | ddpx / copy |"
        sep += "---:|---:|"
    else:
        head += " torch/ddpx (CPU time) |"
        sep += "---:|"
    print(head)
    print(sep)
    for (op, dt, mi), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        line = (f"| {op} | {dt} | {mi:g}M | {rng([r['torch_gbs'] for r in rs])} | "
                f"{rng([r['ddpx_gbs'] for r in rs])} | {rng([r['ratio'] for r in rs], '.2f')} |")
        if cuda:
            line += (f" {rng([r['copy_gbs'] for r in rs], '.0f')} | "
                     f"{rng([r['ddpx_frac_copy'] for r in rs], '.2f')} |")
        else:
            line += f" {rng([r['ratio_cpu'] for r in rs], '.2f')} |"
        print(line)


def collectives(paths):
    cells = defaultdict(list)
    for p in paths:
        with open(p) as f:
            for r in json.load(f)["rows"]:
                cells[(r["mi"], r["fp32_mb"], r["case"])].append(r["median_ms"])
    cases = list(dict.fromkeys(k[2] for k in cells))
    sizes = sorted(dict.fromkeys((k[0], k[1]) for k in cells))
    print(f"\nms per call (slowest rank), {len(paths)} runs: median [min, max] over runs\n")
    print("| elements/rank (fp32 MB) | " + " | ".join(cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for mi, mb in sizes:
        print(f"| {mi:g}M ({mb:.0f}) | "
              + " | ".join(rng(cells[(mi, mb, c)]) for c in cases) + " |")


if __name__ == "__main__":
    modes = {"hooks": hooks, "kernels": kernels, "collectives": collectives}
    if len(sys.argv) < 3 or sys.argv[1] not in modes:
        raise SystemExit(__doc__)
    modes[sys.argv[1]](sys.argv[2:])
