"""The adversarial suite's shared pieces: every hook ddpx offers with its torch counterpart, and
the rank functions that put them under faults, non-finite gradients and every DDP option.

A *hook spec* names one hook. ``make(impl, mode)`` builds ``(state, hook)`` for
impl "ddpx" (mode "dropin": registered with DDP's ``register_comm_hook``; "native":
``ddpx.register_comm_hook``) or impl "torch" (torch's own hook; None where torch has no working
form of it here, see ``torch_available``).

``QUANTIZED_HOOKS`` adds the quantized hooks for the DDP matrix only (``OPTION_HOOKS``: both).

Rank functions run in the ranks of ``dist_utils.run_ranks``; the tests in ``test_adversarial.py``
and ``test_adversarial_ddp.py`` check what they return. The table of every case with ddpx's and
torch's outcome is ``docs/reliability.md``.
"""
import datetime
import functools
import inspect
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
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as tqh
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_cases as dc
import ddpx
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


def _powersgd_state(impl: str, group=None, **kw):
    cls = ddpx.hooks.PowerSGDState if impl == "ddpx" else tps.PowerSGDState
    opts = dict(matrix_approximation_rank=1, start_powerSGD_iter=START, min_compression_rate=1.5)
    opts.update(kw)
    return cls(process_group=group, **opts)


def _post_local_state(impl: str, group=None, subgroup=None):
    cls = ddpx.hooks.PostLocalSGDState if impl == "ddpx" else tpl.PostLocalSGDState
    return cls(process_group=group,
               subgroup=subgroup if subgroup is not None else _subgroup_of_one(),
               start_localSGD_iter=START)


class HookSpec:
    """One hook under test: its ddpx and torch forms, and what it promises."""

    def __init__(self, name: str, ddpx_hook: Callable[[], Callable], torch_hook: Optional[Callable],
                 state: Optional[Callable[[str], Any]] = None, averages: bool = True,
                 elementwise: bool = True, torch_works: bool = True, local_sgd: bool = False,
                 native_hook: Optional[Callable[[], Callable]] = None, zero: bool = False,
                 quant: Optional[Dict[str, Any]] = None):
        self.name = name
        self._ddpx_hook = ddpx_hook
        self._native_hook = native_hook
        self._torch_hook = torch_hook
        self._state = state
        self.averages = averages        # gradients leave the hook averaged over the ranks
        self.elementwise = elementwise  # output element i depends only on input elements i
        self.torch_available = torch_hook is not None and torch_works
        self.local_sgd = local_sgd      # a post-local-SGD hook: averaging is the averager's job
        # The state is the ZeroRedundancyOptimizer that steps the parameters (ZeRO-2): each rank's
        # .grad is the mean on the elements it owns only, so training steps through that state.
        self.zero = zero
        self.quant = quant              # the quantized format (bits, exchange, ...), else None

    def state(self, impl: str, group=None, **kwargs) -> Any:
        """The hook state for impl "ddpx" or "torch" on `group` (None: the default group); the
        group itself for the stateless hooks. kwargs: the post-local state's `subgroup`, the
        ZeRO state's `params`."""
        return self._state(impl, group, **kwargs) if self._state is not None else group

    def ddpx_hook(self, native: bool = False) -> Callable:
        """ddpx's hook; for the native registration its native form where the drop-in one
        differs (a functools.partial natively, a named function for DDP's drop-in path)."""
        if native and self._native_hook is not None:
            return self._native_hook()
        return self._ddpx_hook()

    def torch_reference(self) -> Callable:
        """torch's hook as the suite runs it. torch's PowerSGD hooks run waited per bucket
        (powersgd_cases.torch_synchronized): as shipped they issue collectives from future
        callbacks and, with several buckets on Gloo, abort the process or hang without any fault
        (in every such run made while writing these tests; none runs it); so do torch's uint8
        quantization hooks (their second all_gather comes from the first one's callback: with
        several buckets Gloo times out). Where torch's batched hook cannot run (both torches
        today), the reference is powersgd_cases.torch_batched_fixed_hook, torch's algorithm with
        its crashing call fixed."""
        import powersgd_cases as pc
        if self.name == "batched_powerSGD" and not self.torch_available:
            return pc.torch_batched_fixed_hook
        assert self.torch_available, f"torch has no working {self.name} here"
        if self.name == "fp16_powerSGD":
            return tdh.fp16_compress_wrapper(pc.torch_synchronized(tps.powerSGD_hook))
        if not self.elementwise:
            return pc.torch_synchronized(self._torch_hook())
        return self._torch_hook()


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


