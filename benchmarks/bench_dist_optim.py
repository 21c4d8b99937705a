#!/usr/bin/env python3
"""RPC DistributedOptimizer step latency: ddpx's (owners step in C++, no GIL) vs torch's, its
functional path (torch's default for Adam: TorchScript up to torch 2.14, Python in 2.15) and its
Python path, with and without GIL contention on the owners.

3 workers on loopback (TensorPipe): worker0 trains, workers 1 and 2 own ``--tensors`` parameter
tensors between them (``--numel`` elements each). Each step: a distributed-autograd context, a
forward RPC to each owner (sum of p * x over its parameters), ``dist_autograd.backward``, then
``opt.step(context_id)``, which alone is timed. The optimizers are interleaved step by step
(rotating which goes first) on their own copies of the parameters, in one trainer process. The
"empty RPC" row is the baseline: after the same forward and backward, an RPC of the same shape
as ddpx's step (a builtin operator of two ints to each owner, all awaited) that does
nothing; what it costs, and how it grows, is the RPC transport's, not a step's.

``--forward python`` (default): the owners' forward is a Python function, as in most
model-parallel code; the graph it builds holds tensors whose Python objects torch frees with
the owner's GIL after the backward (on TensorPipe's threads among others), so under contention
the RPC transport itself slows down. ``--forward script``: the same forward in TorchScript (the
trainer holds an RRef to each owner's parameter list), so that the busy thread is the only
user of the owners' GIL and the timings show what contention does to the steps alone.

Contention ("busy" rows): each owner runs a Python thread that holds its GIL nearly all the time
without using the CPU (a loop of ``usleep`` called through ``ctypes.PyDLL``, which keeps the
GIL): what an owner whose Python threads hold the GIL (data loading, logging, an RPC handler in
Python) does to steps that need the GIL, without taking CPU from steps that do not (on this
2-core machine a CPU-burning thread per owner would measure the CPU share, not the GIL).
``--busy cpu`` uses a CPU-burning Python loop instead; ``--busy none`` starts nothing (a
control: the busy / quiet ratios it prints are the measurement's noise floor).
``--settle-ms`` waits between the backward pass and the timed step; ``--no-backward`` times
steps on contexts without gradients (the RPC and TorchScript path alone); ``--impls`` picks
the rows.

    python benchmarks/bench_dist_optim.py [--tensors 200] [--numel 4096] [--steps 60]
        [--forward python|script] [--busy gil|cpu|none] [--impls ddpx empty ...]
(ddpx importable: PYTHONPATH=build/python, or a pip install)
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import List

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.rpc import RRef

_PARAMS = {}
_BUSY = {}
# --impls names -> the rows' names
# torch's default for Adam is its functional optimizer: stepped in TorchScript up to torch 2.14,
# in Python from 2.15 on (torch dropped the scripted local optimizer; it steps under the owners'
# GIL like any other optimizer there). The row says which this torch has.
import torch.distributed.optim.optimizer as _torch_dist_optim  # noqa: E402

_TORCH_FUNCTIONAL = ("torch functional (TorchScript)"
                     if hasattr(_torch_dist_optim, "_ScriptLocalOptimizer")
                     else "torch functional (Python)")
_IMPLS = {"torchscript": _TORCH_FUNCTIONAL, "python": "torch Python", "ddpx": "ddpx C++",
          "empty": "empty RPC (baseline)"}


# ---- owner side -----------------------------------------------------------------------------
def _make_params(key, count, numel, seed):
    g = torch.Generator().manual_seed(seed)
    _PARAMS[key] = [torch.rand(numel, generator=g, requires_grad=True) for _ in range(count)]
    return _PARAMS[key]


def _param_rref(key, i):
    return _PARAMS[key][i]


def _forward(key, x):
    return sum((p * x).sum() for p in _PARAMS[key])


def _params_list_rref(key):
    return rpc.RRef(_PARAMS[key])


def _forward_script(params: RRef[List[torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The same forward as _forward, in TorchScript: no Python on the owner (--forward script)."""
    out = torch.zeros(())
    for p in params.local_value():
        out = out + (p * x).sum()
    return out


