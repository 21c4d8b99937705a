#!/usr/bin/env python3
"""ZeroRedundancyOptimizer: torch's (torch.distributed.optim) against ddpx's (ddpx.optim), step
time, optimizer-state memory, state-dict consolidation and many small tensors, on Gloo ranks on
the CPU.

--impls names the two implementations compared, "A,B", printed as A | B | B/A: the default
"torch,ddpx" compares torch's class with ddpx's. "torch,torch" runs torch's class in both slots
(separate model copies and optimizers, as for torch,ddpx), which checks the ratio machinery: its
ratios should be ~1.00 within the machine's noise; a single "torch" runs one slot, no ratios.
ddpx is imported only when named (lazily, in the ranks).

Sections (--sections, all by default), 2 Gloo ranks (--world-size), 1 torch thread per rank:

1. steps: the optimizer step alone (local update + parameter exchange; no forward or backward:
   every parameter's .grad is pre-set to fixed random values, the same on every rank, re-attached
   before each step outside the timed region), on --layers x nn.Linear(--width, --width) (default
   4 x 4096: 67.1M fp32 parameters), Adam(lr=1e-3), for parameters_as_bucket_view False and True
   (--bucket-views). Each slot has its own copy of the model, gradients and optimizer in the same
   rank processes; after one untimed step each (it allocates Adam's state) they run interleaved:
   R rounds (--rounds) x K steps (--steps) of each slot, the order rotated every round, every
   step after a barrier. A step's time is the slowest rank's; a round's figure is the median of
   its K steps; reported: the median over rounds, B/A of those medians and the median of the
   per-round ratios B/A (which cancels slow drift; the target checks use it) and their range.
   Target: ddpx <= 0.7 x torch.

2. memory: optimizer-state memory per rank. RSS is per process, so every implementation runs
   in its own fresh set of rank processes (not interleaved), with MALLOC_MMAP_THRESHOLD_=131072
   (read by glibc at start-up) so that every buffer of 128 KiB or more is mmap'ed and given back
   to the OS when freed (glibc's default dynamic threshold keeps freed blocks of up to 32 MiB in
   the heap, where RSS still counts them). Per rank, from /proc/self/status:
     * state growth: VmRSS after the first step (the step that allocates Adam's exp_avg /
       exp_avg_sq in torch) - VmRSS before the optimizer is constructed (an implementation may
       allocate its state, or flat buffers, in the constructor), compared with unsharded Adam's
       state (2 x parameter bytes) and with its 1/W share (what ZeRO should hold per rank); the
       first step's own part is printed too. Before it, a throwaway optimizer of the same class
       on a tiny model takes a step and consolidates, so that one-time lazy imports and
       initialisation (~110 MiB for torch 2.11's first optimizer) are not counted;
     * peak extra of a later step: before the step the process's peak RSS is reset
       (`echo 5 > /proc/self/clear_refs`: VmHWM := VmRSS) and VmRSS read; after it
       extra = VmHWM - VmRSS(before): the step's peak extra resident memory, whatever allocated
       it (the update's temporaries, the exchange's buffers, Gloo, Python). Median over
       --mem-steps later steps, max over ranks. Where clear_refs cannot be written, a thread
       samples VmRSS every ~1 ms instead (the output says which method ran; sampling can miss
       short peaks);
     * consolidation: the same probe around consolidate_state_dict(to=0) on section 3's model:
       the target rank's peak extra and retained (VmRSS after - before) memory relative to the
       final consolidated state's size (the whole model's optimizer state, 2 x parameter
       bytes), and the senders' peak extra. The first consolidation of a fresh process, so no
       earlier consolidated copy is freed inside the measured call.
   The grads stay attached (they are part of the baseline, as in training).

3. consolidate: consolidate_state_dict(to=0) time vs one flat dist.broadcast, on the same
   group from rank 1 to rank 0, of the model's whole optimizer state's bytes (2 x parameter
   bytes, one preallocated uint8 tensor); the slots and the broadcast interleaved in rounds
   (--consolidate-rounds), Adam(lr=1e-3) after one step, bucket_view=False. Its model is
   --layers x nn.Linear(--consolidate-width, ...), by default 2048 wide (16.8M params, 128 MiB
   of state), not section 1's 4096: torch's consolidation pickles each rank's state and turns
   the bytes into a tensor with torch.ByteTensor(bytearray), element by element in Python, so on
   the 67M-parameter model it takes tens of seconds per call (orders of magnitude more than the
   flat broadcast) and gigabytes of extra memory on the sender; --consolidate-width 4096
   measures section 1's model (section 1's bucket_view=False optimizers, after their steps).
   (A consolidation moves only the other ranks' shares, (W-1)/W of the bytes; a flat broadcast
   of that share is printed too, for information.) Time = slowest rank. Target: ddpx <= 2 x the
   flat broadcast (median per-round ratio).

4. small: --small-layers x nn.Linear(--small-width, --small-width) (default 128 x 64: 256
   tensors, 532K parameters), SGD(lr=0.01, momentum=0.9): ZeRO's step (bucket view False and
   True) vs an unsharded torch.optim.SGD step over the whole model on every rank (no exchange);
   --small-rounds x --small-steps, interleaved as in section 1. Target: ddpx's ZeRO no slower
   than unsharded SGD (median per-round ratio <= 1, for each bucket view).

verify (not timed): slot B's parameters after section 1's steps equal slot A's within 1e-6
relative (max |B - A| / max |A|), both bucket views; on rank 0, slot B's consolidated
state_dict() has slot A's keys and its tensors equal within 1e-6 relative; in section 4 every
ZeRO configuration's parameters equal the unsharded SGD's within 1e-6 relative. A failed check
makes the exit status 1.

Usage (CPU, 2 Gloo ranks; ddpx from the CMake build tree; ~2.5 min on 2 cores, --quick ~25 s
(quiet machine) on a 4 x Linear(1024,1024) model, consolidation on 4 x Linear(512,512), for
smoke tests: its millisecond steps are at the mercy of any other load). The tables go to stdout,
the raw results (JSON) only with --json:
    PYTHONPATH=build/python .venv/bin/python benchmarks/bench_zero.py \\
        --json benchmarks/results/zero.json
    .venv/bin/python benchmarks/bench_zero.py --impls torch,torch --quick    # no ddpx needed
"""
import argparse
import datetime
import gc
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bench_common as bc  # noqa: E402