def impls_of(spec: HookSpec) -> List[str]:
    """The implementations of `spec` that run here (torch's only where it works)."""
    return [impl for impl in IMPLS if impl != "torch" or spec.torch_available]


def register(ddp: DDP, spec: HookSpec, impl: str, group=None, **state_kwargs) -> Any:
    """Registers `spec`'s hook on `ddp` as `impl` (torch's as HookSpec.torch_reference runs it)
    with a state on `group`; returns the state."""
    state = spec.state("torch" if impl == "torch" else "ddpx", group, **state_kwargs)
    hook = (spec.torch_reference() if impl == "torch"
            else spec.ddpx_hook(native=impl == "ddpx_native"))
    if impl == "ddpx_native":
        ddpx.register_comm_hook(ddp, state, hook)
    else:
        ddp.register_comm_hook(state, hook)
    return state


def make_averager(spec: HookSpec, impl: str, group=None):
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
        return cls(period=1, warmup_steps=START, process_group=group)


def outcome_of(exc: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    return None if exc is None else (type(exc).__name__, str(exc)[:400])


# ---- faults -------------------------------------------------------------------------------------

FAULTS = ("dead_between_steps", "dead_in_backward", "stalled")
# Gloo's timeout in the fault runs (long enough for a healthy step on a loaded 2-core machine:
# 2 s was not), and the longest a stalled rank sleeps: it wakes as soon as rank 0, the
# survivor, has reported, so a stall costs about the timeout.
FAULT_TIMEOUT_S = 5.0
STALL_S = FAULT_TIMEOUT_S + 30.0


def fault_group():
    """A group of all ranks whose collectives time out after FAULT_TIMEOUT_S. The fault runs use
    it for the model, the hooks and the averagers, while the default group keeps run_ranks' long
    timeout for start-up (ranks of a loaded machine can start seconds apart)."""
    return dist.new_group(ranks=list(range(dist.get_world_size())),
                          timeout=datetime.timedelta(seconds=FAULT_TIMEOUT_S))


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
    group = fault_group()
    ddp = dc.make_ddp(dc.make_model(), "torch_none", process_group=group)
    register(ddp, spec, impl, group)
    averager = make_averager(spec, impl, group)
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
                   "elapsed": time.monotonic() - started, "outcome": outcome_of(exc)})
    exit_rank({"rank": rank, "role": "survivor", "step": step_box[0], "elapsed": 0.0,
               "outcome": None})


