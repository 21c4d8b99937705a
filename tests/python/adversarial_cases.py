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
from dist_utils import exit_rank

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
             elementwise=False),
    HookSpec("post_localSGD", lambda: H.post_localSGD_hook, lambda: tpl.post_localSGD_hook,
             state=_post_local_state, local_sgd=True),
]}


def _torch_noop():
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    return debugging_hooks.noop_hook


# An implementation under test: "torch", "ddpx_dropin" or "ddpx_native".
IMPLS = ("torch", "ddpx_dropin", "ddpx_native")


def register(ddp: DDP, spec: HookSpec, impl: str) -> Any:
    """Registers `spec`'s hook on `ddp` as `impl`; returns the hook state."""
    state, hook = spec.make("torch" if impl == "torch" else "ddpx")
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
                time.sleep(stall_s)
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
                   "grads_finite": None})
    exit_rank({"rank": rank, "role": "survivor", "step": step_box[0], "elapsed": 0.0,
               "outcome": None})