MMAP_THRESHOLD = "131072"
SECTIONS = ("steps", "memory", "consolidate", "small")
STEP_TARGET = 0.7          # ddpx step time <= 0.7 x torch's
CONSOLIDATE_TARGET = 2.0   # ddpx consolidate_state_dict <= 2 x a flat broadcast of the state
VERIFY_RTOL = 1e-6
FLAT = "flat_bcast"
FLAT_SHARE = "flat_bcast_share"
UNSHARDED = "unsharded_sgd"
MIB = 2 ** 20


# ---- implementations ------------------------------------------------------------------------
def zero_class(impl: str):
    """The ZeroRedundancyOptimizer class of `impl` (ddpx imported only here)."""
    if impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer
    import ddpx.optim  # noqa: F401  (lazy: ddpx's class may not exist yet)
    return ddpx.optim.ZeroRedundancyOptimizer


def slot_labels(impls: List[str]) -> List[str]:
    """Column labels: the impl names, a repeated one suffixed (torch, torch#2)."""
    labels = []
    for i in impls:
        label = i
        while label in labels:
            label = f"{i}#{len([x for x in labels if x.split('#')[0] == i]) + 1}"
        labels.append(label)
    return labels


# ---- memory probes --------------------------------------------------------------------------


def _rss() -> int:
    return bc.status_kib("VmRSS")["VmRSS"] * 1024


class PeakProbe:
    """Peak extra resident memory of a call (bytes): VmHWM after clear_refs 5, or sampling."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "/proc/self/clear_refs 5 + VmHWM"
        except OSError:
            self.method = "VmRSS sampled every ~1 ms (clear_refs not writable)"

    def start(self) -> None:
        if self.method.startswith("/proc"):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            self.rss0 = _rss()
            return
        self.rss0 = _rss()
        self.peak = self.rss0
        self.stop_evt = threading.Event()

        def sample():
            while not self.stop_evt.is_set():
                self.peak = max(self.peak, _rss())
                time.sleep(0.001)
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()

    def stop(self) -> Dict[str, int]:
        if self.method.startswith("/proc"):
            s = bc.status_kib("VmRSS", "VmHWM")
            rss, peak = s["VmRSS"] * 1024, s["VmHWM"] * 1024
        else:
            self.stop_evt.set()
            self.thread.join()
            rss = _rss()
            peak = max(self.peak, rss)
        return {"extra": peak - self.rss0, "retained": rss - self.rss0, "base": self.rss0}


# ---- models ---------------------------------------------------------------------------------
def build_params(layers: int, width: int) -> List[torch.Tensor]:
    """Parameters of layers x nn.Linear(width, width), the same on every rank (seed 0)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return [p for p in model.parameters()]