def _fault_subgroups(group_size=None, group=None, **kwargs):
    """dist.new_subgroups for torch 1.13's HierarchicalModelAverager without CUDA: consecutive
    blocks of `group_size` ranks, with the fault runs' timeout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine, groups = None, []
    for start in range(0, world, group_size):
        ranks = list(range(start, start + group_size))
        g = dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=FAULT_TIMEOUT_S))
        groups.append(g)
        if rank in ranks:
            mine = g
    return mine, groups


def _averaging_fault_target(which: str, impl: str, group):
    """A callable averaging a list of parameters once per call, as `which` does it."""
    from torch.distributed.algorithms.model_averaging import averagers as ta
    from torch.distributed.algorithms.model_averaging import utils as tu
    if which == "average_parameters":
        fn = tu.average_parameters if impl == "torch" else ddpx.model_averaging.average_parameters
        return lambda params: fn(params, group)
    if which == "periodic":
        cls = (ta.PeriodicModelAverager if impl == "torch"
               else ddpx.model_averaging.PeriodicModelAverager)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            avg = cls(period=1, warmup_steps=0, process_group=group)
        return avg.average_parameters
    if which == "hierarchical":
        import collections
        sizes = collections.OrderedDict([(1, 1), (2, dist.get_world_size())])
        if impl == "torch":
            from torch.distributed.algorithms.model_averaging import (
                hierarchical_model_averager as th,
            )
            original = dist.new_subgroups
            if not tc.NEW_SUBGROUPS_WITHOUT_CUDA:  # 1.13 builds no subgroups without CUDA
                dist.new_subgroups = _fault_subgroups
            try:
                avg = th.HierarchicalModelAverager(sizes, warmup_steps=0, process_group=group)
            finally:
                dist.new_subgroups = original
        else:
            avg = ddpx.model_averaging.HierarchicalModelAverager(sizes, warmup_steps=0,
                                                                 process_group=group)
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
    group = fault_group()
    model = dc.make_model()
    params = list(model.parameters())
    if which == "post_local_optimizer":
        from torch.distributed.algorithms.model_averaging import averagers as ta
        acls = (ta.PeriodicModelAverager if impl == "torch"
                else ddpx.model_averaging.PeriodicModelAverager)
        from torch.distributed.optim import PostLocalSGDOptimizer
        ocls = PostLocalSGDOptimizer if impl == "torch" else ddpx.optim.PostLocalSGDOptimizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            opt = ocls(torch.optim.SGD(params, lr=LR),
                       acls(period=1, warmup_steps=0, process_group=group))
        step_fn = lambda: opt.step()  # noqa: E731
    else:
        avg = _averaging_fault_target(which, impl, group)
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


# ---- non-finite gradients ---------------------------------------------------------------------

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
    for impl in impls_of(spec):
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


# ---- values past the fp16 range ---------------------------------------------------------------

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
    for impl in impls_of(spec):
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


# =================================================================================================
# ---- every DDP option with every hook (test_adversarial_ddp.py) ---------------------------------
# =================================================================================================
#
# `rank_options` trains, per DDP option and per hook, torch's hook (the reference) and ddpx's
# (drop-in and native), each from a fresh model, for OPT_STEPS SGD steps, and returns what the
# tests compare. torch's PowerSGD hooks run through powersgd_cases.torch_synchronized (each bucket
# waited for): unsynchronised, they issue Gloo collectives from future callbacks and the ranks'
# orders differ with several buckets (gloo aborts, "op.preamble.length <= op.nbytes", or hangs).
# Where torch's batched hook cannot run (1.13), the reference is powersgd_cases'
# torch_batched_fixed_hook (torch's algorithm with its one crashing call fixed).

OPT_STEPS = 5
# The extra "implementation" that measures the gradients every hook sees (torch's allreduce_hook
# behind a probe): per step, the largest |local gradient| over the buckets, for the error bounds.
PROBE = "probe"

# An option: DDP keyword arguments and the training-loop variant.
#   model: "mlp" (ddp_cases' model), "branchy" (two extra heads, unused in some steps), "bn"
#          (with a BatchNorm1d), "frozen" (first layer requires_grad=False), "noncontig"
#          (weights that are non-contiguous views: a transposed one and a narrow one)
#   dtype: the whole model's dtype; loop: "plain" | "no_sync" | "join" | "two_models"
#   group: None (default group) | "copy" (dist.new_group of all ranks) | "pair" (ranks 0 and 1)
OPTIONS: Dict[str, Dict[str, Any]] = {
    "find_unused": dict(model="branchy", ddp=dict(find_unused_parameters=True)),
    "static_graph": dict(ddp=dict(static_graph=True)),
    "static_graph_unused": dict(model="branchy_static", ddp=dict(static_graph=True)),
    "bucket_view": dict(ddp=dict(gradient_as_bucket_view=True)),
    "bucket_view_set_to_none": dict(ddp=dict(gradient_as_bucket_view=True), set_to_none=True),
    "no_sync": dict(loop="no_sync"),
    "big_bucket": dict(big_bucket=True),
    "fp64": dict(dtype=torch.float64),
    "fp16_model": dict(dtype=torch.float16),
    "bf16_model": dict(dtype=torch.bfloat16),
    "join": dict(loop="join"),
    "new_group": dict(group="copy"),
    "two_models": dict(loop="two_models"),
    "broadcast_buffers_bn": dict(model="bn", ddp=dict(broadcast_buffers=True)),
    "frozen_param": dict(model="frozen"),
    "noncontig_params": dict(model="noncontig"),
    "subgroup_of_2_of_3": dict(group="pair"),
    # Run with the quantized hooks only: with the gradient as the bucket's view, DDP hands a
    # globally unused parameter whatever the hook returned for it (without the view it leaves
    # that .grad alone), so a hook that sent such a parameter's residual would move it.
    "find_unused_bucket_view": dict(model="branchy", ddp=dict(find_unused_parameters=True,
                                                              gradient_as_bucket_view=True)),
}
# The options of the matrix of HOOKS (every hook with every option); the others are for
# QUANTIZED_HOOKS only.
HOOK_OPTIONS = tuple(o for o in OPTIONS if o != "find_unused_bucket_view")


# ---- the quantized hooks in the matrix ----------------------------------------------------------
#
# ddpx's quantized_hook (torch has none) in a covering set of formats, torch's uint8 quantization
# hooks (ddpx's are torch's bit for bit) and the quantized ZeRO-2 reduce_scatter_hook. Every
# quantized state starts at iteration 0 (start_iter=0), so that all OPT_STEPS steps quantize,
# DDP's first bucket layout and its rebuild included. They are kept apart from HOOKS, which
# test_adversarial.py (faults, non-finite values, the fp16 range: rules per hook, none written
# for these) and test_compile.py run hook by hook; the DDP matrix runs OPTION_HOOKS, both.

# torch 1.13's quantization hooks move their buffers with .cuda(): without a GPU they cannot run.
_TORCH_QUANTIZATION_WORKS = (".cuda(" not in inspect.getsource(tqh)
                             or torch.cuda.is_available())


def _quantized(name: str, bits: int, exchange: str, rotation: str, error_feedback: bool = True,
               block_size: int = 32) -> HookSpec:
    fmt = dict(bits=bits, exchange=exchange, rotation=rotation,
               use_error_feedback=error_feedback, block_size=block_size)

    def state(impl: str, group=None):
        return ddpx.hooks.QuantizedState(process_group=group, start_iter=0, **fmt)
    return HookSpec(name, lambda: H.quantized_hook, None, state=state, elementwise=False,
                    quant=fmt)


def _zero2(name: str, bits: int) -> HookSpec:
    """ZeRO-2 with `bits`-bit messages; its state is the ZeroRedundancyOptimizer (plain SGD at
    LR, as the other hooks' loop) over the DDP model's trainable parameters."""
    def state(impl: str, group=None, params=()):
        return ddpx.optim.ZeroRedundancyOptimizer(list(params), torch.optim.SGD,
                                                  process_group=group, lr=LR)

    def dropin():
        def reduce_scatter_hook(state, bucket):  # DDP's drop-in path reads __name__
            return H.reduce_scatter_hook(state, bucket, bits=bits)
        return reduce_scatter_hook
    return HookSpec(name, dropin, None, state=state, elementwise=False, zero=True,
                    native_hook=lambda: functools.partial(H.reduce_scatter_hook, bits=bits),
                    quant=dict(bits=bits, exchange="zero2", rotation="none",
                               use_error_feedback=True, block_size=256))


QUANTIZED_HOOKS: Dict[str, HookSpec] = {s.name: s for s in [
    _quantized("q8_allgather", 8, "allgather", "none", block_size=256),  # the default blocks
    _quantized("q4_reduce_scatter", 4, "reduce_scatter", "none"),
    _quantized("q8_reduce_scatter_hadamard", 8, "reduce_scatter", "hadamard"),
    _quantized("q4_allgather_no_ef", 4, "allgather", "none", error_feedback=False),
    _quantized("q2_reduce_scatter", 2, "reduce_scatter", "none"),
    _quantized("q2_allgather_hadamard_no_ef", 2, "allgather", "hadamard", error_feedback=False),
    _quantized("q1_reduce_scatter_hadamard", 1, "reduce_scatter", "hadamard"),
    _quantized("q1_allgather_hadamard_no_ef", 1, "allgather", "hadamard", error_feedback=False),
    HookSpec("quantization_pertensor", lambda: H.quantization_pertensor_hook,
             lambda: tqh.quantization_pertensor_hook, elementwise=False,
             torch_works=_TORCH_QUANTIZATION_WORKS),
    HookSpec("quantization_perchannel", lambda: H.quantization_perchannel_hook,
             lambda: tqh.quantization_perchannel_hook, elementwise=False,
             torch_works=_TORCH_QUANTIZATION_WORKS),
    _zero2("zero2_q8", 8),
    _zero2("zero2_q4", 4),
]}
# Every hook the DDP matrix knows.
OPTION_HOOKS: Dict[str, HookSpec] = {**HOOKS, **QUANTIZED_HOOKS}


class _Linear16(nn.Linear):
    """nn.Linear whose forward runs in fp32 for 16-bit weights (CPU torch 1.13 has no Half
    addmm/tanh): parameters, gradients and buckets stay in the model's dtype."""

    def forward(self, x):
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            return nn.functional.linear(x.float(), self.weight.float(), self.bias.float())
        return super().forward(x)


def _mlp(dtype: torch.dtype) -> nn.Sequential:
    base = dc.make_model(torch.float32)  # seed 0
    layers = []
    for m in base:
        if isinstance(m, nn.Linear):
            lin = _Linear16(m.in_features, m.out_features)
            lin.load_state_dict(m.state_dict())
            m = lin
        layers.append(m)
    return nn.Sequential(*layers).to(dtype)


class _Branchy(nn.Module):
    """ddp_cases' model plus two heads: `extra` is used by every rank or by none (unused on
    every rank in steps 1 and 4), `solo` by one rank per step (rank r at steps s with
    (s + r) even): a parameter locally unused and one globally unused."""

    def __init__(self, static: bool = False):
        super().__init__()
        self.base = _mlp(torch.float32)
        torch.manual_seed(1)
        self.extra = nn.Linear(32, 10)
        self.solo = nn.Linear(32, 10)
        self.static = static

    def forward(self, x, step: int, rank: int):
        y = self.base(x)
        if self.static:  # static_graph: the same parameters unused in every step
            return y + self.extra(x)
        if step % 3 != 1:
            y = y + self.extra(x)
        if (step + rank) % 2 == 0:
            y = y + self.solo(x)
        return y


def option_model(kind: str, dtype: torch.dtype) -> nn.Module:
    if kind == "mlp":
        return _mlp(dtype)
    if kind in ("branchy", "branchy_static"):
        return _Branchy(static=kind == "branchy_static")
    if kind == "bn":
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 10))
    if kind == "frozen":
        model = _mlp(dtype)
        for p in model[0].parameters():
            p.requires_grad_(False)
        return model
    if kind == "noncontig":
        model = _mlp(dtype)
        with torch.no_grad():
            w = model[2].weight  # 48 x 64: stored transposed
            model[2].weight = nn.Parameter(w.detach().t().contiguous().t())
            w = model[4].weight  # 32 x 48: a narrow view of a wider storage
            wide = torch.cat([w.detach(), torch.zeros(32, 16, dtype=w.dtype)], dim=1)
            model[4].weight = nn.Parameter(wide[:, :48])
        assert not model[2].weight.is_contiguous() and not model[4].weight.is_contiguous()
        return model
    raise ValueError(kind)


