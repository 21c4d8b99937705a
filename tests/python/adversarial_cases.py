"""The adversarial suite's shared pieces: every hook ddpx offers with its torch counterpart, and
the rank functions that put them under faults, non-finite gradients and every DDP option.

A *hook spec* names one hook. ``make(impl, mode)`` builds ``(state, hook)`` for
impl "ddpx" (mode "dropin": registered with DDP's ``register_comm_hook``; "native":
``ddpx.register_comm_hook``) or impl "torch" (torch's own hook; None where torch has no working
form of it here, see ``torch_available``).

Rank functions run in the ranks of ``dist_utils.run_ranks``; the tests in ``test_adversarial.py``
check what they return. The table of every case with ddpx's and torch's outcome is
``docs/reliability.md``.
"""
import math
import os
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as tdh
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as tpl
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx
import ddp_cases as dc
import torch_compat as tc
from dist_utils import exit_rank, wait_for_result_of

# PowerSGD and post-local SGD start compressing / local steps at this step, so that a fault at
# FAULT_STEP hits the compressed (or local) path, with warm-start memories in place.
START = 2
FAULT_STEP = 3
LR = 0.05


def _subgroup_of_one():
    """A subgroup holding only this rank (every rank creates every one-rank group, in order)."""
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group(ranks=[r])
        if r == dist.get_rank():
            mine = g
    return mine


def _powersgd_state(impl: str, **kw):
    cls = ddpx.hooks.PowerSGDState if impl == "ddpx" else tps.PowerSGDState
    opts = dict(matrix_approximation_rank=1, start_powerSGD_iter=START, min_compression_rate=1.5)
    opts.update(kw)
    return cls(process_group=None, **opts)


def _post_local_state(impl: str):
    cls = ddpx.hooks.PostLocalSGDState if impl == "ddpx" else tpl.PostLocalSGDState
    return cls(process_group=None, subgroup=_subgroup_of_one(), start_localSGD_iter=START)


class HookSpec:
    """One hook under test: its ddpx and torch forms, and what it promises."""

    def __init__(self, name: str, ddpx_hook: Callable[[], Callable], torch_hook: Optional[Callable],
                 state: Optional[Callable[[str], Any]] = None, averages: bool = True,
                 elementwise: bool = True, torch_works: bool = True, local_sgd: bool = False):
        self.name = name
        self._ddpx_hook = ddpx_hook
        self._torch_hook = torch_hook
        self._state = state
        self.averages = averages        # gradients leave the hook averaged over the ranks
        self.elementwise = elementwise  # output element i depends only on input elements i
        self.torch_available = torch_hook is not None and torch_works
        self.local_sgd = local_sgd      # a post-local-SGD hook: averaging is the averager's job

    def make(self, impl: str) -> Tuple[Any, Callable]:
        state = self._state(impl) if self._state is not None else None
        if impl == "ddpx":
            return state, self._ddpx_hook()
        assert self.torch_available, f"torch has no working {self.name} here"
        return state, self._torch_hook()


H = ddpx.hooks
HOOKS: Dict[str, HookSpec] = {s.name: s for s in [
    HookSpec("allreduce", lambda: H.allreduce_hook, lambda: tdh.allreduce_hook),
    HookSpec("fp16", lambda: H.fp16_compress_hook, lambda: tdh.fp16_compress_hook),
    HookSpec("bf16", lambda: H.bf16_compress_hook, lambda: tdh.bf16_compress_hook,
             torch_works=tc.TORCH_BF16_HOOKS_ON_GLOO),
    HookSpec("fp16_wrap", lambda: H.fp16_compress_wrapper(H.allreduce_hook),
             lambda: tdh.fp16_compress_wrapper(tdh.allreduce_hook)),
    HookSpec("bf16_wrap", lambda: H.bf16_compress_wrapper(H.allreduce_hook),
             lambda: tdh.bf16_compress_wrapper(tdh.allreduce_hook),
             torch_works=tc.TORCH_BF16_HOOKS_ON_GLOO),
    HookSpec("noop", lambda: H.noop_hook, lambda: _torch_noop(), averages=False),
    HookSpec("powerSGD", lambda: H.powerSGD_hook, lambda: tps.powerSGD_hook,
             state=_powersgd_state, elementwise=False),
    HookSpec("batched_powerSGD", lambda: H.batched_powerSGD_hook,
             lambda: tps.batched_powerSGD_hook, state=_powersgd_state, elementwise=False,
             torch_works=tc.TORCH_BATCHED_POWERSGD_WORKS),
    HookSpec("fp16_powerSGD", lambda: H.fp16_compress_wrapper(H.powerSGD_hook),
             lambda: tdh.fp16_compress_wrapper(tps.powerSGD_hook), state=_powersgd_state,
             elementwise=False, torch_works=tc.TORCH_CPU_HALF_BMM),
    HookSpec("post_localSGD", lambda: H.post_localSGD_hook, lambda: tpl.post_localSGD_hook,
             state=_post_local_state, local_sgd=True),
]}