def make_grads(params: List[torch.Tensor]) -> List[torch.Tensor]:
    """Fixed random gradients, the same on every rank (as after DDP's allreduce)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]


class Slot:
    """One optimizer over its own copy of the parameters and gradients."""

    def __init__(self, base: List[torch.Tensor], grads: List[torch.Tensor], make_opt):
        self.params = [torch.nn.Parameter(p.detach().clone()) for p in base]
        self.grads = [g.clone() for g in grads]
        self.attach()
        self.opt = make_opt(self.params) if make_opt is not None else None

    def attach(self) -> None:
        """(Re-)attach the fixed gradients (an implementation may drop the ones it does not own)."""
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def step(self) -> None:
        self.opt.step()


def make_zero(cls, optim_class, bucket_view: bool, **defaults):
    return lambda params: cls(params, optim_class, parameters_as_bucket_view=bucket_view,
                              **defaults)


def rel_err(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    num = max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))
    den = max(float(y.detach().abs().max()) for y in b)
    return num / den if den else num


# ---- timing ---------------------------------------------------------------------------------
def time_rounds(slots: Dict[str, Slot], rounds: int, steps: int) -> Dict[str, List[List[float]]]:
    """rounds x steps of every slot, order rotated per round, a barrier before each step.
    Returns {name: [[ms per step] per round]} (this rank's)."""
    names = list(slots)
    times: Dict[str, List[List[float]]] = {n: [[] for _ in range(rounds)] for n in names}
    with torch.no_grad():
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                for _ in range(steps):
                    slots[n].attach()
                    dist.barrier()
                    t0 = time.perf_counter()
                    slots[n].step()
                    times[n][r].append((time.perf_counter() - t0) * 1e3)
    return times


def time_calls(fns: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, List[List[float]]]:
    """rounds x 1 call of every fn, order rotated per round, a barrier before each call."""
    names = list(fns)
    times: Dict[str, List[List[float]]] = {n: [[] for _ in range(rounds)] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            fns[n]()
            times[n][r].append((time.perf_counter() - t0) * 1e3)
    return times


def job_stats(gathered: List[Dict[str, List[List[float]]]], name: str) -> dict:
    """Slowest rank per step; median per round; median over rounds."""
    rounds = len(gathered[0][name])
    per_round = [[max(g[name][r][i] for g in gathered) for i in range(len(gathered[0][name][r]))]
                 for r in range(rounds)]
    flat = [t for rr in per_round for t in rr]
    round_medians = [statistics.median(rr) for rr in per_round]
    return {"median_ms": statistics.median(round_medians), "round_medians_ms": round_medians,
            "min_ms": min(flat), "max_ms": max(flat), "steps": len(flat),
            "rank_medians_ms": [statistics.median([t for rr in g[name] for t in rr])
                                for g in gathered]}


def ratio(b: dict, a: dict) -> dict:
    """b / a: of the medians, the per-round ratios and their median."""
    per_round = [x / y for x, y in zip(b["round_medians_ms"], a["round_medians_ms"])]
    return {"ratio_of_medians": b["median_ms"] / a["median_ms"],
            "median_round_ratio": statistics.median(per_round), "round_ratios": per_round}


def gather(obj, world: int) -> list:
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def check(ok: bool, detail: str) -> dict:
    return {"ok": bool(ok), "detail": detail}


def compare_state_dicts(sa: dict, sb: dict) -> dict:
    """B's consolidated state_dict against A's: same keys, tensors within VERIFY_RTOL."""
    ka, kb = set(sa["state"]), set(sb["state"])
    if ka != kb:
        return check(False, f"state keys differ: {sorted(ka ^ kb)[:8]}")
    worst = 0.0
    types = set()  # entries a tensor in one and a Python number in the other (not a failure)
    for k in sa["state"]:
        ea, eb = sa["state"][k], sb["state"][k]
        if set(ea) != set(eb):
            return check(False, f"state[{k}] keys {sorted(ea)} vs {sorted(eb)}")
        for name, va in ea.items():
            vb = eb[name]
            if torch.is_tensor(va) or torch.is_tensor(vb):
                if torch.is_tensor(va) != torch.is_tensor(vb):
                    types.add(f"{name}: {type(va).__name__} vs {type(vb).__name__}")
                va, vb = torch.as_tensor(va).double(), torch.as_tensor(vb).double()
                if va.shape != vb.shape:
                    return check(False, f"state[{k}][{name}] shape {tuple(va.shape)} vs "
                                        f"{tuple(vb.shape)}")
                den = float(va.abs().max()) if va.numel() else 0.0
                err = float((va - vb).abs().max()) if va.numel() else 0.0
                worst = max(worst, err / den if den else err)
            elif va != vb:
                return check(False, f"state[{k}][{name}] {va!r} vs {vb!r}")
    ga = [{k: v for k, v in g.items() if k != "params"} for g in sa["param_groups"]]
    gb = [{k: v for k, v in g.items() if k != "params"} for g in sb["param_groups"]]
    same_groups = [g.get("lr") for g in ga] == [g.get("lr") for g in gb]
    return check(worst <= VERIFY_RTOL and same_groups,
                 f"{len(ka)} entries, max rel err {worst:.2g}"
                 + ("" if same_groups else f"; param_groups lr {ga} vs {gb}")
                 + (f"; types differ: {sorted(types)}" if types else ""))


# ---- the timing ranks (sections 1, 3, 4) -----------------------------------------------------
def worker(rank: int, args, backend: str, world: int, port: int, out_path: str) -> None:
    try:
        if args.mem_impl:
            _mem_worker(rank, args, backend, world, port, out_path)
        else:
            _worker(rank, args, backend, world, port, out_path)
    except Exception:
        traceback.print_exc()
        raise


def _worker(rank, args, backend, world, port, out_path):
    bc.init_rank(rank, args, backend, world, port)
    labels = args.labels
    classes = {lab: zero_class(impl) for lab, impl in zip(labels, args.impl_list)}
    out: dict = {"steps": {}, "verify": {}}
    t_start = time.perf_counter()

    consolidate = "consolidate" in args.section_list
    if "steps" in args.section_list:
        base = build_params(args.layers, args.width)
        grads = make_grads(base)
        nparams = sum(p.numel() for p in base)
        for bv in args.views:
            slots = adam_slots(classes, labels, base, grads, bv, args.optimizer)
            g = gather(time_rounds(slots, args.rounds, args.steps), world)
            st = {lab: job_stats(g, lab) for lab in labels}
            if len(labels) == 2:
                st["ratio"] = ratio(st[labels[1]], st[labels[0]])
            out["steps"][str(bv)] = st
            if len(labels) == 2:
                err = rel_err(slots[labels[1]].params, slots[labels[0]].params)
                errs = gather(err, world)
                out["verify"][f"params_bucket_view_{bv}"] = check(
                    max(errs) <= VERIFY_RTOL, f"{labels[1]} vs {labels[0]} after the same "
                    f"steps: max rel err {max(errs):.2g} (max over ranks)")
            if consolidate and not bv and args.consolidate_width == args.width:
                out["consolidate"] = consolidate_section(args, slots, labels, nparams, rank,
                                                         world, out["verify"])
            del slots
            gc.collect()
        del base, grads
        gc.collect()
        out["params"] = nparams
    if consolidate and "consolidate" not in out:  # its own model (--consolidate-width)
        base = build_params(args.layers, args.consolidate_width)
        grads = make_grads(base)
        slots = adam_slots(classes, labels, base, grads, False)
        out["consolidate"] = consolidate_section(args, slots, labels,
                                                 sum(p.numel() for p in base), rank, world,
                                                 out["verify"])
        del base, grads, slots
        gc.collect()

    if "small" in args.section_list:
        out["small"] = small_section(args, classes, labels, world, out["verify"])

    if rank == 0:
        out["wall_s"] = time.perf_counter() - t_start
        bc_json_dump(out, out_path)
    dist.barrier()
    dist.destroy_process_group()


def adam_slots(classes, labels, base, grads, bv: bool, optimizer: str = "Adam"
               ) -> Dict[str, Slot]:
    """One ZeRO slot per label over copies of base with torch.optim.<optimizer>(lr=1e-3) (Adam
    unless --optimizer names another), after one step (the state exists)."""
    cls = getattr(torch.optim, optimizer)
    slots = {lab: Slot(base, grads, make_zero(classes[lab], cls, bv, lr=1e-3))
             for lab in labels}
    with torch.no_grad():
        for s in slots.values():
            s.step()
    return slots


def consolidate_section(args, slots, labels, nparams, rank, world, verify) -> dict:
    state_bytes = 2 * nparams * 4  # exp_avg + exp_avg_sq, fp32
    src = 1 % world
    flat = torch.zeros(state_bytes, dtype=torch.uint8)
    share = torch.zeros(state_bytes * (world - 1) // world, dtype=torch.uint8)
    fns: Dict[str, Callable[[], None]] = {
        lab: (lambda o=slots[lab].opt: o.consolidate_state_dict(to=0)) for lab in labels}
    fns[FLAT] = lambda: dist.broadcast(flat, src=src)
    fns[FLAT_SHARE] = lambda: dist.broadcast(share, src=src)
    g = gather(time_calls(fns, args.consolidate_rounds), world)
    st = {n: job_stats(g, n) for n in fns}
    for lab in labels:
        st[lab]["vs_flat"] = ratio(st[lab], st[FLAT])
    if len(labels) == 2:
        st["ratio"] = ratio(st[labels[1]], st[labels[0]])
        ok = None
        if rank == 0:
            try:
                sa = slots[labels[0]].opt.state_dict()
                sb = slots[labels[1]].opt.state_dict()
                ok = compare_state_dicts(sa, sb)
                del sa, sb
            except Exception as exc:  # a missing or broken state_dict() is a failed check
                ok = check(False, f"state_dict(): {type(exc).__name__}: {exc}")
        verify["consolidated_state_dict"] = gather(ok, world)[0]
    st["state_bytes"] = state_bytes
    st["params"] = nparams
    st["model"] = f"{args.layers} x nn.Linear({args.consolidate_width},{args.consolidate_width})"
    st["share_bytes"] = share.numel()
    st["src"] = src
    return st


def small_section(args, classes, labels, world, verify) -> dict:
    base = build_params(args.small_layers, args.small_width)
    grads = make_grads(base)
    kw = dict(lr=0.01, momentum=0.9)
    slots: Dict[str, Slot] = {}
    for bv in args.views:
        for lab in labels:
            slots[f"{lab}|{bv}"] = Slot(base, grads, make_zero(classes[lab], torch.optim.SGD,
                                                               bv, **kw))
    slots[UNSHARDED] = Slot(base, grads, lambda ps: torch.optim.SGD(ps, **kw))
    with torch.no_grad():
        for s in slots.values():
            s.step()
    g = gather(time_rounds(slots, args.small_rounds, args.small_steps), world)
    st = {n: job_stats(g, n) for n in slots}
    for n in slots:
        if n != UNSHARDED:
            st[n]["vs_unsharded"] = ratio(st[n], st[UNSHARDED])
            err = max(gather(rel_err(slots[n].params, slots[UNSHARDED].params), world))
            verify[f"small_params_{n}"] = check(
                err <= VERIFY_RTOL, f"vs unsharded SGD after the same steps: max rel err "
                                    f"{err:.2g} (max over ranks)")
    if len(labels) == 2:
        for bv in args.views:
            st[f"ratio|{bv}"] = ratio(st[f"{labels[1]}|{bv}"], st[f"{labels[0]}|{bv}"])
    st["params"] = sum(p.numel() for p in base)
    st["tensors"] = len(base)
    return st


# ---- the memory ranks (section 2): one implementation per fresh set of processes -------------
def _mem_worker(rank, args, backend, world, port, out_path):
    bc.init_rank(rank, args, backend, world, port)
    cls = zero_class(args.mem_impl)
    probe = PeakProbe()
    # Warm-up on a tiny model: the first optimizer of a process imports and initialises lazily
    # (~110 MiB of RSS for torch 2.11's first torch.optim.Adam), which is not optimizer state.
    tiny = build_params(2, 8)
    warm = Slot(tiny, make_grads(tiny), make_zero(cls, torch.optim.Adam, False, lr=1e-3))
    with torch.no_grad():
        warm.step()
    warm.opt.consolidate_state_dict(to=0)
    del tiny, warm
    gc.collect()
    base = build_params(args.layers, args.width)
    grads = make_grads(base)
    slot = Slot(base, grads, None)
    del base, grads
    gc.collect()
    res: dict = {"probe": probe.method}
    with torch.no_grad():
        dist.barrier()
        rss_pre = _rss()
        slot.opt = make_zero(cls, torch.optim.Adam, False, lr=1e-3)(slot.params)
        gc.collect()
        dist.barrier()
        probe.start()
        slot.step()
        m = probe.stop()
        m["with_ctor"] = _rss() - rss_pre
        res["first_step"] = m
        later = []
        for _ in range(args.mem_steps):
            slot.attach()
            gc.collect()
            dist.barrier()
            probe.start()
            slot.step()
            later.append(probe.stop())
        res["later_steps"] = later
    if args.consolidate_width != args.width:  # its own model, as in section 3
        del slot
        gc.collect()
        base = build_params(args.layers, args.consolidate_width)
        grads = make_grads(base)
        slot = Slot(base, grads, make_zero(cls, torch.optim.Adam, False, lr=1e-3))
        del base, grads
        with torch.no_grad():
            slot.step()
    gc.collect()
    dist.barrier()
    probe.start()
    slot.opt.consolidate_state_dict(to=0)
    res["consolidate"] = probe.stop()
    g = gather(res, world)
    if rank == 0:
        bc_json_dump({"ranks": g}, out_path)
    dist.barrier()
    dist.destroy_process_group()


def bc_json_dump(obj, path: str) -> None:
    import json
    with open(path, "w") as f:
        json.dump(obj, f)


def memory_summary(ranks: List[dict], nparams: int, cons_nparams: int, world: int) -> dict:
    unsharded = 2 * nparams * 4
    cons_state = 2 * cons_nparams * 4
    growth = [r["first_step"]["with_ctor"] for r in ranks]
    step_only = [r["first_step"]["retained"] for r in ranks]
    later = [statistics.median(s["extra"] for s in r["later_steps"]) for r in ranks]
    later_max = [max(s["extra"] for s in r["later_steps"]) for r in ranks]
    cons = [r["consolidate"] for r in ranks]
    return {
        "unsharded_state_bytes": unsharded, "share_bytes": unsharded / world,
        "growth_bytes": growth, "growth_max": max(growth),
        "first_step_growth_bytes": step_only, "first_step_growth_max": max(step_only),
        "growth_vs_unsharded": max(growth) / unsharded,
        "growth_vs_share": max(growth) / (unsharded / world),
        "first_step_peak_extra": [r["first_step"]["extra"] for r in ranks],
        "later_step_extra_median": later, "later_step_extra": max(later),
        "later_step_extra_max": max(later_max),
        "consolidate_target_extra": cons[0]["extra"],
        "consolidate_target_retained": cons[0]["retained"],
        "consolidate_state_bytes": cons_state,
        "consolidate_target_extra_vs_state": cons[0]["extra"] / cons_state,
        "consolidate_target_retained_vs_state": cons[0]["retained"] / cons_state,
        "consolidate_sender_extra": max([c["extra"] for c in cons[1:]] or [0]),
        "probe": ranks[0]["probe"],
    }


# ---- output ---------------------------------------------------------------------------------
def mib(b: float) -> str:
    return f"{b / MIB:.1f}"


def target_line(what: str, value: Optional[float], limit: float, labels: List[str],
                impls: List[str]) -> str:
    if value is None:
        return ""
    met = "met" if value <= limit else "MISSED"
    note = "" if impls == ["torch", "ddpx"] else \
        f" [--impls {','.join(impls)}: not ddpx vs torch, the ratio machinery only]"
    return f"target {what} <= {limit:g}: {value:.3f} -> {met}{note}"


def render(run: dict) -> str:
    i = run["info"]
    labels, impls = i["labels"], i["impls"]
    two = len(labels) == 2
    L = []
    L.append(f"### ZeroRedundancyOptimizer: {i['backend']} x {i['world_size']} ranks on cpu "
             f"({i['device_name']}), torch {i['torch']}, {i['threads_per_rank']} thread(s)/rank")
    L.append("")
    L.append("slots: " + ", ".join(
        f"{lab} = {'torch.distributed.optim' if imp == 'torch' else 'ddpx.optim'}."
        f"ZeroRedundancyOptimizer" for lab, imp in zip(labels, impls))
        + (f"; ratio = {labels[1]}/{labels[0]}" if two else ""))
    if i.get("ddpx"):
        L.append(f"ddpx from {i['ddpx']}")
    res = run["results"]
    P = res.get("params")
    if P:
        L.append(f"model: {i['layers']} x nn.Linear({i['width']},{i['width']}) = {P / 1e6:.1f}M "
                 f"fp32 params ({mib(P * 4)} MiB), {i.get('optimizer', 'Adam')}(lr=1e-3) in "
                 f"the steps section; unsharded Adam state "
                 f"{mib(2 * P * 4)} MiB")
    L.append("")

    def row(name, d, key="median_ms", fmt_=".1f"):
        cells = [format(d[lab][key], fmt_) for lab in labels]
        if two:
            r = d["ratio"]
            cells += [f"{r['ratio_of_medians']:.3f}", f"{r['median_round_ratio']:.3f}",
                      f"{min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f}"]
        return [name] + cells

    hdr_ratio = [f"{labels[1]}/{labels[0]}", "median per-round ratio",
                 "per-round ratios min-max"] if two else []
    if res["steps"]:
        L.append(f"#### 1. step time, ms (optimizer step only: local update + parameter exchange; "
                 f"{i['rounds']} rounds x {i['steps']} steps; slowest rank per step, median per "
                 f"round, median over rounds)")
        L.append("")
        rows = [row(f"parameters_as_bucket_view={bv}", d) for bv, d in res["steps"].items()]
        L += table(["config"] + [f"{lab} ms" for lab in labels] + hdr_ratio,
                   "l" + "r" * (len(labels) + len(hdr_ratio)), rows)
        if two:
            for bv, d in res["steps"].items():
                L.append(target_line(f"step (bucket_view={bv}) {labels[1]}/{labels[0]}, median "
                                     f"per-round ratio", d["ratio"]["median_round_ratio"],
                                     STEP_TARGET, labels, impls))
        L.append("")
    if run.get("memory"):
        M = run["memory"]
        any_m = next(iter(M.values()))
        L.append(f"#### 2. optimizer-state memory per rank (fresh rank processes per "
                 f"implementation; MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}; peak probe: "
                 f"{any_m['probe']}; max over ranks unless stated)")
        L.append("")
        L.append(f"unsharded Adam state {mib(any_m['unsharded_state_bytes'])} MiB (2 x params), "
                 f"1/{i['world_size']} share {mib(any_m['share_bytes'])} MiB; consolidation "
                 f"probe on {i['layers']} x nn.Linear({i['consolidate_width']},"
                 f"{i['consolidate_width']}): final state "
                 f"{mib(any_m['consolidate_state_bytes'])} MiB")
        L.append("")
        mlabels = [lab for lab in labels if lab in M]
        mtwo = len(mlabels) == 2

        def mrow(name, key, f=mib, rat=True):
            cells = [f(M[lab][key]) for lab in mlabels]
            if mtwo:
                a, b = M[mlabels[0]][key], M[mlabels[1]][key]
                cells.append(f"{b / a:.3f}" if rat and a else "-")
            return [name] + cells
        ratio_f = lambda x: f"{x:.3f}"  # noqa: E731
        rows = [
            mrow("RSS growth, construction + first step, MiB", "growth_max"),
            mrow("  / unsharded Adam state", "growth_vs_unsharded", ratio_f),
            mrow(f"  / 1/{i['world_size']} share", "growth_vs_share", ratio_f),
            mrow("  of which the first step, MiB", "first_step_growth_max"),
            mrow("peak extra of a later step, MiB (median over steps)", "later_step_extra"),
            mrow("consolidate: target rank peak extra, MiB", "consolidate_target_extra"),
            mrow("  / final state size", "consolidate_target_extra_vs_state", ratio_f),
            mrow("consolidate: target rank retained, MiB", "consolidate_target_retained"),
            mrow("  / final state size", "consolidate_target_retained_vs_state", ratio_f),
            mrow("consolidate: sender peak extra, MiB", "consolidate_sender_extra"),
        ]
        L += table([""] + mlabels + ([f"{mlabels[1]}/{mlabels[0]}"] if mtwo else []),
                   "l" + "r" * (len(mlabels) + mtwo), rows)
        L.append("")
        L.append("per rank, RSS growth (construction + first step) MiB: " + "; ".join(
            f"{lab} " + ", ".join(mib(x) for x in M[lab]["growth_bytes"]) for lab in mlabels))
        L.append("")
    if res.get("consolidate"):
        C = res["consolidate"]
        L.append(f"#### 3. consolidate_state_dict(to=0), ms ({C['model']} = "
                 f"{C['params'] / 1e6:.1f}M params, Adam state {mib(C['state_bytes'])} MiB; "
                 f"{i['consolidate_rounds']} rounds; slowest rank; flat = one dist.broadcast "
                 f"of {mib(C['state_bytes'])} MiB (the whole optimizer state) from rank "
                 f"{C['src']} to the group)")
        L.append("")
        cols = labels + [FLAT]
        cells = [f"{C[n]['median_ms']:.1f}" for n in cols]
        rows = [["ms"] + cells + ([f"{C['ratio']['ratio_of_medians']:.3f}"] if two else []),
                ["/ flat broadcast"] + [f"{C[lab]['vs_flat']['ratio_of_medians']:.3f}"
                                        for lab in labels] + ["1.000"] + ([""] if two else [])]
        L += table([""] + [f"{lab} consolidate" for lab in labels] + ["flat broadcast"]
                   + ([f"{labels[1]}/{labels[0]}"] if two else []),
                   "l" + "r" * (len(cols) + two), rows)
        L.append(f"(info: a flat broadcast of the other ranks' share, {mib(C['share_bytes'])} "
                 f"MiB, the bytes a consolidation must move: {C[FLAT_SHARE]['median_ms']:.1f} ms)")
        if two:
            L.append(target_line(f"consolidate {labels[1]}/flat broadcast, median per-round "
                                 f"ratio", C[labels[1]]["vs_flat"]["median_round_ratio"],
                                 CONSOLIDATE_TARGET, labels, impls))
        L.append("")
    if res.get("small"):
        S = res["small"]
        L.append(f"#### 4. many small tensors: {i['small_layers']} x nn.Linear({i['small_width']},"
                 f"{i['small_width']}) = {S['tensors']} tensors, {S['params'] / 1e3:.0f}K params, "
                 f"SGD(lr=0.01, momentum=0.9); {i['small_rounds']} rounds x {i['small_steps']} "
                 f"steps; ms per step (slowest rank, median over rounds)")
        L.append("")
        rows = []
        for bv in i["views"]:
            rows.append([f"ZeRO bucket_view={bv}"]
                        + [f"{S[f'{lab}|{bv}']['median_ms']:.2f}" for lab in labels]
                        + [f"{S[UNSHARDED]['median_ms']:.2f}"]
                        + [f"{S[f'{lab}|{bv}']['vs_unsharded']['ratio_of_medians']:.2f}"
                           for lab in labels]
                        + ([f"{S[f'ratio|{bv}']['ratio_of_medians']:.3f}",
                            f"{S[f'ratio|{bv}']['median_round_ratio']:.3f}"] if two else []))
        L += table(["config"] + [f"{lab} ZeRO ms" for lab in labels] + ["unsharded SGD ms"]
                   + [f"{lab} / unsharded" for lab in labels]
                   + ([f"{labels[1]}/{labels[0]}", "median per-round ratio"] if two else []),
                   "l" + "r" * (2 * len(labels) + 1 + 2 * two), rows)
        L.append("unsharded = torch.optim.SGD over the whole model on every rank, no exchange")
        if two:
            for bv in i["views"]:
                L.append(target_line(
                    f"small (bucket_view={bv}) {labels[1]} ZeRO/unsharded SGD, median per-round "
                    f"ratio", S[f"{labels[1]}|{bv}"]["vs_unsharded"]["median_round_ratio"],
                    1.0, labels, impls))
        L.append("")
    if run["verify"]:
        L.append("verify:")
        for name, c in run["verify"].items():
            L.append(f"  [{'ok' if c['ok'] else 'FAIL'}] {name}: {c['detail']}")
        L.append("")
    L.append(f"(wall {i['wall_s']:.0f} s, {i['date_utc']} UTC, load average "
             f"{', '.join(f'{x:.1f}' for x in i['loadavg'])})")
    return "\n".join(L) + "\n"


def table(header: List[str], align: str, rows) -> List[str]:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


# ---- the launching process ------------------------------------------------------------------
QUICK = dict(layers=4, width=1024, rounds=3, steps=2, consolidate_width=512,
             consolidate_rounds=3, small_layers=128, small_width=64, small_rounds=3,
             small_steps=5, mem_steps=2)
FULL = dict(layers=4, width=4096, rounds=5, steps=2, consolidate_width=2048,
            consolidate_rounds=3, small_layers=128, small_width=64, small_rounds=7,
            small_steps=10, mem_steps=2)


class _Fmt(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except None (those options name theirs, full and --quick)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Fmt)
    p.add_argument("--impls", default="torch,ddpx",
                   help="A,B (or A): the implementations, each torch or ddpx; printed A | B | B/A")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test (~25-50 s): {QUICK}; explicit options still win")
    p.add_argument("--world-size", type=int, default=2, help="Gloo ranks")
    p.add_argument("--optimizer", default="Adam",
                   help="the torch.optim class of the steps section (lr=1e-3): Adam (default), "
                        "or e.g. Adamax, Adadelta, Rprop, whose shard steps ddpx runs in its "
                        "elementwise kernels")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: default)")
    p.add_argument("--bucket-views", default="0,1",
                   help="parameters_as_bucket_view values (0/1) for sections 1 and 4")
    p.add_argument("--layers", type=int,
                   help=f"the models' Linear layers; default {FULL['layers']}")
    p.add_argument("--width", type=int, help=f"their width; default {FULL['width']} "
                                             f"(--quick {QUICK['width']})")
    p.add_argument("--rounds", type=int, help=f"section 1 rounds; default {FULL['rounds']} "
                                              f"(--quick {QUICK['rounds']})")
    p.add_argument("--steps", type=int, help=f"section 1 steps per slot per round; default "
                                             f"{FULL['steps']}")
    p.add_argument("--consolidate-width", type=int,
                   help=f"width of section 3's model (--layers x Linear) and of the "
                        f"consolidation memory probe; default {FULL['consolidate_width']} "
                        f"(--quick {QUICK['consolidate_width']}); = --width: section 1's "
                        f"optimizers (torch's consolidation of the 4096 model takes tens of "
                        f"seconds per call)")
    p.add_argument("--consolidate-rounds", type=int,
                   help=f"section 3 rounds; default {FULL['consolidate_rounds']}")
    p.add_argument("--mem-steps", type=int,
                   help=f"section 2 later steps probed; default {FULL['mem_steps']}")
    p.add_argument("--small-layers", type=int,
                   help=f"section 4 Linear layers; default {FULL['small_layers']}")
    p.add_argument("--small-width", type=int, help=f"default {FULL['small_width']}")
    p.add_argument("--small-rounds", type=int,
                   help=f"default {FULL['small_rounds']} (--quick {QUICK['small_rounds']})")
    p.add_argument("--small-steps", type=int,
                   help=f"default {FULL['small_steps']} (--quick {QUICK['small_steps']})")
    p.add_argument("--json", default="", help="write the raw results (JSON) to this file")
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    if not 1 <= len(args.impl_list) <= 2 or any(x not in ("torch", "ddpx")
                                                for x in args.impl_list):
        raise SystemExit(f"--impls: one or two of torch, ddpx (got {args.impls!r})")
    args.labels = slot_labels(args.impl_list)
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.section_list if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; choose from {SECTIONS}")
    args.views = [bool(int(v)) for v in args.bucket_views.split(",") if v.strip()]
    if args.world_size < 2:
        raise SystemExit("--world-size must be >= 2 (ZeRO over one rank shards nothing)")
    args.device = "cpu"  # bench_common.init_rank
    args.mem_impl = ""
    ddpx_path = None
    if "ddpx" in args.impl_list:  # fail here, not in the ranks
        try:
            import ddpx
            import ddpx.optim  # noqa: F401
            ddpx.optim.ZeroRedundancyOptimizer  # noqa: B018
            ddpx_path = os.path.dirname(ddpx.__file__)
        except (ImportError, AttributeError) as exc:
            raise SystemExit(f"cannot use ddpx.optim.ZeroRedundancyOptimizer ({exc}); "
                             "--impls torch,torch runs torch's class in both slots") from None
    backend, world = "gloo", args.world_size
    t0 = time.perf_counter()
    results: dict = {"steps": {}, "verify": {}}
    if any(s in args.section_list for s in ("steps", "consolidate", "small")):
        results = bc.spawn_run(worker, args, backend, world)
    memory = {}
    if "memory" in args.section_list:
        saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # inherited by the spawned ranks
        nparams = args.layers * (args.width * args.width + args.width)
        cons_nparams = args.layers * (args.consolidate_width * args.consolidate_width
                                      + args.consolidate_width)
        try:
            for lab, impl in zip(args.labels, args.impl_list):
                args.mem_impl = impl
                ranks = bc.spawn_run(worker, args, backend, world)["ranks"]
                memory[lab] = memory_summary(ranks, nparams, cons_nparams, world)
                memory[lab]["ranks"] = ranks
        finally:
            args.mem_impl = ""
            if saved is None:
                os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
        results.setdefault("params", nparams)
    info = {
        "backend": backend, "world_size": world, "torch": torch.__version__,
        "python": bc.platform.python_version(),
        "device_name": bc.platform.processor() or bc.platform.machine(),
        "threads_per_rank": args.threads or torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "impls": args.impl_list, "labels": args.labels,
        "sections": args.section_list, "views": [str(v) for v in args.views],
        "quick": args.quick, "ddpx": ddpx_path, "optimizer": args.optimizer,
        **{k: getattr(args, k) for k in FULL},
        "wall_s": time.perf_counter() - t0,
        "date_utc": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg": os.getloadavg(),
    }
    run = {"info": info, "results": results, "memory": memory,
           "verify": results.pop("verify", {})}
    print(render(run))
    if args.json:
        bc.write_json(args.json, [run])
        print(f"wrote {args.json}")
    return bc.report_failed([run])


if __name__ == "__main__":
    sys.exit(main())