class OptionGroups:
    """The process groups of the options, created together with the default group, in the same
    order on every rank (dist.new_group is collective over the default group): `copy` (all ranks),
    `pair` (ranks 0 and 1, 3 ranks or more), `one` (this rank alone: post-local SGD's subgroup),
    and `control`, the group the ranks agree on a configuration's failure through."""

    def __init__(self):
        w = dist.get_world_size()
        self.copy = dist.new_group(ranks=list(range(w)))
        self.pair = dist.new_group(ranks=[0, 1]) if w >= 3 else None
        self.one = _subgroup_of_one()
        self.control = dist.new_group(ranks=list(range(w)))

    def group(self, name: Optional[str]):
        return {None: None, "copy": self.copy, "pair": self.pair}[name]


# A configuration that fails on one rank only (torch's compress wrappers with
# find_unused_parameters, say) leaves the other ranks in a collective: they give up after
# CONFIG_TIMEOUT_S, the ranks agree through the control group that the configuration failed, and
# every group is built afresh (a new default group on the launch's store, under a new prefix), so
# that the configurations after it run on healthy groups.
CONFIG_TIMEOUT_S = 4.0
_base_store: List[Any] = []
_world_count = [0]


def fresh_world(rank: int, world_size: int) -> OptionGroups:
    import datetime
    import gc
    if not _base_store:
        _base_store.append(dist.distributed_c10d._get_default_store())
    # The failed configuration's models and states die here, on this thread: left to the cyclic
    # collector, a process group could die on one of its own Gloo threads (its destructor then
    # joins that very thread: "Resource deadlock avoided", abort).
    gc.collect()
    _world_count[0] += 1
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ddpx_world{_world_count[0]}/",
                                                            _base_store[0]),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=CONFIG_TIMEOUT_S))
    return OptionGroups()