def _torch_noop():
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    return debugging_hooks.noop_hook


# An implementation under test: "torch", "ddpx_dropin" or "ddpx_native".
IMPLS = ("torch", "ddpx_dropin", "ddpx_native")


def register(ddp: DDP, spec: HookSpec, impl: str) -> Any:
    """Registers `spec`'s hook on `ddp` as `impl`; returns the hook state.

    torch's PowerSGD hooks are registered waited per bucket (powersgd_cases.torch_synchronized):
    as shipped they issue collectives from future callbacks and, with several buckets on Gloo,
    abort the process or hang without any fault (seen in 3 of 3 fault runs here, and 5 of 5
    in powersgd_cases' runs); waited, they are the reference a user could actually run."""
    state, hook = spec.make("torch" if impl == "torch" else "ddpx")
    if impl == "torch" and not spec.elementwise:
        from powersgd_cases import torch_synchronized
        hook = torch_synchronized(hook)
    if impl == "ddpx_native":
        ddpx.register_comm_hook(ddp, state, hook)
    else:
        ddp.register_comm_hook(state, hook)
    return state


def make_averager(spec: HookSpec, impl: str):
    """The model averager that goes with a post-local-SGD hook (period 1: every step after
    START averages), else None."""
    if not spec.local_sgd:
        return None
    if impl == "torch":
        from torch.distributed.algorithms.model_averaging import averagers
        cls = averagers.PeriodicModelAverager
    else:
        cls = ddpx.model_averaging.PeriodicModelAverager
    with warnings.catch_warnings():  # "When period is 1, no need to use model averaging ..."
        warnings.simplefilter("ignore", UserWarning)
        return cls(period=1, warmup_steps=START)