def _hold_gil(stop):
    usleep = ctypes.PyDLL(None).usleep  # PyDLL: the call keeps the GIL
    usleep.argtypes = [ctypes.c_uint]
    while not stop.is_set():
        usleep(20000)  # 20 ms with the GIL held, no CPU


def _burn_cpu(stop):
    x = 0
    while not stop.is_set():
        x += 1


def _busy_start(mode):
    stop = threading.Event()
    _BUSY["stop"] = stop
    if mode == "none":  # the control: "busy" blocks as quiet as the quiet ones
        return
    target = _hold_gil if mode == "gil" else _burn_cpu
    threading.Thread(target=target, args=(stop,), daemon=True).start()


def _busy_stop():
    _BUSY["stop"].set()


# ---- trainer ------------------------------------------------------------------------------
def _empty_step(owner_id: int, context_id: int) -> None:
    """Stands for the builtin no-op aten::_ddpx_rpc_noop (registered by ddpx._C) in rpc_async."""


# Compiled on import, so in every worker: an RPC names a TorchScript function by its
# qualified name, which the owner must have compiled too. (torch's own TorchScript row and
# --forward script only; ddpx's step and the baseline are builtin operator calls.)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch 2.x: TorchScript is deprecated
    _FORWARD_SCRIPT = torch.jit.script(_forward_script)


class _EmptyRpcStep:
    """The baseline row: what a step costs the trainer with nothing to do on the owners, the
    RPC of the same shape as ddpx's (a builtin operator of two ints, aten::_ddpx_rpc_noop, to
    each owner at once, all awaited) after the same forward and backward. Whatever grows here under
    contention is the RPC transport's, not the step's."""

    def __init__(self, owners):
        from ddpx import _compat
        self._owners = owners
        self._noop = _compat.rpc_builtin(_empty_step, "aten::_ddpx_rpc_noop")
        assert self._noop is not None, "torch's RPC builtin table cannot be extended here"

    def step(self, context_id):
        torch.futures.wait_all([rpc.rpc_async(f"worker{o}", self._noop, args=(o, context_id))
                                for o in self._owners])


class _NonScriptedAdam(torch.optim.Adam):
    """torch.optim.Adam under another name: torch's DistributedOptimizer has no TorchScript
    form for it, so it takes its Python path (what any optimizer without one gets)."""