def any_failed(groups: OptionGroups, failed: bool) -> bool:
    flag = torch.tensor([1.0 if failed else 0.0])
    dist.all_reduce(flag, group=groups.control)
    return flag.item() > 0


def ref_available(hook: str) -> bool:
    return OPTION_HOOKS[hook].torch_available or hook == "batched_powerSGD"


def _register_option(ddp: DDP, hook: str, impl: str, group, groups: OptionGroups,
                     seen: List[float], order: Optional[List[int]] = None):
    """Registers `hook` as `impl` ("torch", "ddpx_dropin", "ddpx_native" or PROBE) with a state
    on `group`; returns the state. The probe appends to `seen` the largest |local gradient| of
    each bucket, and to `order` the indices (in ddp.parameters()) of the parameters in the order
    their buckets first reach it (the order a quantized state keys its residuals by)."""
    if impl == PROBE:
        index = {id(p): i for i, p in enumerate(ddp.parameters())}

        def probe(state, bucket):
            seen.append(bucket.buffer().detach().abs().max().double().item())
            if order is not None:
                order.extend(index[id(p)] for p in bucket.parameters()
                             if index[id(p)] not in order)
            return tdh.allreduce_hook(state, bucket)
        ddp.register_comm_hook(group, probe)
        return group
    spec = OPTION_HOOKS[hook]
    kwargs: Dict[str, Any] = {"subgroup": groups.one} if spec.local_sgd else {}
    if spec.zero:
        kwargs["params"] = [p for p in ddp.parameters() if p.requires_grad]
    return register(ddp, spec, impl, group, **kwargs)