def outcome_of(exc: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    return None if exc is None else (type(exc).__name__, str(exc)[:400])


# ---- faults -------------------------------------------------------------------------------------

FAULTS = ("dead_between_steps", "dead_in_backward", "stalled")
# Gloo's timeout in the fault runs (long enough for a healthy step on a loaded 2-core machine:
# 2 s was not), and the longest a stalled rank sleeps: it wakes as soon as rank 0, the
# survivor, has reported, so a stall costs about the timeout.
FAULT_TIMEOUT_S = 5.0
STALL_S = FAULT_TIMEOUT_S + 30.0


def _stall(stall_s: float) -> None:
    time.sleep(FAULT_TIMEOUT_S)  # at least the timeout, whatever rank 0 does
    wait_for_result_of(0, stall_s - FAULT_TIMEOUT_S)


def rank_fault(rank: int, world_size: int, hook: str, impl: str, fault: str,
               stall_s: float) -> None:
    """Trains the small model with `hook` as `impl`; the last rank meets `fault` at FAULT_STEP:
    it exits after that step's optimizer step (dead_between_steps), exits inside that step's
    backward once some buckets are in flight (dead_in_backward), or sleeps `stall_s` seconds
    before that step's backward and then exits (stalled). Every other rank records what the
    training raised and how long after the start of the failing step, then leaves at once
    (its process group is broken: no teardown)."""
    spec = HOOKS[hook]
    faulty = rank == world_size - 1
    ddp = dc.make_ddp(dc.make_model(), "torch_none")
    register(ddp, spec, impl)
    averager = make_averager(spec, impl)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    if faulty and fault == "dead_in_backward":
        first = ddp.module[0].weight  # the last gradient of the backward pass

        def die(grad):
            if step_box[0] == FAULT_STEP:
                exit_rank({"rank": rank, "role": "faulty"})
            return grad
        first.register_hook(die)
    step_box = [0]
    started = time.monotonic()
    try:
        for step in range(FAULT_STEP + 3):
            step_box[0] = step
            started = time.monotonic()
            opt.zero_grad()
            loss = dc.loss_fn(ddp, *dc.make_batch(rank, step))
            if faulty and fault == "stalled" and step == FAULT_STEP:
                _stall(stall_s)
                exit_rank({"rank": rank, "role": "faulty"})
            loss.backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(ddp.parameters())
            if faulty and fault == "dead_between_steps" and step == FAULT_STEP - 1:
                exit_rank({"rank": rank, "role": "faulty"})
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        exit_rank({"rank": rank, "role": "survivor", "step": step_box[0],
                   "elapsed": time.monotonic() - started, "outcome": outcome_of(exc),
                   })
    exit_rank({"rank": rank, "role": "survivor", "step": step_box[0], "elapsed": 0.0,
               "outcome": None})


def _averaging_fault_target(which: str, impl: str):
    """A callable averaging a list of parameters once per call, as `which` does it."""
    from torch.distributed.algorithms.model_averaging import averagers as ta
    from torch.distributed.algorithms.model_averaging import utils as tu
    if which == "average_parameters":
        fn = tu.average_parameters if impl == "torch" else ddpx.model_averaging.average_parameters
        return lambda params: fn(params, dist.group.WORLD)
    if which == "periodic":
        cls = ta.PeriodicModelAverager if impl == "torch" else ddpx.model_averaging.PeriodicModelAverager
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            avg = cls(period=1, warmup_steps=0)
        return avg.average_parameters
    if which == "hierarchical":
        import collections
        sizes = collections.OrderedDict([(1, 1), (2, dist.get_world_size())])
        if impl == "torch":
            from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as th
            from post_local_sgd_cases import cpu_new_subgroups
            with cpu_new_subgroups():
                avg = th.HierarchicalModelAverager(sizes, warmup_steps=0)
        else:
            avg = ddpx.model_averaging.HierarchicalModelAverager(sizes, warmup_steps=0)
        return avg.average_parameters
    raise ValueError(which)


AVERAGING_TARGETS = ("average_parameters", "periodic", "hierarchical", "post_local_optimizer")


def rank_averaging_fault(rank: int, world_size: int, which: str, impl: str, fault: str,
                         stall_s: float) -> None:
    """Averages a small model's parameters once per step with `which` ("post_local_optimizer":
    torch's / ddpx's PostLocalSGDOptimizer over SGD, period 1); the last rank dies before the
    averaging of FAULT_STEP, or stalls there for `stall_s` s (fault "dead_between_steps" /
    "stalled"). The survivors record what was raised and how long it took."""
    faulty = rank == world_size - 1
    model = dc.make_model()
    params = list(model.parameters())
    if which == "post_local_optimizer":
        from torch.distributed.algorithms.model_averaging import averagers as ta
        acls = ta.PeriodicModelAverager if impl == "torch" else ddpx.model_averaging.PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        ocls = PostLocalSGDOptimizer if impl == "torch" else ddpx.optim.PostLocalSGDOptimizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            opt = ocls(torch.optim.SGD(params, lr=LR), acls(period=1, warmup_steps=0))
        step_fn = lambda: opt.step()  # noqa: E731
    else:
        avg = _averaging_fault_target(which, impl)
        step_fn = lambda: avg(params)  # noqa: E731
    step, started = 0, time.monotonic()
    try:
        for step in range(FAULT_STEP + 3):
            with torch.no_grad():
                for p in params:
                    p.add_(0.01 * (rank + 1))
                    p.grad = torch.full_like(p, 0.1 * (rank + 1))
            if faulty and step == FAULT_STEP:
                if fault == "stalled":
                    _stall(stall_s)
                exit_rank({"rank": rank, "role": "faulty"})
            started = time.monotonic()
            step_fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        exit_rank({"rank": rank, "role": "survivor", "step": step,
                   "elapsed": time.monotonic() - started, "outcome": outcome_of(exc)})
    exit_rank({"rank": rank, "role": "survivor", "step": step, "elapsed": 0.0, "outcome": None})


# ---- non-finite gradients -------------------------------------------------------------------------

# The poisoned gradient: an element of the second layer's weight (48 x 64, compressed by
# PowerSGD at rank 1), at the first compressed step.
POISON_LAYER = 2
POISON_INDEX = 3 * 64 + 5
NONFINITE_KINDS = ("nan", "inf", "-inf", "inf_vs_-inf")


def _poison_value(kind: str, rank: int, world_size: int) -> Optional[float]:
    """What the poisoned element becomes on `rank` (None: left as it is)."""
    last = rank == world_size - 1
    if kind == "inf_vs_-inf":
        return math.inf if rank == 0 else (-math.inf if last else None)
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[kind] if last else None


def rank_nonfinite(rank: int, world_size: int, hook: str, kinds: Sequence[str]) -> Dict[str, Any]:
    """For each impl and kind: a fresh DDP model with `hook`; step START's gradient of the
    poisoned layer gets a non-finite element on the last rank (kind "inf_vs_-inf": +inf on rank 0,
    -inf on the last); returns the averaged gradients of that layer at START (the poisoned step)
    and START + 1 (clean inputs), and, for ddpx, at START + 2 after state.clear_memories() where
    the state has it. Post-local SGD: parameters after the averager instead of gradients."""
    spec = HOOKS[hook]
    out: Dict[str, Any] = {}
    for impl in IMPLS:
        if impl == "torch" and not spec.torch_available:
            continue
        for kind in kinds:
            ddp = dc.make_ddp(dc.make_model(), "torch_none")
            state = register(ddp, spec, impl)
            averager = make_averager(spec, impl)
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            layer = ddp.module[POISON_LAYER]
            box = {"step": -1}
            value = _poison_value(kind, rank, world_size)

            def poison(grad, box=box, value=value):
                if box["step"] == START and value is not None:
                    grad = grad.clone()
                    grad.view(-1)[POISON_INDEX] = value
                return grad
            layer.weight.register_hook(poison)
            seen = []
            for step in range(START + 3):
                box["step"] = step
                if step == START + 2:
                    if impl == "torch" or not hasattr(state, "clear_memories"):
                        break
                    state.clear_memories()
                opt.zero_grad()
                dc.loss_fn(ddp, *dc.make_batch(rank, step)).backward()
                if averager is not None:
                    opt.step()
                    averager.average_parameters(ddp.parameters())
                    if step >= START:
                        seen.append(layer.weight.detach().clone())
                elif step >= START:
                    seen.append(layer.weight.grad.detach().clone())
            out[f"{impl}/{kind}"] = seen
    return out


# ---- values past the fp16 range ---------------------------------------------------------------------

# (rank 0's value, the other ranks' value) filling the whole gradient of the poisoned layer.
OVERFLOW_PAIRS = ((6.0e4, 6.0e4), (7.0e4, 7.0e4), (1.2e5, -1.2e5), (1.2e5, 1.2e5),
                  (2.0e5, 2.0e5), (3.0e38, 3.0e38))


def rank_overflow(rank: int, world_size: int, hook: str,
                  pairs: Sequence[Tuple[float, float]] = OVERFLOW_PAIRS) -> Dict[str, Any]:
    """For each impl and value pair: a fresh DDP model with `hook`, trained START steps, then one
    backward whose poisoned-layer gradient is the constant pair[0] on rank 0 and pair[1] on the
    others; returns that layer's gradient as the hook left it (a constant matrix, so PowerSGD's
    rank-1 approximation of the mean is exact up to rounding)."""
    spec = HOOKS[hook]
    out: Dict[str, Any] = {}
    for impl in IMPLS:
        if impl == "torch" and not spec.torch_available:
            continue
        for pair in pairs:
            ddp = dc.make_ddp(dc.make_model(), "torch_none")
            register(ddp, spec, impl)
            layer = ddp.module[POISON_LAYER]
            box = {"step": -1}
            fill = pair[0] if rank == 0 else pair[1]
            layer.weight.register_hook(
                lambda g, box=box, fill=fill: torch.full_like(g, fill) if box["step"] == START
                else g)
            for step in range(START + 1):
                box["step"] = step
                ddp.zero_grad()
                dc.loss_fn(ddp, *dc.make_batch(rank, step)).backward()
            out[f"{impl}/{pair}"] = layer.weight.grad.detach().clone()
    return out