def _worker(rank, world, init_file, args, out_file):
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

    import ddpx  # noqa: F401  (registers ddpx's operator on every worker)
    from ddpx.optim import DistributedOptimizer

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}", rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        half = args.tensors // 2
        # --impls name -> (DistributedOptimizer class, optimizer class); None: the empty RPC
        classes = {
            "torchscript": (TorchDistributedOptimizer, torch.optim.Adam),
            "python": (TorchDistributedOptimizer, _NonScriptedAdam),
            "ddpx": (DistributedOptimizer, torch.optim.Adam),
            "empty": (None, None),
        }
        setups = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, impl in enumerate(i for i in _IMPLS if i in args.impls):
                name = _IMPLS[impl]
                cls, optim_cls = classes[impl]
                refs = []
                for owner in (1, 2):
                    key = f"m{k}"
                    rpc.rpc_sync(f"worker{owner}", _make_params,
                                 args=(key, half, args.numel, 10 * k + owner))
                    refs += [rpc.remote(f"worker{owner}", _param_rref, args=(key, i))
                             for i in range(half)]
                for r in refs:
                    r.to_here()
                # owner -> (forward function, its first argument)
                if args.forward == "script":
                    fwd = {o: (_FORWARD_SCRIPT, rpc.rpc_sync(f"worker{o}", _params_list_rref,
                                                               args=(f"m{k}",)))
                           for o in (1, 2)}
                else:
                    fwd = {o: (_forward, f"m{k}") for o in (1, 2)}
                opt = _EmptyRpcStep((1, 2)) if cls is None else cls(optim_cls, refs, lr=1e-3)
                setups[name] = (opt, fwd)
        x = torch.rand(args.numel)
        names = list(setups)
        results = {"quiet": {n: [] for n in names}, "busy": {n: [] for n in names}}

        def run_steps(mode, count, record):
            for step in range(count):
                order = names[step % len(names):] + names[:step % len(names)]
                for name in order:
                    opt, fwd = setups[name]
                    with dist_autograd.context() as cid:
                        if not args.no_backward:
                            (f1, a1), (f2, a2) = fwd[1], fwd[2]
                            loss = (rpc.rpc_sync("worker1", f1, args=(a1, x)) +
                                    rpc.rpc_sync("worker2", f2, args=(a2, x)))
                            dist_autograd.backward(cid, [loss])
                        if args.settle_ms:
                            time.sleep(args.settle_ms / 1e3)
                        t0 = time.perf_counter()
                        opt.step(cid)
                        dt = time.perf_counter() - t0
                    if record:
                        results[mode][name].append(dt * 1e3)

        run_steps("quiet", args.warmup, record=False)
        # Quiet and busy blocks alternate, so that a change in the machine's load hits both.
        per_round = max(1, args.steps // args.rounds)
        for _ in range(args.rounds):
            run_steps("quiet", per_round, record=True)
            for owner in (1, 2):
                rpc.rpc_sync(f"worker{owner}", _busy_start, args=(args.busy,))
            run_steps("busy", per_round, record=True)
            for owner in (1, 2):
                rpc.rpc_sync(f"worker{owner}", _busy_stop)
        with open(out_file, "w") as f:
            json.dump(results, f)
    rpc.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=200, help="parameter tensors, over 2 owners")
    p.add_argument("--numel", type=int, default=4096, help="elements per tensor")
    p.add_argument("--steps", type=int, default=60, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4, help="alternating quiet / busy blocks")
    p.add_argument("--busy", choices=["gil", "cpu", "none"], default="gil",
                   help="none: a control run, nothing busy (the ratios' noise floor)")
    p.add_argument("--settle-ms", type=float, default=0,
                   help="wait this long between the backward pass and the timed step")
    p.add_argument("--no-backward", action="store_true",
                   help="no forward/backward: steps on empty contexts (the RPC path alone)")
    p.add_argument("--forward", choices=["python", "script"], default="python",
                   help="the owners' forward: a Python function (its graph is Python-made, and "
                        "freeing it takes the owner's GIL), or the same in TorchScript")
    p.add_argument("--impls", nargs="+", choices=list(_IMPLS), default=list(_IMPLS),
                   help="which rows to time (default: all four, interleaved step by step)")
    p.add_argument("--json", help="write the step times there")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        init_file, out_file = os.path.join(d, "init"), os.path.join(d, "out.json")
        mp.start_processes(_worker, args=(3, init_file, args, out_file), nprocs=3, join=True,
                           start_method="spawn")
        with open(out_file) as f:
            results = json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f)
    med = {mode: {n: statistics.median(v) for n, v in r.items()} for mode, r in results.items()}
    print(f"bench_dist_optim: torch {torch.__version__}, Adam(lr=1e-3), {args.tensors} tensors x "
          f"{args.numel} over 2 owners, 3 TensorPipe workers on loopback, {args.steps} timed "
          f"steps each (median), busy = {args.busy}, forward = {args.forward}")
    print()
    print("| implementation | step ms, quiet | step ms, owners busy | busy / quiet | "
          "ddpx / this, quiet | ddpx / this, busy |")
    print("|---|---:|---:|---:|---:|---:|")
    ours = "ddpx C++"
    for name in med["quiet"]:
        q, b = med["quiet"][name], med["busy"][name]
        rel = (f"{med['quiet'][ours] / q:.2f} | {med['busy'][ours] / b:.2f}"
               if ours in med["quiet"] and name != _IMPLS["empty"] else "- | -")
        print(f"| {name} | {q:.2f} | {b:.2f} | {b / q:.2f}x | {rel} |")
    base = _IMPLS["empty"]
    if ours in med["quiet"] and base in med["quiet"]:
        # The step's own cost: each step minus the median empty RPC of the same block.
        q = med["quiet"][ours] - med["quiet"][base]
        b = med["busy"][ours] - med["busy"][base]
        print()
        print(f"ddpx's step net of the empty RPC: quiet {q:.2f} ms, busy {b:.2f} ms "
              f"({b / q:.2f}x); the empty RPC itself: {med['quiet'][base]:.2f} -> "
              f"{med['busy'][base]:.2f} ms; ddpx's whole step grows "
              f"{med['busy'][ours] / med['quiet'][ours]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