def _option_averager(hook: str, impl: str, group):
    return None if impl == PROBE else make_averager(OPTION_HOOKS[hook], impl, group)


def _wrap_option(model: nn.Module, opt: Dict[str, Any], group) -> DDP:
    if opt.get("big_bucket"):
        kwargs = tc.ddp_bucket_kwargs(25 * 2 ** 20, 25 * 2 ** 20)  # one bucket on both torches
    else:
        kwargs = tc.ddp_bucket_kwargs(dc.BUCKET_BYTES, dc.BUCKET_BYTES)
    kwargs.update(opt.get("ddp", {}))
    return DDP(model, process_group=group, **kwargs)


def _forward_loss(ddp: DDP, kind: str, rank: int, step: int, micro: int, dtype: torch.dtype):
    x, y = dc.make_batch(rank, 10 * step + micro)
    if dtype == torch.float64:
        x, y = x.double(), y.double()
    if kind.startswith("branchy"):
        out = ddp(x, step, rank)
    else:
        out = ddp(x)
    return nn.functional.mse_loss(out.float() if dtype != torch.float64 else out, y)


def _flat_buffers(model: nn.Module) -> torch.Tensor:
    bufs = [b.detach().reshape(-1).double() for b in model.buffers() if b.is_floating_point()]
    return torch.cat(bufs).clone() if bufs else torch.zeros(0)


def _train_option(rank: int, world_size: int, option: str, hook: str, impl: str,
                  groups: OptionGroups, steps: int) -> Dict[str, Any]:
    if os.environ.get("DDPX_ADV_TRACE"):  # progress on stderr, to find a hang's configuration
        import sys
        print(f"[rank {rank}] {option} {hook} {impl}", file=sys.stderr, flush=True)
    opt = OPTIONS[option]
    if opt.get("group") == "pair" and rank >= 2:
        return {}  # not in the group: trains nothing
    kind, dtype = opt.get("model", "mlp"), opt.get("dtype", torch.float32)
    loop, group = opt.get("loop", "plain"), groups.group(opt.get("group"))
    seen: List[float] = []
    order: List[int] = []
    n_models = 2 if loop == "two_models" else 1
    spec = None if impl == PROBE else OPTION_HOOKS[hook]
    ddps, optims, averagers, states = [], [], [], []
    for i in range(n_models):
        model = option_model(kind, dtype)
        if i == 1:  # the second model: other weights
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        ddp = _wrap_option(model, opt, group)
        state = _register_option(ddp, hook, impl, group, groups, seen, order)
        ddps.append(ddp)
        states.append(state)
        if spec is not None and spec.zero:
            optims.append(state)  # ZeRO-2: the hook's state steps the parameters
        else:
            optims.append(torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad],
                                          lr=LR))
        averagers.append(None if loop == "join" else _option_averager(hook, impl, group))
    # join: the last rank has 2 batches fewer.
    my_steps = steps - 2 if loop == "join" and rank == world_size - 1 else steps
    # A quantized state's error-feedback residuals after each step, where some parameters go
    # unused (the branchy models).
    track = (spec is not None and spec.quant is not None and not spec.zero
             and spec.quant["use_error_feedback"] and kind.startswith("branchy"))
    init = torch.cat([dc.flat_params(d) for d in ddps])
    params, buffers, scale, worker_res, server_res = [], [], [], [], []

    def one_step(step: int) -> None:
        for i, (ddp, optim, averager) in enumerate(zip(ddps, optims, averagers)):
            optim.zero_grad(set_to_none=opt.get("set_to_none", False))
            if loop == "no_sync":
                with ddp.no_sync():
                    for micro in (1, 2):
                        _forward_loss(ddp, kind, rank, step, micro, dtype).backward()
            _forward_loss(ddp, kind, rank, step, 3 * i, dtype).backward()
            optim.step()
            if averager is not None:
                averager.average_parameters(ddp.parameters())
        params.append(torch.cat([dc.flat_params(d) for d in ddps]))
        buffers.append(torch.cat([_flat_buffers(d) for d in ddps]))
        scale.append(max(seen) if seen else 0.0)
        seen.clear()
        if track:
            worker_res.append(states[0].worker_residuals())
            server_res.append(states[0].server_residuals())

    if loop == "join":
        from torch.distributed.algorithms.join import Join
        with Join(ddps):
            for step in range(my_steps):
                one_step(step)
    else:
        for step in range(my_steps):
            one_step(step)
    out = {"params": torch.stack(params), "buffers": torch.stack(buffers),
           "final": torch.cat([dc.flat_params(d) for d in ddps]), "init": init,
           "max_local_grad": torch.tensor(scale, dtype=torch.float64)}
    if impl == PROBE:
        out["bucket_order"] = order
    if track:
        out["worker_residuals"], out["server_residuals"] = worker_res, server_res
    return out


def option_impls(hook: str) -> List[str]:
    return [i for i in IMPLS if i != "torch" or ref_available(hook)]


def rank_options(rank: int, world_size: int, options: Sequence[str],
                 hooks: Any = tuple(HOOKS), steps: int = OPT_STEPS,
                 reregister: bool = False, shared_state: Sequence[str] = ()) -> Dict[Any, Any]:
    """results[(option, hook, impl)] = _train_option's record, or {"error": (type, message)};
    results[(option, PROBE)] = the probe's record. `hooks`: the hooks run with every option, or
    a dict option -> its hooks. A rank outside an option's group ("pair" on rank 2) records {}.
    With `reregister`, also results[("reregister", hook, first, second)]: what registering a
    second hook raised. For each quantized hook in `shared_state`, also
    results[("shared_state", hook, impl)]: what a second DDP model on the first one's state
    raised (see _shared_state)."""
    groups = fresh_world(rank, world_size)
    out: Dict[Any, Any] = {}

    def run(key, hook, impl, option):
        nonlocal groups
        try:
            out[key] = _train_option(rank, world_size, option, hook, impl, groups, steps)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[key] = {"error": outcome_of(exc)}
        if any_failed(groups, "error" in out[key]):
            groups = fresh_world(rank, world_size)

    per_option = hooks if isinstance(hooks, dict) else {o: hooks for o in options}
    for option in options:
        run((option, PROBE), "allreduce", PROBE, option)
        for hook in per_option[option]:
            for impl in option_impls(hook):
                run((option, hook, impl), hook, impl, option)
    for hook in shared_state:
        for impl in ("ddpx_dropin", "ddpx_native"):
            out[("shared_state", hook, impl)] = _shared_state(rank, hook, impl)
    if reregister:
        for hook in dict.fromkeys(h for o in options for h in per_option[o]):
            impls = option_impls(hook)
            for first in impls:
                for second in impls:
                    ddp = _wrap_option(_mlp(torch.float32), {}, None)
                    _register_option(ddp, hook, first, None, groups, [])
                    out[("reregister", hook, first, second)] = outcome_of(_catch_exc(
                        lambda: _register_option(ddp, hook, second, None, groups, [])))
    return out


def _catch_exc(fn: Callable[[], Any]) -> Optional[BaseException]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def _shared_state(rank: int, hook: str, impl: str) -> Dict[str, Any]:
    """Two DDP models registered with one quantized state (a user's mistake: the residuals are
    kept per parameter of one model): what each model's first backward raised, {"model0": ...,
    "model1": ...}."""
    spec = QUANTIZED_HOOKS[hook]
    state = spec.state("ddpx")
    hook_fn = spec.ddpx_hook(native=impl == "ddpx_native")
    out: Dict[str, Any] = {}
    for i in range(2):
        ddp = _wrap_option(_mlp(torch.float32), {}, None)
        if impl == "ddpx_native":
            ddpx.register_comm_hook(ddp, state, hook_fn)
        else:
            ddp.register_comm_hook(state, hook_fn)
        x, y = dc.make_batch(rank, i)
        out[f"model{i}"] = outcome_of(_catch_exc(
            lambda: nn.functional.mse_loss(ddp(x), y).backward()))
    return out
