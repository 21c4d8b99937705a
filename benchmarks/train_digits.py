#!/usr/bin/env python3
"""The ddpx main job: DDP training on the `digits` data set, once per communication hook.

Launch (2 processes, Gloo on CPU; NCCL when there is one GPU per process), with ddpx installed
(`pip install --no-build-isolation .`, as scripts/main.sh does into .venv)::

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \
        benchmarks/train_digits.py --out out/

(With Debian's torch 1.13 on Python 3.11 add `--redirects 1 --tee 1`: it works around a crash of
that torchrun; it prefixes every line a rank prints with ``[default<rank>]:``, so the final table
is also written, unprefixed, to ``out/results.md``.)

Every configuration in ``CONFIGS`` trains the same MLP from the same initial weights on the same
data order, and the table reports test accuracy (all ranks), median ms per training step after
warm-up, the compression (payload against an fp32 allreduce; PowerSGD: the state's
compression_stats()), the modelled bytes each rank sends per step (from the buckets DDP really
built; PowerSGD: from the numel after compression), the bytes of each rank's optimizer state at
the end (ZeroRedundancyOptimizer: its local shard), and the final training loss. Adding a hook to
the table = adding one ``Config`` to ``CONFIGS``.

Outputs (rank 0): out/results.md, out/results.json, out/loss_curves.png,
out/accuracy_vs_bytes.png.
"""
import argparse
import collections
import dataclasses
import json
import math
import os
import statistics
import sys
import textwrap
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_localsgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as torch_quant
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

try:
    import ddpx
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise SystemExit(
        f"train_digits.py: cannot import ddpx ({exc}). Build it and put it on the path, e.g. "
        "`cmake -S . -B build -G Ninja && cmake --build build` then PYTHONPATH=build/python, "
        "or `pip install --no-build-isolation .`"
    ) from None


# ---------------------------------------------------------------------------------------------
# Wire-byte models: bytes one rank sends per step for one bucket of `numel` elements.
# These are models of the collective algorithms, not measurements.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Bucket:
    numel: int
    dtype: torch.dtype
    param_shapes: Optional[List[torch.Size]]  # None when DDP did not report the layout


@dataclasses.dataclass
class WireContext:
    world: int
    backend: str  # "gloo" or "nccl"
    device: torch.device
    # PowerSGD rows: elements one compressed step sends (the state's compression_stats():
    # uncompressed tensors + P + Q factors), counted by the run.
    compressed_numel: Optional[int] = None
    # Post-local SGD rows: what the run did (see wire_post_local_sgd).
    local_sgd: Optional["LocalSGDRun"] = None
    # ZeroRedundancyOptimizer rows: bytes of the parameters each rank owns (updates and
    # broadcasts), from the local optimizer's param_groups, one entry per rank.
    zero_shard_bytes: Optional[List[int]] = None
    # quantized_hook rows: the exchange they were asked for (--quantized-exchange).
    quantized_exchange: str = "auto"


def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def ring_allreduce_bytes(numel: int, elem_size: int, world: int) -> float:
    """Ring allreduce (reduce-scatter + allgather): 2 (W-1)/W * numel * elem_size per rank."""
    return 2.0 * (world - 1) / world * numel * elem_size


def allgather_bytes(numel: int, elem_size: int, world: int) -> float:
    """Allgather of every rank's full vector: (W-1) * numel * elem_size per rank."""
    return float((world - 1) * numel * elem_size)


def wire_fp32_allreduce(buckets: List[Bucket], ctx: WireContext) -> float:
    """DDP's default and allreduce hooks: a ring allreduce in the bucket's dtype."""
    return sum(ring_allreduce_bytes(b.numel, _elem(b.dtype), ctx.world) for b in buckets)


def wire_torch_16bit(buckets: List[Bucket], ctx: WireContext) -> float:
    """torch's fp16/bf16 compress hooks: a ring allreduce of 16-bit values, on any backend."""
    return sum(ring_allreduce_bytes(b.numel, 2, ctx.world) for b in buckets)


def wire_ddpx_16bit(buckets: List[Bucket], ctx: WireContext) -> float:
    """ddpx 16-bit hooks/wrappers (ExchangeMode AUTO): allgather of 16-bit bytes on Gloo or CPU
    tensors, 16-bit ring allreduce otherwise (NCCL on GPU)."""
    if ctx.backend == "gloo" or ctx.device.type == "cpu":
        return sum(allgather_bytes(b.numel, 2, ctx.world) for b in buckets)
    return wire_torch_16bit(buckets, ctx)


def wire_none(buckets: List[Bucket], ctx: WireContext) -> float:
    return 0.0


def wire_powersgd_fp32(buckets: List[Bucket], ctx: WireContext) -> float:
    """PowerSGD (fp32 buckets): the numel after compression of one compressed step, allreduced in
    fp32 (P with the uncompressed tensors, then Q), ring allreduce cost."""
    return ring_allreduce_bytes(ctx.compressed_numel or 0, 4, ctx.world)


def wire_powersgd_16bit(buckets: List[Bucket], ctx: WireContext) -> float:
    """ddpx fp16_compress_wrapper(powerSGD_hook): the factors travel as 16-bit values, gathered
    on Gloo/CPU, ring-allreduced on NCCL (ExchangeMode AUTO, as the 16-bit hooks)."""
    n = ctx.compressed_numel or 0
    if ctx.backend == "gloo" or ctx.device.type == "cpu":
        return allgather_bytes(n, 2, ctx.world)
    return ring_allreduce_bytes(n, 2, ctx.world)


@dataclasses.dataclass
class LocalSGDRun:
    steps: int  # training steps of the run
    grad_global_steps: int  # steps whose gradients were allreduced globally (the warm-up)
    subgroup_size: int  # the hook's subgroup after the warm-up
    averaging_steps: int  # steps after which the averager allreduced the parameters
    param_numel: int  # elements one averaging allreduces (the parameters with a gradient)
    param_dtype: torch.dtype


def wire_post_local_sgd(buckets: List[Bucket], ctx: WireContext) -> float:
    """Post-local SGD, mean over the run: the warm-up steps' global fp32 gradient allreduce,
    then the subgroup's (ring allreduce within it: 0 for a subgroup of one rank), plus one fp32
    ring allreduce of the parameters per averaging step, amortised over all steps."""
    s = ctx.local_sgd
    if s is None or s.steps == 0:
        return 0.0
    grad_global = wire_fp32_allreduce(buckets, ctx)
    grad_sub = sum(ring_allreduce_bytes(b.numel, _elem(b.dtype), s.subgroup_size)
                   for b in buckets)
    params = ring_allreduce_bytes(s.param_numel, _elem(s.param_dtype), ctx.world)
    return (s.grad_global_steps * grad_global + (s.steps - s.grad_global_steps) * grad_sub
            + s.averaging_steps * params) / s.steps


def wire_zero(buckets: List[Bucket], ctx: WireContext) -> float:
    """ZeroRedundancyOptimizer (stage 1) behind DDP's default allreduce: the fp32 ring allreduce
    of the gradients, then each rank broadcasts the parameters it updated to the W-1 others.
    Every parameter reaches each non-owner once, so the ranks together send (W-1) x the
    parameter bytes, whatever the broadcast algorithm: (W-1)/W x parameter bytes per rank on
    average (the owner of more parameters sends more)."""
    shards = ctx.zero_shard_bytes or []
    return wire_fp32_allreduce(buckets, ctx) + (ctx.world - 1) * sum(shards) / ctx.world


def wire_zero2(buckets: List[Bucket], ctx: WireContext) -> float:
    """ZeRO with ddpx.hooks.reduce_scatter_hook (ZeRO-2 gradient sharding): every gradient
    element goes once from each non-owner to its owner, (W-1)/W x gradient bytes per rank on
    average, plus the parameter exchange of wire_zero."""
    shards = ctx.zero_shard_bytes or []
    grads = sum(b.numel * _elem(b.dtype) for b in buckets)
    return (ctx.world - 1) * (grads + sum(shards)) / ctx.world


def wire_zero_powersgd(buckets: List[Bucket], ctx: WireContext) -> float:
    """ZeRO overlapped with PowerSGD: PowerSGD's fp32 factors (wire_powersgd_fp32) + the
    parameter exchange of wire_zero."""
    shards = ctx.zero_shard_bytes or []
    return wire_powersgd_fp32(buckets, ctx) + (ctx.world - 1) * sum(shards) / ctx.world


def _quantized_blocks(b: Bucket, block_size: int) -> int:
    """Scale blocks of one bucket for quantized_hook: cut per parameter, `block_size` values
    each, the last block of a parameter short (one block per bucket row when DDP did not report
    the layout)."""
    shapes = b.param_shapes or [torch.Size([b.numel])]
    return sum(-(-math.prod(s) // block_size) for s in shapes)


def wire_quantized(bits: int, block_size: int = 256) -> Callable[[List[Bucket], WireContext],
                                                                  float]:
    """ddpx quantized_hook on a quantized step, exchange "auto": on 3 or more ranks reduce-scatter
    style (the codes and the block scales to the owners, the owners' re-quantized means back),
    2(W-1)/W x (numel x bits/8 + 4 x blocks) per bucket; on 2 ranks the all-gather, (W-1) x the
    same, the same count there."""
    def wire(buckets: List[Bucket], ctx: WireContext) -> float:
        gather = ctx.quantized_exchange == "allgather" or (
            ctx.quantized_exchange == "auto" and ctx.world == 2)
        if gather:
            return sum(allgather_bytes(b.numel * bits / 8 + 4 * _quantized_blocks(b, block_size),
                                       1, ctx.world) for b in buckets)
        return sum(ring_allreduce_bytes(1, b.numel * bits / 8 + 4 * _quantized_blocks(
            b, block_size), ctx.world) for b in buckets)
    wire.__doc__ = WIRE_QUANTIZED_TEXT
    return wire


WIRE_QUANTIZED_TEXT = (
    "ddpx quantized_hook (b bits, blocks of 256 values cut per parameter), a quantized step: "
    "2(W-1)/W x (numel x b/8 + 4 B x blocks), the codes and block scales sent to each chunk's "
    "owner and the owner's re-quantized mean sent back; on 2 ranks (the all-gather exchange) "
    "(W-1) x (numel x b/8 + 4 B x blocks), the same count")


def wire_torch_quantization(channel: int) -> Callable[[List[Bucket], WireContext], float]:
    """torch's quantization hooks: an allgather of each rank's uint8 codes, (W-1) x numel x 1,
    plus the scale and zero point (per tensor, or per `channel` values with the bucket padded
    to whole channels), allgathered in fp32."""
    def wire(buckets: List[Bucket], ctx: WireContext) -> float:
        total = 0.0
        for b in buckets:
            if channel == 0:
                total += allgather_bytes(b.numel, 1, ctx.world) + allgather_bytes(2, 4, ctx.world)
            else:
                rows = -(-b.numel // channel)
                total += (allgather_bytes(rows * channel, 1, ctx.world)
                          + allgather_bytes(2 * rows, 4, ctx.world))
        return total
    wire.__doc__ = ("torch's quantization hooks: allgather of uint8 codes (W-1) x numel x 1 (per "
                    "channel: numel padded to whole channels of 512) + the fp32 scales and zero "
                    "points (2 per tensor or per channel) x (W-1)")
    return wire


WIRE_FOOTNOTES = {
    wire_fp32_allreduce: "fp32 ring allreduce: 2(W-1)/W x numel x 4",
    wire_torch_16bit: "16-bit ring allreduce: 2(W-1)/W x numel x 2",
    wire_ddpx_16bit: ("ddpx 16-bit: on Gloo/CPU allgather of 16-bit bytes (W-1) x numel x 2; "
                      "on NCCL 16-bit ring allreduce 2(W-1)/W x numel x 2"),
    wire_none: "no communication: 0",
    wire_powersgd_fp32: ("PowerSGD: numel after compression per compressed step (from the state's "
                         "compression_stats(), counted step by step: uncompressed tensors + P + "
                         "Q of the compressed matrices) x 4 B x 2(W-1)/W (fp32 ring allreduce)"),
    wire_powersgd_16bit: ("fp16_compress_wrapper(powerSGD_hook): the same numel after "
                          "compression x 2 B, on Gloo/CPU gathered: (W-1) x numel x 2; on NCCL "
                          "16-bit ring allreduce 2(W-1)/W x numel x 2"),
    wire_post_local_sgd: ("post-local SGD, **mean over the run** (warm-up included): (S_warm x "
                          "2(W-1)/W x grad numel x 4 + (S - S_warm) x 2(G-1)/G x grad numel x 4 + "
                          "S_avg x 2(W-1)/W x param numel x 4) / S, with S steps, S_warm = "
                          "start_localSGD_iter global-gradient steps, G the subgroup size (1 "
                          "here: 0 B after the warm-up), S_avg the steps after which the "
                          "averager allreduced the parameters (every `period` steps after the "
                          "warm-up); the steady state after the warm-up is 1/period of an "
                          "allreduce step (results.json: local_sgd)"),
    wire_zero_powersgd: ("ZeRO overlapped with PowerSGD: PowerSGD's factors as above + the "
                         "parameter exchange as for ZeroRedundancyOptimizer"),
    wire_zero2: ("ZeRO-2 (reduce_scatter_hook): each gradient element sent once to its owner, "
                 "(W-1)/W x grad numel x 4, + the parameter exchange as for "
                 "ZeroRedundancyOptimizer, **mean over ranks**"),
    wire_zero: ("ZeroRedundancyOptimizer: fp32 ring allreduce of the gradients 2(W-1)/W x "
                "numel x 4 + the parameter exchange, **mean over ranks**: each rank broadcasts "
                "the parameters it owns to the W-1 others, (W-1)/W x param numel x 4 on average "
                "(a rank sends (W-1) x its shard's bytes with direct sends; per rank in "
                "results.json: zero)"),
}


# ---------------------------------------------------------------------------------------------
# The configurations. One entry per table row.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    name: str  # "hook" column
    registration: str  # "DDP default" / "drop-in" / "native"
    # Registers the hook on a fresh DDP model (called once per run, after DDP is built, so
    # stateful hooks get a fresh state) and returns the hook's state (a PowerSGDState for the
    # PowerSGD rows, read for the compression statistics). None: DDP's built-in allreduce.
    register: Optional[Callable[[DDP, argparse.Namespace], Any]]
    wire: Callable[[List[Bucket], WireContext], float]
    # "compression" column: payload ratio against fp32 allreduce (None: no communication). For
    # PowerSGD rows (powersgd=True), a factor on the state's compression_stats() rate (2 when
    # the factors travel in fp16).
    compression: Optional[float] = 1.0
    powersgd: bool = False
    # Build this row's DDP model with a single bucket (both bucket caps raised above the model).
    one_bucket: bool = False
    # Not run at all; the row says why.
    skip_note: Optional[str] = None
    # What the row says if registration raises on this backend (an expected refusal).
    unsupported_note: Optional[str] = None
    # Optional optimizer factory (e.g. post-local SGD's PostLocalSGDOptimizer); default SGD.
    make_optimizer: Optional[Callable[[DDP, argparse.Namespace], torch.optim.Optimizer]] = None
    # False for hooks that do not keep replicas in sync (noop): skips the sync check.
    synchronises: bool = True
    # Post-local SGD rows: the hook's state is a PostLocalSGDState and the optimizer a
    # PostLocalSGDOptimizer; bytes/step and compression come from what the run did.
    local_sgd: bool = False
    # ZeroRedundancyOptimizer rows: the optimizer shards its state; bytes/step add the
    # parameter exchange (wire_zero) and compression is an allreduce step's bytes / the row's.
    zero: bool = False
    # The optimizer steps inside the comm hook (ZeRO's overlap_with_ddp): no opt.step() call.
    overlap: bool = False
    # quantized_hook rows: the state is a QuantizedState (its start_iter gives the plain
    # allreduce steps); compression = an fp32 allreduce step's bytes / a quantized step's.
    quantized: bool = False


StateFactory = Callable[[argparse.Namespace], Any]
Register = Callable[[DDP, argparse.Namespace], Any]


def _register(fn: Callable[[DDP, Any], None], state: StateFactory) -> Register:
    def register(ddp: DDP, args: argparse.Namespace) -> Any:
        st = state(args)
        fn(ddp, st)
        return st
    return register


def drop_in(hook: Callable, state: StateFactory = lambda args: None) -> Register:
    """`ddp.register_comm_hook(state, hook)`: torch's API (torch's or ddpx's hook)."""
    return _register(lambda ddp, st: ddp.register_comm_hook(st, hook), state)


def native(hook: Callable, state: StateFactory = lambda args: None) -> Register:
    """`ddpx.register_comm_hook(ddp, state, hook)`: the C++ hook straight into DDP's Reducer."""
    return _register(lambda ddp, st: ddpx.register_comm_hook(ddp, st, hook), state)


H = ddpx.hooks


def powersgd_state(state_cls: type, rank: int) -> StateFactory:
    """A fresh PowerSGD state (ddpx's or torch's class: same arguments) per run: rank `rank`,
    compression from step `--powersgd-start` on, torch's defaults otherwise."""
    return lambda args: state_cls(process_group=None, matrix_approximation_rank=rank,
                                  start_powerSGD_iter=args.powersgd_start, random_seed=0)


def psgd(name: str, registration: str, hook: Callable, rank: int, **kw) -> Config:
    state_cls = (torch_powersgd.PowerSGDState if name.startswith("torch")
                 else H.PowerSGDState)
    reg = (drop_in if registration == "drop-in" else native)(hook, powersgd_state(state_cls, rank))
    kw.setdefault("wire", wire_powersgd_fp32)
    return Config(f"{name} r={rank}", registration, reg, powersgd=True, **kw)


def quantized(registration: str, bits: int, error_feedback: bool = True,
              stochastic: bool = False, rotation: str = "auto") -> Config:
    """A ddpx quantized_hook row: QuantizedState(bits=bits, use_error_feedback=error_feedback,
    stochastic_rounding=stochastic, start_iter=--quantized-start, random_seed=0), blocks of 256
    (the default), the exchange --quantized-exchange and `rotation` when they are not "auto" (an
    older ddpx has no such options); a fresh state per run."""
    def state(args: argparse.Namespace) -> Any:
        extra = {} if args.quantized_exchange == "auto" else {
            "exchange": args.quantized_exchange}
        if rotation != "auto":
            extra["rotation"] = rotation
        return H.QuantizedState(process_group=None, bits=bits,
                                use_error_feedback=error_feedback,
                                start_iter=args.quantized_start, random_seed=0,
                                stochastic_rounding=stochastic, **extra)

    reg = (drop_in if registration == "drop-in" else native)(H.quantized_hook, state)
    name = f"ddpx quantized_hook {bits} bit{'s' if bits > 1 else ''}"
    if not error_feedback:
        name += ", no error feedback"
    if stochastic:
        name += ", stochastic rounding"
    if rotation == "none":
        name += ", no rotation"
    return Config(name, registration, reg, wire_quantized(bits), quantized=True)


def torch_quantization(channel: int) -> Config:
    """torch's quantization_pertensor_hook (channel 0) or quantization_perchannel_hook (its
    default channels of 512), drop-in, with the model in one bucket: they issue their second
    allgather from a future callback, so with several buckets on Gloo the ranks can disagree on
    the collective order and hang."""
    if channel == 0:
        hook, name = torch_quant.quantization_pertensor_hook, "pertensor"
    else:
        hook, name = torch_quant.quantization_perchannel_hook, "perchannel"
    return Config(f"torch quantization_{name}_hook", "drop-in", drop_in(hook),
                  wire_torch_quantization(channel), compression=4.0, one_bucket=True)


_SUBGROUP: Dict[str, Any] = {}


def local_subgroup(args: argparse.Namespace) -> Any:
    """The post-local SGD rows' "intra-node" subgroup: consecutive ranks, `--localsgd-subgroup`
    (default 1) each, created once (dist.new_group is collective: every rank builds the runs
    in the same order) and passed explicitly to torch's and ddpx's states alike. With the 2
    ranks of the main job on one machine, a real intra-node group would be the whole world
    (local SGD would still allreduce every gradient globally), and torch's subgroup=None calls
    new_subgroups(), which raises ValueError without CUDA."""
    if "group" not in _SUBGROUP:
        world, g = dist.get_world_size(), args.localsgd_subgroup
        if g < 1 or world % g:
            raise ValueError(f"--localsgd-subgroup {g} does not divide the world size {world}")
        # What new_subgroups(group_size=g) does; torch 1.13's new_subgroups and
        # new_subgroups_by_enumeration raise ValueError ("Subgroups can only be created when
        # CUDA is available") whatever the arguments (2.x's only without a group_size). new_group
        # is collective: all ranks create every subgroup, in the same order.
        for k in range(0, world, g):
            grp = dist.new_group(ranks=list(range(k, k + g)))
            if k <= dist.get_rank() < k + g:
                _SUBGROUP["group"] = grp
    return _SUBGROUP["group"]


def local_sgd(name: str, registration: str, ddpx_side: bool, hierarchical: bool = False) -> Config:
    """A post-local SGD row: PostLocalSGDState(process_group=None, subgroup=local_subgroup(),
    start_localSGD_iter=--localsgd-start) with post_localSGD_hook, and SGD (as every other row)
    wrapped in PostLocalSGDOptimizer(PeriodicModelAverager(--localsgd-period, warmup_steps =
    start_localSGD_iter)): torch's classes for the torch row, ddpx's for the ddpx rows (looked up
    when the row runs, so an older ddpx fails that row only)."""
    def register(ddp: DDP, args: argparse.Namespace) -> Any:
        mod = H if ddpx_side else torch_localsgd
        st = mod.PostLocalSGDState(process_group=None, subgroup=local_subgroup(args),
                                   start_localSGD_iter=args.localsgd_start)
        if registration == "drop-in":
            ddp.register_comm_hook(st, mod.post_localSGD_hook)
        else:
            ddpx.register_comm_hook(ddp, st, mod.post_localSGD_hook)
        return st

    def make_optimizer(ddp: DDP, args: argparse.Namespace) -> torch.optim.Optimizer:
        sgd = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        if ddpx_side and hierarchical:
            # Two levels: the subgroup every period/2 steps, the whole world every period
            # steps (the last step is one of those, so the scored replicas are averaged).
            levels = collections.OrderedDict(
                [(max(1, args.localsgd_period // 2), args.localsgd_subgroup),
                 (args.localsgd_period, dist.get_world_size())])
            averager = ddpx.model_averaging.HierarchicalModelAverager(
                period_group_size_dict=levels, warmup_steps=args.localsgd_start)
            opt = ddpx.optim.PostLocalSGDOptimizer(sgd, averager)
            if not hasattr(opt, "averager"):  # local_sgd_wire reads it
                opt.averager = averager
            return opt
        if ddpx_side:
            averager = ddpx.model_averaging.PeriodicModelAverager(
                period=args.localsgd_period, warmup_steps=args.localsgd_start)
            opt = ddpx.optim.PostLocalSGDOptimizer(sgd, averager)
            if not hasattr(opt, "averager"):  # local_sgd_wire reads it (torch's has one)
                opt.averager = averager
            return opt
        averager = torch_averagers.PeriodicModelAverager(
            period=args.localsgd_period, warmup_steps=args.localsgd_start)
        return TorchPostLocalSGDOptimizer(sgd, averager)

    return Config(name, registration, register, wire_post_local_sgd,
                  make_optimizer=make_optimizer, local_sgd=True)


def zero_row(name: str, ddpx_side: bool, **zero_kw) -> Config:
    """A ZeroRedundancyOptimizer row: DDP's default allreduce, and the same SGD (lr, momentum
    0.9) as every other row as ZeRO's optimizer_class over ddp.parameters(), so that each rank
    keeps the momentum of its shard only; torch's class for the torch row, ddpx's (looked up
    when the row runs, so an older ddpx fails that row only) for the ddpx rows."""
    def make_optimizer(ddp: DDP, args: argparse.Namespace) -> torch.optim.Optimizer:
        cls = ddpx.optim.ZeroRedundancyOptimizer if ddpx_side else TorchZeroRedundancyOptimizer
        return cls(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=args.lr, momentum=0.9,
                   **zero_kw)

    return Config(name, "DDP default", None, wire_zero, make_optimizer=make_optimizer,
                  zero=True)


def zero_overlap_powersgd(name: str, rank: int) -> Config:
    """ddpx's ZeroRedundancyOptimizer(overlap_with_ddp=True) stepping inside ddpx's
    powerSGD_hook (rank `rank`, from --powersgd-start) through ddpx.hooks.hook_with_zero_step:
    the same SGD as every row, each rank updating and broadcasting its shard as the last bucket's
    hook runs. The PowerSGD state is the row's state (compression statistics)."""
    made: Dict[int, Any] = {}

    def register(ddp: DDP, args: argparse.Namespace) -> Any:
        st = powersgd_state(H.PowerSGDState, rank)(args)
        zero = ddpx.optim.ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=args.lr,
            momentum=0.9)
        ddp.register_comm_hook(st, H.hook_with_zero_step(H.powerSGD_hook, ddp, zero))
        made[id(ddp)] = zero
        return st

    def make_optimizer(ddp: DDP, args: argparse.Namespace) -> torch.optim.Optimizer:
        return made.pop(id(ddp))

    return Config(f"{name} r={rank}", "drop-in", register, wire_zero_powersgd, powersgd=True,
                  make_optimizer=make_optimizer, zero=True, overlap=True)


def zero2_row(name: str, **zero_kw) -> Config:
    """ddpx's ZeroRedundancyOptimizer behind ddpx.hooks.reduce_scatter_hook (ZeRO-2: each
    bucket's gradients reduce-scattered to their owners instead of all-reduced), stepped after
    backward: the same SGD as every row."""
    made: Dict[int, Any] = {}

    def register(ddp: DDP, args: argparse.Namespace) -> Any:
        zero = ddpx.optim.ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.SGD, lr=args.lr, momentum=0.9,
            **zero_kw)
        ddp.register_comm_hook(zero, H.reduce_scatter_hook)
        made[id(ddp)] = zero
        return zero

    def make_optimizer(ddp: DDP, args: argparse.Namespace) -> torch.optim.Optimizer:
        return made.pop(id(ddp))

    return Config(name, "drop-in", register, wire_zero2, make_optimizer=make_optimizer,
                  zero=True)


CONFIGS: List[Config] = [
    Config("no hook", "DDP default", None, wire_fp32_allreduce),
    Config("torch allreduce_hook", "drop-in", drop_in(torch_hooks.allreduce_hook),
           wire_fp32_allreduce),
    Config("ddpx allreduce_hook", "drop-in", drop_in(H.allreduce_hook), wire_fp32_allreduce),
    Config("ddpx allreduce_hook", "native", native(H.allreduce_hook), wire_fp32_allreduce),
    Config("torch fp16_compress_hook", "drop-in", drop_in(torch_hooks.fp16_compress_hook),
           wire_torch_16bit, compression=2.0),
    Config("ddpx fp16_compress_hook", "drop-in", drop_in(H.fp16_compress_hook), wire_ddpx_16bit,
           compression=2.0),
    Config("ddpx fp16_compress_hook", "native", native(H.fp16_compress_hook), wire_ddpx_16bit,
           compression=2.0),
    Config("torch bf16_compress_hook", "drop-in", drop_in(torch_hooks.bf16_compress_hook),
           wire_torch_16bit, compression=2.0, unsupported_note="unsupported by torch on Gloo"),
    Config("ddpx bf16_compress_hook", "native", native(H.bf16_compress_hook), wire_ddpx_16bit,
           compression=2.0),
    Config("ddpx fp16_compress_wrapper(allreduce_hook)", "native",
           native(H.fp16_compress_wrapper(H.allreduce_hook)), wire_ddpx_16bit, compression=2.0),
    psgd("ddpx powerSGD_hook", "native", H.powerSGD_hook, 1),
    psgd("ddpx powerSGD_hook", "native", H.powerSGD_hook, 2),
    psgd("ddpx powerSGD_hook", "native", H.powerSGD_hook, 4),
    psgd("ddpx batched_powerSGD_hook", "native", H.batched_powerSGD_hook, 1),
    psgd("ddpx fp16_compress_wrapper(powerSGD_hook)", "native",
         H.fp16_compress_wrapper(H.powerSGD_hook), 2, wire=wire_powersgd_16bit,
         compression=2.0),
    # torch's powerSGD_hook issues its P and Q allreduces from future callbacks; with several
    # buckets on Gloo the ranks can issue them in different orders (gloo::EnforceNotMet or a
    # hang: 4 runs of 4 with DDP's default two buckets here). With one bucket there is a single
    # chain of collectives (10 runs of 10 finished, identical results), so its model gets one.
    psgd("torch powerSGD_hook", "drop-in", torch_powersgd.powerSGD_hook, 2, one_bucket=True),
    # Post-local SGD: the hook + PostLocalSGDOptimizer(PeriodicModelAverager); the optimizer and
    # averager are torch's for the torch row, ddpx's for the ddpx rows.
    local_sgd("torch post_localSGD_hook + PostLocalSGDOptimizer", "drop-in", ddpx_side=False),
    local_sgd("ddpx post_localSGD_hook + PostLocalSGDOptimizer", "drop-in", ddpx_side=True),
    local_sgd("ddpx post_localSGD_hook + PostLocalSGDOptimizer", "native", ddpx_side=True),
    # ZeRO stage 1: DDP's allreduce, then each rank steps SGD on the parameters it owns and
    # broadcasts them. Same SGD on the same allreduced gradients, so the same result as "no
    # hook": checked, all three end with final weights bit-identical to no hook's (97.50%,
    # 6 epochs, torch 2.11 and 1.13; ddpx's fused SGD kernel included). Their optimizer state is
    # split by torch's whole-tensor partition: the 512x512 weight (87% of the parameters) on
    # one rank, the other five tensors on the other (see the "opt state/rank" column).
    zero_row("torch ZeroRedundancyOptimizer", ddpx_side=False),
    zero_row("ddpx ZeroRedundancyOptimizer", ddpx_side=True),
    zero_row("ddpx ZeroRedundancyOptimizer, bucket view", ddpx_side=True,
              parameters_as_bucket_view=True),
    # The step overlapped with the backward pass, inside ddpx's PowerSGD hook (torch's overlap
    # refuses Gloo): the same trajectory as "ddpx powerSGD_hook r=2".
    zero_overlap_powersgd("ddpx ZeRO overlap_with_ddp + powerSGD_hook", 2),
    # ddpx's balanced partition (the 512x512 weight split, so both ranks hold half the state),
    # with DDP's allreduce and with ZeRO-2's reduce-scatter (2 instead of 3 model sizes sent).
    zero_row("ddpx ZeroRedundancyOptimizer, balanced", ddpx_side=True, partition="balanced"),
    zero2_row("ddpx ZeRO-2 reduce_scatter_hook, balanced", partition="balanced"),
    # ddpx's quantized_hook: 8/4/2/1 bits with two-level error feedback and without, from step
    # --quantized-start on (plain allreduce before), DDP's default buckets.
    quantized("native", 8),
    quantized("native", 4),
    quantized("native", 2),
    quantized("native", 1),
    quantized("native", 8, error_feedback=False),
    quantized("native", 4, error_feedback=False),
    quantized("native", 2, error_feedback=False),
    quantized("native", 1, error_feedback=False),
    # Without error feedback "auto" rotates every block; these rows show what the rotation buys.
    quantized("native", 2, error_feedback=False, rotation="none"),
    quantized("native", 1, error_feedback=False, rotation="none"),
    # Stochastic rounding: unbiased too, at the price of max|v| scales (more variance than the
    # rotation's unbiased sign scale).
    quantized("native", 2, error_feedback=False, stochastic=True),
    quantized("native", 1, error_feedback=False, stochastic=True),
    quantized("drop-in", 8),
    # torch's quantization hooks (uint8 allgathers, no error feedback), each in one bucket.
    torch_quantization(0),
    torch_quantization(512),
    Config("ddpx noop_hook", "native", native(H.noop_hook), wire_none, compression=None,
           synchronises=False),
]

# With --coverage (the multi-node tests): every ddpx hook in the registration the table above
# leaves out, the bf16 wrapper, the hierarchical averager. Not in the main job's table: these
# rows repeat trajectories that are already there (a drop-in row ends bit-identical to its
# native row).
COVERAGE_CONFIGS: List[Config] = [
    Config("ddpx bf16_compress_hook", "drop-in", drop_in(H.bf16_compress_hook), wire_ddpx_16bit,
           compression=2.0),
    Config("ddpx fp16_compress_wrapper(allreduce_hook)", "drop-in",
           drop_in(H.fp16_compress_wrapper(H.allreduce_hook)), wire_ddpx_16bit, compression=2.0),
    Config("ddpx bf16_compress_wrapper(allreduce_hook)", "native",
           native(H.bf16_compress_wrapper(H.allreduce_hook)), wire_ddpx_16bit, compression=2.0),
    Config("ddpx bf16_compress_wrapper(allreduce_hook)", "drop-in",
           drop_in(H.bf16_compress_wrapper(H.allreduce_hook)), wire_ddpx_16bit, compression=2.0),
    psgd("ddpx powerSGD_hook", "drop-in", H.powerSGD_hook, 2),
    psgd("ddpx batched_powerSGD_hook", "drop-in", H.batched_powerSGD_hook, 1),
    psgd("ddpx bf16_compress_wrapper(powerSGD_hook)", "native",
         H.bf16_compress_wrapper(H.powerSGD_hook), 2, wire=wire_powersgd_16bit,
         compression=2.0),
    local_sgd("ddpx post_localSGD_hook + PostLocalSGDOptimizer(HierarchicalModelAverager)",
              "native", ddpx_side=True, hierarchical=True),
    Config("ddpx noop_hook", "drop-in", drop_in(H.noop_hook), wire_none, compression=None,
           synchronises=False),
]


# ---------------------------------------------------------------------------------------------
# Data, model, training
# ---------------------------------------------------------------------------------------------
def load_digits_split(seed: int):
    """The real sklearn `digits` (1797 8x8 images), a fixed stratified 80/20 split,
    standardised with the training set's statistics.

    Cached per seed, scikit-learn and torch version under $DDPX_DIGITS_CACHE (default
    ~/.cache/ddpx/digits; empty: no cache): importing sklearn and splitting costs each rank
    seconds of CPU, a large part of the short jobs that the tests launch dozens of times. The
    file holds the tensors this function returns, so a cached run trains on exactly the same
    data."""
    from importlib import metadata

    cache_dir = os.environ.get("DDPX_DIGITS_CACHE",
                               os.path.join(os.path.expanduser("~"), ".cache", "ddpx", "digits"))
    try:
        sklearn_version = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:  # installed without metadata: no safe cache key
        cache_dir = ""
    path = (os.path.join(cache_dir, f"split-seed{seed}-sklearn{sklearn_version}"
                         f"-torch{torch.__version__.split('+')[0]}.pt")
            if cache_dir else "")
    if path and os.path.exists(path):
        try:
            return tuple(torch.load(path))
        except Exception:  # a torn or foreign file: recompute and rewrite it
            pass
    split = _compute_digits_split(seed)
    if path:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            # Ranks may write at once: each writes its own file and renames it into place.
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save(list(split), tmp)
            os.replace(tmp, path)
        except OSError:
            pass
    return split


def _compute_digits_split(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)
    f = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    g = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return f(x_tr), g(y_tr), f(x_te), g(y_te)


@dataclasses.dataclass
class Task:
    """What the job trains: the data (x_train, y_train, x_test, y_test; y a class index), the
    network (called under torch.manual_seed(seed): the same initial weights on every rank), and
    the words the report uses for them. Another example trains every configuration on another
    task by passing its own to `main` (benchmarks/train_charlm.py)."""
    title: str  # "digits MLP": the pictures' and the table's name of the task
    model: str  # "MLP 64-512-512-10"
    test_set: str  # "the whole test set (360 images)"
    data: Tuple[torch.Tensor, ...]
    make_net: Callable[[], nn.Module]


def digits_task(args) -> Task:
    data = load_digits_split(args.seed)
    return Task(title="digits MLP",
                model="MLP 64-" + "-".join([str(args.hidden)] * args.depth) + "-10",
                test_set=f"the whole test set ({len(data[2])} images)", data=data,
                make_net=lambda: make_mlp(args.hidden, args.depth))


def make_mlp(hidden: int, depth: int) -> nn.Module:
    layers: List[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def bucket_layout(ddp: DDP, model: nn.Module) -> List[Bucket]:
    """The buckets DDP's Reducer actually uses (after its rebuild on the first iterations), from
    DDP's own logging data: sizes in bytes and the parameters in each bucket."""
    data = ddp._get_ddp_logging_data()
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype
    if data.get("has_rebuilt_buckets") and data.get("rebuilt_bucket_sizes"):
        sizes = [int(s) for s in str(data["rebuilt_bucket_sizes"]).split(",")]
        idx = [[int(i) for i in grp.split()] for grp in
               str(data.get("rebuilt_per_bucket_param_indices", "")).split(",")]
    else:
        sizes = [int(s) for s in str(data["bucket_sizes"]).split(",")]
        idx = []
    buckets = []
    for k, nbytes in enumerate(sizes):
        shapes = [params[i].shape for i in idx[k]] if len(idx) == len(sizes) else None
        if shapes is not None:
            assert sum(math.prod(s) for s in shapes) * _elem(dtype) == nbytes, (shapes, nbytes)
        buckets.append(Bucket(nbytes // _elem(dtype), dtype, shapes))
    return buckets


def probe_buckets(make_model, x, y, device) -> List[Dict[str, Any]]:
    """Observes the buckets a hook really receives (numel, dtype) for a few steps, with a Python
    hook wrapping torch's allreduce_hook: a cross-check of the layout `bucket_layout` reads."""
    model = make_model()
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    seen: List[Dict[str, Any]] = []

    def recording_hook(state, bucket):
        buf = bucket.buffer()
        seen.append({"index": bucket.index(), "numel": buf.numel(), "dtype": str(buf.dtype)})
        return torch_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, recording_hook)
    for _ in range(3):
        seen.append({"step": True})
        nn.functional.cross_entropy(ddp(x[:16]), y[:16]).backward()
    # Keep the last step's buckets (after DDP's rebuild).
    last = len(seen) - 1 - seen[::-1].index({"step": True})
    return seen[last + 1:]


def make_ddp(model: nn.Module, device: torch.device, one_bucket: bool = False) -> DDP:
    """DDP with its default buckets, or with one bucket: torch 1.13-2.x read the first bucket's
    cap from `dist._DEFAULT_FIRST_BUCKET_BYTES` when DDP is built (also for the rebuild after
    the first iteration), the others from `bucket_cap_mb`."""
    ids = [device] if device.type == "cuda" else None
    if not one_bucket:
        return DDP(model, device_ids=ids)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cap = 2 * nbytes + 2**20
    saved = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = cap
    try:
        return DDP(model, device_ids=ids, bucket_cap_mb=cap / 2**20)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved


def inner_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: a ZeroRedundancyOptimizer's `.optim` (the
    local optimizer of the rank's shard), a PostLocalSGDOptimizer's wrapped optimizer (`.optim`,
    torch's and ddpx's), otherwise the optimizer itself."""
    while isinstance(getattr(opt, "optim", None), torch.optim.Optimizer):
        opt = opt.optim
    return opt


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) optimizer state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class Run:
    """One configuration's training: its own model (same initial weights as every other), DDP
    wrapper, hook and optimizer. All runs advance together, one step each in turn, on the same
    batches (see `train_all`)."""

    def __init__(self, cfg: Config, args, make_model, device):
        self.cfg, self.device = cfg, device
        self.row: Dict[str, Any] = {"hook": cfg.name, "registration": cfg.registration}
        self.model = make_model()
        self.ddp = make_ddp(self.model, device, cfg.one_bucket)
        self.step_ms: List[float] = []
        self.epoch_loss: List[float] = []
        self.step_loss: List[float] = []  # this rank's loss of every step
        self.loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of batch losses, batches)
        self.opt: Optional[torch.optim.Optimizer] = None
        self.state: Any = None  # the hook's state (PowerSGD rows: for compression_stats())
        self.numel_after: List[int] = []  # PowerSGD: numel after compression, per step
        if cfg.skip_note is not None:
            self.row.update(status="skipped", note=cfg.skip_note, error="")
            self.ddp = None
            return
        if cfg.register is not None:
            try:
                self.state = cfg.register(self.ddp, args)
            except Exception as exc:  # a refusal at registration: the same on every rank
                self.fail(exc, cfg.unsupported_note or "registration failed",
                          "unsupported" if cfg.unsupported_note else "error")
                return
        try:
            self.opt = (cfg.make_optimizer(self.ddp, args) if cfg.make_optimizer else
                        torch.optim.SGD(self.ddp.parameters(), lr=args.lr, momentum=0.9))
        except Exception as exc:  # e.g. an optimizer class this ddpx lacks: the same everywhere
            self.fail(exc, "optimizer failed")

    @property
    def alive(self) -> bool:
        return "status" not in self.row

    def fail(self, exc: BaseException, note: str, status: str = "error") -> None:
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        self.row.update(status=status, note=note, error=msg)
        self.ddp = self.opt = self.state = None

    def step(self, xb: torch.Tensor, yb: torch.Tensor) -> None:
        sync = self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        # Start every timed step together on all ranks: otherwise the skew a step leaves (noop
        # does not synchronise at all) is charged to whichever configuration steps next.
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.ddp(xb), yb)
        loss.backward()
        if not self.cfg.overlap:
            self.opt.step()
        if sync:
            torch.cuda.synchronize(self.device)
        self.step_ms.append((time.perf_counter() - t0) * 1e3)
        self.step_loss.append(loss.item())
        self.loss_sum[0] += self.step_loss[-1]
        self.loss_sum[1] += 1
        if self.cfg.powersgd:  # what this step added to the state's running totals
            after = self.state.compression_stats()[2]
            self.numel_after.append(after - sum(self.numel_after))

    def local_sgd_wire(self, args, buckets: List[Bucket], ctx: WireContext):
        """Post-local SGD rows: what the run did (global-gradient steps from the hook state's
        iter, averaging steps from the averager's schedule), for wire_post_local_sgd; the
        compression column = an fp32 allreduce step's bytes / this row's mean bytes per step."""
        steps = len(self.step_ms)
        averager = self.opt.averager
        # A hierarchical averager: its global level (the subgroup levels of the coverage row
        # are single ranks, which send nothing).
        period = getattr(averager, "period", None) or max(averager.period_process_group_dict)
        start, warm = self.state.start_localSGD_iter, averager.warmup_steps
        avg_steps = sum(1 for k in range(steps) if k >= warm and (k - warm) % period == 0)
        # The hook's iter counts the global-allreduce steps and stops at start_localSGD_iter.
        assert self.state.iter == min(start, steps), (self.state.iter, start, steps)
        assert averager.step == steps, (averager.step, steps)
        params = [p for p in self.model.parameters() if p.requires_grad]
        run = LocalSGDRun(steps=steps, grad_global_steps=self.state.iter,
                          subgroup_size=self.state.subgroup.size(),
                          averaging_steps=avg_steps,
                          param_numel=sum(p.numel() for p in params), param_dtype=params[0].dtype)
        ctx = dataclasses.replace(ctx, local_sgd=run)
        mean = wire_post_local_sgd(buckets, ctx)
        after = dataclasses.replace(ctx, local_sgd=dataclasses.replace(
            run, steps=period, grad_global_steps=0, averaging_steps=1))
        self.row["local_sgd"] = dict(
            start_localSGD_iter=start, period=period, warmup_steps=warm,
            subgroup_size=run.subgroup_size, steps=steps, grad_global_steps=run.grad_global_steps,
            averaging_steps=avg_steps, state_iter=self.state.iter, averager_step=averager.step,
            bytes_per_step_after_warmup=wire_post_local_sgd(buckets, after),
            bytes_per_allreduce_step=wire_fp32_allreduce(buckets, ctx))
        return ctx, (wire_fp32_allreduce(buckets, ctx) / mean if mean > 0 else None)

    def end_epoch(self) -> None:
        red = self.loss_sum.to(self.device)
        dist.all_reduce(red)  # all-rank mean training loss of the epoch
        self.epoch_loss.append(float(red[0] / red[1]))
        self.loss_sum.zero_()

    def finish(self, args, data, ctx: WireContext, rank: int, world: int) -> Dict[str, Any]:
        x_te, y_te = data[2], data[3]
        # Test accuracy over the whole test set: each rank scores its share with its replica.
        with torch.no_grad():
            mine = torch.arange(rank, len(x_te), world, device=x_te.device)
            logits = self.model(x_te[mine])
            pred = logits.argmax(dim=1)
            counts = torch.tensor([(pred == y_te[mine]).sum().item(), len(mine),
                                   nn.functional.cross_entropy(logits, y_te[mine],
                                                               reduction="sum").item()],
                                  dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)  # correct, scored, summed cross-entropy
        # Are the replicas identical? (max |w_rank - w_rank0| over all weights and ranks)
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).double()
        ref = flat.clone()
        dist.broadcast(ref, 0)
        spread = (flat - ref).abs().max().reshape(1)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        warm = min(args.warmup_steps, len(self.step_ms) - 1)
        med = torch.tensor([statistics.median(self.step_ms[warm:])], dtype=torch.float64,
                           device=self.device)
        dist.all_reduce(med)  # mean over ranks of each rank's median
        step_loss = torch.tensor(self.step_loss, dtype=torch.float64, device=self.device)
        dist.all_reduce(step_loss)  # all-rank mean loss of every step
        buckets = bucket_layout(self.ddp, self.model)
        cfg = self.cfg
        compression = cfg.compression
        # "opt state/rank": bytes of the tensors in each rank's optimizer state at the end (SGD:
        # a momentum buffer per parameter it updates), and which parameters each rank's
        # (innermost) optimizer updates: ZeRO's local shard, all of them otherwise.
        inner = inner_optimizer(self.opt)
        params = list(self.model.parameters())
        # The fraction of each parameter's elements this rank updates: 0 or 1, or a piece's
        # share under ddpx's balanced partition (its local optimizer holds slices).
        if hasattr(self.opt, "_owner_ranges"):
            share = [sum(e - b for b, e, o in self.opt._owner_ranges(p) if o == rank)
                     / max(1, p.numel()) for p in params]
        else:
            updates = {id(p) for g in inner.param_groups for p in g["params"]}
            share = [float(id(p) in updates) for p in params]
        per_rank = torch.zeros(3, world, dtype=torch.float64, device=self.device)
        per_rank[0, rank] = tensor_bytes(list(inner.state.values()))
        per_rank[1, rank] = sum(f * p.numel() * p.element_size() for f, p in zip(share, params))
        per_rank[2, rank] = sum(1 for f in share if f > 0)
        owners = torch.tensor(share, dtype=torch.float64, device=self.device)
        dist.all_reduce(per_rank)
        dist.all_reduce(owners)  # ranks that update each parameter
        state_bytes = [int(v) for v in per_rank[0].tolist()]
        if cfg.zero:
            shard_bytes = [int(round(v)) for v in per_rank[1].tolist()]
            ctx = dataclasses.replace(ctx, zero_shard_bytes=shard_bytes)
            compression = wire_fp32_allreduce(buckets, ctx) / cfg.wire(buckets, ctx)
            self.row["zero"] = dict(
                shard_param_bytes_per_rank=shard_bytes,
                shard_params_per_rank=[int(v) for v in per_rank[2].tolist()],
                # ZeRO's partition: every parameter updated (and broadcast) by exactly one rank.
                every_param_owned_once=bool(((owners - 1).abs() < 1e-9).all()),
                param_exchange_bytes_per_step_per_rank=[(world - 1) * b for b in shard_bytes],
            )
        if cfg.powersgd:
            rate, before, after = self.state.compression_stats()
            compressed = [n for n in self.numel_after if n > 0]
            # The layout is fixed, so every compressed step sends the same numel.
            assert len(set(compressed)) <= 1, compressed
            ctx = dataclasses.replace(ctx, compressed_numel=compressed[-1] if compressed else 0)
            compression = rate * cfg.compression
            self.row.update(
                powersgd=dict(
                    start_powerSGD_iter=self.state.start_powerSGD_iter,
                    compressed_steps=len(compressed),
                    compression_stats=[rate, before, after],
                    numel_after_per_compressed_step=ctx.compressed_numel,
                    numel_before_per_compressed_step=before // max(1, len(compressed)),
                ),
                # Over the whole run, the plain fp32 allreduce steps before the start included.
                bytes_per_step_run_mean=(
                    len(compressed) * cfg.wire(buckets, ctx) + (len(self.step_ms) - len(compressed))
                    * wire_fp32_allreduce(buckets, ctx)) / len(self.step_ms))
        if cfg.quantized:
            compression = wire_fp32_allreduce(buckets, ctx) / cfg.wire(buckets, ctx)
            plain = min(self.state.start_iter, len(self.step_ms))
            self.row.update(
                quantized=dict(bits=self.state.bits, block_size=self.state.block_size,
                               use_error_feedback=self.state.use_error_feedback,
                               start_iter=self.state.start_iter, iter=self.state.iter),
                # Over the whole run, the plain fp32 allreduce steps before start_iter included.
                bytes_per_step_run_mean=(
                    (len(self.step_ms) - plain) * cfg.wire(buckets, ctx)
                    + plain * wire_fp32_allreduce(buckets, ctx)) / len(self.step_ms))
        if cfg.local_sgd:
            ctx, compression = self.local_sgd_wire(args, buckets, ctx)
        if cfg.one_bucket and len(buckets) != 1:
            raise RuntimeError(f"{cfg.name}: expected one DDP bucket, got {len(buckets)}")
        self.row.update(
            status="ok",
            test_acc=float(counts[0] / counts[1]),
            test_loss=float(counts[2] / counts[1]),
            ms_per_step=float(med.item() / world),
            compression=compression,
            bytes_per_step=cfg.wire(buckets, ctx),
            wire_model=WIRE_FOOTNOTES.get(cfg.wire, cfg.wire.__doc__ or cfg.wire.__name__),
            final_loss=self.epoch_loss[-1],
            opt_state_bytes_per_rank=state_bytes,
            loss_curve=self.epoch_loss,
            step_loss=(step_loss / world).tolist(),
            steps=len(self.step_ms),
            warmup_steps=warm,
            replica_spread=float(spread.item()),
            buckets=[{"numel": b.numel, "dtype": str(b.dtype),
                      "params": [list(s) for s in b.param_shapes] if b.param_shapes else None}
                     for b in buckets],
            final_weights_rank0=flat.float().cpu() if rank == 0 else None,
        )
        self.ddp = self.opt = self.state = None
        return self.row


def train_all(configs: List[Config], args, make_model, data, device, ctx: WireContext,
              rank: int, world: int, log) -> List[Dict[str, Any]]:
    """Trains every configuration on the same batches, interleaved step by step (rotating which
    goes first), so that a change in the machine's load hits all of them alike."""
    x_tr, y_tr = data[0], data[1]
    runs = [Run(cfg, args, make_model, device) for cfg in configs]
    for r in runs:
        if not r.alive:
            log(f"  {r.cfg.name} ({r.cfg.registration}): {r.row['note']}: {r.row['error']}")
    sampler = DistributedSampler(range(len(x_tr)), num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    step = 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.long, device=x_tr.device)
        for b in range(len(order) // args.batch_size):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            xb, yb = x_tr[idx], y_tr[idx]
            live = [r for r in runs if r.alive]
            k = step % max(1, len(live))
            for r in live[k:] + live[:k]:
                try:
                    r.step(xb, yb)
                except Exception as exc:  # report it in the table, go on with the others
                    log(f"  {r.cfg.name} ({r.cfg.registration}) failed at step {step}:\n"
                        + traceback.format_exc())
                    r.fail(exc, f"failed: {type(exc).__name__}")
            step += 1
        for r in runs:
            if r.alive:
                r.end_epoch()
        log(f"  epoch {epoch + 1}/{args.epochs}: "
            f"{time.perf_counter() - t0:.1f} s, loss "
            + " ".join(f"{r.epoch_loss[-1]:.3f}" for r in runs if r.alive))
    rows = [r.finish(args, data, ctx, rank, world) if r.alive else r.row for r in runs]
    for row in rows:
        if row["status"] == "ok":
            log(f"  {row['hook']:50s} {row['registration']:12s} acc "
                f"{100 * row['test_acc']:6.2f}%  {row['ms_per_step']:7.2f} ms/step  "
                f"{fmt_compression(row['compression']):>7s}  "
                f"{row['bytes_per_step']:>12,.0f} B/step  "
                f"opt state {fmt_state(row['opt_state_bytes_per_rank']):>13s}  "
                f"loss {row['final_loss']:.5f}")
    return rows


# ---------------------------------------------------------------------------------------------
# Reporting (rank 0)
# ---------------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    return f"{n:,.0f} B ({n / 2**20:.2f} MiB)"


def fmt_compression(c: Optional[float]) -> str:
    if c is None:
        return "—"
    return f"{c:.0f}x" if c == int(c) else f"{c:.1f}x"


def fmt_state(per_rank: List[int]) -> str:
    """Optimizer-state bytes per rank: one figure where the ranks agree, else rank 0 / rank 1 /
    ... (max / min beyond 4 ranks)."""
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    if len(set(per_rank)) == 1:
        return f"{mib(per_rank[0])} MiB"
    if len(per_rank) <= 4:
        return " / ".join(map(mib, per_rank)) + " MiB"
    return f"max {mib(max(per_rank))} / min {mib(min(per_rank))} MiB"


def render_markdown(rows, meta) -> str:
    lines = [
        f"### ddpx main job: {meta['task']}, {meta['world']} ranks, {meta['backend']} on "
        f"{meta['device_type']}, torch {meta['torch']}",
        "",
        "| hook | registration | test acc | ms/step | compression | bytes sent/step "
        "| opt state/rank | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    marks: Dict[str, str] = {}
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['hook']} | {r['registration']} | {r['note']} | — | — | — | — "
                         "| — |")
            continue
        mark = marks.setdefault(r["wire_model"], "*" * (len(marks) + 1))
        lines.append(
            f"| {r['hook']} | {r['registration']} | {100 * r['test_acc']:.2f}% | "
            f"{r['ms_per_step']:.2f} | {fmt_compression(r['compression'])} | "
            f"{fmt_bytes(r['bytes_per_step'])}{mark} | "
            f"{fmt_state(r['opt_state_bytes_per_rank'])} | {r['final_loss']:.5f} |")
    lines += ["", f"Model: {meta['model']} ({meta['n_params']:,} parameters), DDP buckets "
              f"(numel, dtype as DDP's Reducer built them): {meta['buckets']}; "
              f"{meta['epochs']} epochs, batch {meta['batch_size']} per rank, "
              f"{meta['steps_per_config']} steps per configuration, SGD lr {meta['lr']} "
              "momentum 0.9; every configuration starts from the same weights and sees the "
              "same data order.", ""]
    lines.append(f"- test acc: {meta['test_set']}, each rank scoring its share with its own "
                 "replica (the test loss, in results.json, likewise). ms/step: forward + "
                 "backward (with the hook) + optimizer step, "
                 f"median over the steps after the first {meta['warmup_steps']} (warm-up), mean "
                 "over ranks; the configurations train interleaved, one step each in turn on "
                 "the same batch, each step starting on all ranks together (barrier, not timed), "
                 "so that the load of a shared machine hits all alike. "
                 "final loss: all-rank mean training loss of the last epoch.")
    lines.append("- compression: gradient payload of a step relative to an fp32 allreduce: 2x for "
                 "the fp16/bf16 hooks, 1x for the other allreduces, — for noop (sends nothing); "
                 "PowerSGD rows: the state's `compression_stats()` rate (numel before / numel "
                 "after compression, over the compressed steps; the uncompressed 1-D biases "
                 "included), times 2 for fp16_compress_wrapper(powerSGD_hook); post-local "
                 "SGD and ZeroRedundancyOptimizer rows: an fp32 allreduce step's bytes / the "
                 "row's bytes sent per step (ZeRO sends the gradient allreduce and the parameter "
                 "exchange: below 1x).")
    lines.append("- bytes sent/step: bytes one rank sends per step, **a model, not a measurement**"
                 f", summed over the buckets above (W = {meta['world']} ranks):")
    for model_text, mark in marks.items():
        lines.append(f"  - {mark.replace('*', chr(92) + '*')} {model_text}")
    lines.append("- opt state/rank: bytes of the tensors in each rank's optimizer state at the end "
                 "of training (SGD momentum: one buffer per parameter the rank updates), "
                 "measured from the state tensors: the optimizer's `state`, the wrapped "
                 "optimizer's for PostLocalSGDOptimizer, the local shard's (`.optim.state`) for "
                 "ZeroRedundancyOptimizer; one figure where all ranks agree, else rank 0 / rank 1 "
                 "(exact bytes per rank in results.json: opt_state_bytes_per_rank).")
    if meta.get("powersgd_start") is not None:
        lines.append(
            f"- PowerSGD rows: rank r = matrix_approximation_rank, start_powerSGD_iter = "
            f"{meta['powersgd_start']} (of {meta['steps_per_config']} steps; plain fp32 "
            "allreduce before it, so the bytes/step above are those of a compressed step; the "
            "whole-run mean is in results.json), other arguments torch's defaults "
            "(min_compression_rate 2, error feedback, warm start, random_seed 0); biases are "
            "never compressed. torch's powerSGD_hook runs with its DDP model in one bucket: with "
            "several buckets on Gloo it issues collectives from future callbacks in an order "
            "the ranks can disagree on (gloo::EnforceNotMet or a hang); ddpx's hooks use DDP's "
            "default buckets. torch's batched_powerSGD_hook is not in the table: torch's (1.13, "
            "2.11 and 2.15 alike) fails with an AssertionError in _orthogonalize.")
    if meta.get("quantized_start") is not None:
        lines.append(
            f"- quantized_hook rows: QuantizedState(bits, use_error_feedback, start_iter = "
            f"{meta['quantized_start']}, exchange = {meta.get('quantized_exchange', 'auto')!r}), "
            "block_size 256, nearest rounding unless the row says "
            "stochastic; plain fp32 allreduce "
            "for the first start_iter steps, so the bytes/step and compression above are those "
            "of a quantized step (the whole-run mean is in results.json). torch's quantization "
            "hooks run with their DDP model in one bucket: they issue a collective from a "
            "future callback, which with several buckets on Gloo can hang.")
    notes = meta.get("notes") or []
    for n in notes:
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


# The families the pictures group rows by: (name, substrings of the hook column), first match.
FAMILIES = [("PowerSGD", ("powerSGD",)), ("quantized, no error feedback", ("no error feedback",)),
            ("quantized", ("quantiz",)),
            ("post-local SGD", ("post_localSGD",)), ("ZeRO", ("Zero", "ZeRO")),
            ("16-bit", ("fp16", "bf16")), ("allreduce", ("allreduce", "no hook")),
            ("noop", ("noop",))]
_FAMILY_MARKERS = {"PowerSGD": "D", "quantized": "s", "quantized, no error feedback": "p",
                   "post-local SGD": "^", "ZeRO": "P", "16-bit": "v", "allreduce": "o",
                   "noop": "X", "other": "*"}


def family_of(hook: str) -> str:
    for name, keys in FAMILIES:
        if any(k in hook for k in keys):
            return name
    return "other"


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only; imported late: the jobs that draw
    nothing never pay for it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _smoothed_loss(row, win: int):
    loss = torch.tensor(row["step_loss"], dtype=torch.float64)
    win = max(1, min(win, len(loss)))
    smooth = torch.nn.functional.avg_pool1d(loss[None, None], win, 1)[0, 0]
    return (torch.arange(len(smooth)) + win).numpy(), smooth.numpy()


def plot_accuracy_vs_bytes(rows, path: str, title: str) -> None:
    """One point per row: test accuracy against the bytes a rank sends per step (the table's
    model), log scale. torch's rows hollow and orange, ddpx's filled and blue, the marker the
    family. Rows with the same bytes and accuracy (a hook drop-in and native, torch's and
    ddpx's when bit-identical) share a point and a number; the key beside the axes names them,
    so no label sits on another. Rows that send nothing (noop) have no place on a log axis and
    are named under the key."""
    plt = _pyplot()

    ok = [r for r in rows if r["status"] == "ok"]
    points: Dict[Tuple[float, float], List[Dict[str, Any]]] = {}
    silent = []
    for r in ok:
        if not r.get("bytes_per_step"):
            silent.append(r)
            continue
        points.setdefault((round(float(r["bytes_per_step"])), round(100 * r["test_acc"], 2)),
                          []).append(r)
    if not points:
        return
    fig, (ax, key) = plt.subplots(1, 2, figsize=(13, 8), gridspec_kw={"width_ratios": [3, 2]})
    order = sorted(points, key=lambda p: (-p[0], -p[1]))
    xs = [p[0] for p in order]
    ys = [p[1] for p in order]
    ax.set_xscale("log")
    ax.set_xlim(min(xs) / 1.6, max(xs) * 1.6)
    pad = max(0.1, (max(ys) - min(ys)) * 0.08)
    ax.set_ylim(min(ys) - pad, max(ys) + pad)
    placed: List[Tuple[float, float]] = []  # label anchors in pixels, to keep them apart

    def label_offset(b: float, acc: float) -> Tuple[int, int]:
        px, py = ax.transData.transform((b, acc))
        for dx, dy in ((7, 4), (7, -13), (-16, 4), (-16, -13), (7, 15), (-16, 15), (7, -24),
                       (-16, -24), (18, 4), (18, -13)):
            if all(abs(px + dx - qx) > 12 or abs(py + dy - qy) > 10 for qx, qy in placed):
                placed.append((px + dx, py + dy))
                return dx, dy
        placed.append((px + 7, py + 4))
        return 7, 4

    lines = []
    for n, (b, acc) in enumerate(order, 1):
        group = points[(b, acc)]
        torch_only = all(r["hook"].startswith("torch") for r in group)
        has_torch = any(r["hook"].startswith("torch") for r in group)
        fam = family_of(group[0]["hook"])
        # torch's points are larger open rings drawn on top, so that a ddpx point at (nearly)
        # the same place shows inside one.
        face = "none" if torch_only else "tab:blue"
        edge = "tab:orange" if has_torch else "tab:blue"
        ax.scatter([b], [acc], marker=_FAMILY_MARKERS[fam], s=150 if torch_only else 70,
                   facecolor=face, edgecolor=edge, linewidth=1.8, zorder=4 if torch_only else 3)
        ax.annotate(str(n), (b, acc), textcoords="offset pixels",
                    xytext=label_offset(b, acc), fontsize=8)
        names = "; ".join(f"{r['hook']} ({r['registration']})" for r in group)
        lines.append(f"{n:>2}  {acc:.2f}%  {b / 1e6:.3g} MB  {names}")
    ax.set_xlabel("bytes a rank sends per step (modelled from the buckets), log scale")
    ax.set_ylabel("test accuracy at the end (%)")
    ax.set_title(f"{title}: accuracy against bytes per step")
    ax.grid(True, which="both", alpha=0.3)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], marker=_FAMILY_MARKERS[f], linestyle="", color="gray", label=f)
               for f in dict.fromkeys(family_of(r["hook"]) for r in ok if r not in silent)]
    handles += [Line2D([], [], marker="o", linestyle="", markerfacecolor="tab:blue",
                       markeredgecolor="tab:blue", label="ddpx"),
                Line2D([], [], marker="o", linestyle="", markerfacecolor="none",
                       markeredgecolor="tab:orange", label="torch"),
                Line2D([], [], marker="o", linestyle="", markerfacecolor="tab:blue",
                       markeredgecolor="tab:orange", label="torch and ddpx, same point")]
    # Under the axes: inside them it would cover points, beside them the key.
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11),
              ncol=4, frameon=False)
    key.axis("off")
    if silent:
        lines.append("not drawn (no bytes sent): " + ", ".join(
            f"{r['hook']} ({r['registration']}) {100 * r['test_acc']:.2f}%" for r in silent))
    wrapped = [textwrap.fill(t, 62, subsequent_indent="      ") for t in lines]
    key.text(0, 1, "\n".join(wrapped), va="top", ha="left", family="monospace",
             fontsize=max(5.0, min(8.0, 480 / max(1, sum(w.count("\n") + 1
                                                        for w in wrapped)))),
             transform=key.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(rows, path: str, steps_per_epoch: int, title: str) -> None:
    """The training loss per step (all-rank mean, moving average over half an epoch) as small
    multiples: a panel per family of hooks, each with the first row (DDP's default) in grey
    beneath its own rows, so that no panel holds more than a handful of lines."""
    plt = _pyplot()

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    base, rest = ok[0], ok[1:]
    fams = list(dict.fromkeys(family_of(r["hook"]) for r in rest)) or ["allreduce"]
    cols = min(4, max(2, len(fams)))  # two at least: the title needs the width
    nrows = (len(fams) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.8 * nrows), squeeze=False,
                             sharex=True, sharey=True)
    win = max(1, steps_per_epoch // 2)
    bx, by = _smoothed_loss(base, win)
    styles = ["-", "--", "-.", ":"]
    for ax, fam in zip(axes.flat, fams):
        ax.plot(bx, by, color="0.6", linewidth=2.5, label=f"{base['hook']}")
        mine = [r for r in rest if family_of(r["hook"]) == fam]
        for i, r in enumerate(mine):
            style = dict(linestyle=styles[i % 4], linewidth=1.3, color=plt.cm.tab10(i % 10))
            if not math.isfinite(r.get("final_loss", math.nan)):
                # A diverged run's loss climbs by many orders of magnitude before it turns NaN
                # and would flatten every other curve of its panel: in the legend only.
                ax.plot([], [], label=f"{r['hook']} ({r['registration']})\n  diverged, not drawn",
                        **style)
                continue
            x, y = _smoothed_loss(r, win)
            ax.plot(x, y, label=f"{r['hook']} ({r['registration']})", **style)
        ax.set_title(fam, fontsize=10)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="best", framealpha=0.7)
    for ax in list(axes.flat)[len(fams):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel(f"step ({steps_per_epoch} per epoch)")
    for ax in axes[:, 0]:
        ax.set_ylabel("training loss (log)")
    fig.suptitle(f"{title}: training loss per family of hooks (moving average over {win} "
                 f"steps); grey: {base['hook']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
def parse_args(argv=None, extend: Optional[Callable[[argparse.ArgumentParser], None]] = None,
               description: str = __doc__.split("\n")[0]):
    """The job's arguments; `extend` adds a task's own (and may change defaults)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default="out", help="output folder (rank 0 writes there)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    # 0.03: at 0.05 PowerSGD rank 1 ended more than a point of test accuracy below allreduce,
    # at 0.1 the PowerSGD runs degrade or diverge; at 0.03 all layer-wise PowerSGD rows match.
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--powersgd-start", type=int, default=None,
                   help="start_powerSGD_iter of the PowerSGD rows (default: 15%% of the steps)")
    p.add_argument("--quantized-start", type=int, default=None,
                   help="quantized_hook's start_iter (default: as --powersgd-start)")
    p.add_argument("--quantized-exchange", default="auto",
                   choices=["auto", "allgather", "reduce_scatter"],
                   help="quantized_hook's exchange (auto: all-gather on 2 ranks, reduce-scatter "
                   "on more)")
    p.add_argument("--localsgd-start", type=int, default=None,
                   help="start_localSGD_iter (= the averager's warmup_steps) of the post-local "
                   "SGD rows (default: about 20%% of the steps, moved up by at most period-1 "
                   "so that the last step is an averaging step)")
    p.add_argument("--localsgd-period", type=int, default=4,
                   help="the post-local SGD rows' averaging period")
    p.add_argument("--localsgd-subgroup", type=int, default=1,
                   help="ranks per subgroup of the post-local SGD hook (the 'intra-node' group)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--only", default="", help="comma-separated substrings: run matching "
                   "configurations only (the first configuration always runs: the baseline)")
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads per rank on CPU (default: the cores shared among the "
                   "node's ranks)")
    p.add_argument("--no-plot", action="store_true",
                   help="write no picture (no matplotlib import: the multi-node tests' repeated "
                   "runs)")
    p.add_argument("--coverage", action="store_true",
                   help="also run COVERAGE_CONFIGS (every ddpx hook in both registrations; the "
                   "multi-node tests)")
    p.add_argument("--save-final-weights", default="", metavar="FILE",
                   help="rank 0 saves every row's final weights (flattened, float32) there, "
                   "keyed '<hook> (<registration>)': the C++ job's --compare file")
    p.add_argument("--export-cpp-data", default="", metavar="FILE",
                   help="write the data set, the initial weights and these settings for the C++ "
                   "job (benchmarks/cpp/train_digits.cpp) to FILE and exit (no training, no "
                   "process group)")
    if extend is not None:
        extend(p)
    return p.parse_args(argv)


def export_cpp_data(args) -> None:
    """What benchmarks/cpp/train_digits.cpp trains on, in one torch.save file it reads with
    torch::jit::pickle_load: the same split and standardisation, the initial weights drawn here
    (torch.manual_seed(seed), make_mlp), and this job's settings, so that both jobs train the
    same thing."""
    task = digits_task(args)
    x_tr, y_tr, x_te, y_te = task.data
    torch.manual_seed(args.seed)
    init_state = task.make_net().state_dict()
    out: Dict[str, Any] = dict(
        x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te,
        param_names=list(init_state.keys()),
        epochs=args.epochs, batch_size=args.batch_size, lr=float(args.lr), seed=args.seed,
        warmup_steps=args.warmup_steps, powersgd_start=args.powersgd_start,
        localsgd_start=args.localsgd_start, localsgd_period=args.localsgd_period,
        localsgd_subgroup=args.localsgd_subgroup)
    out.update({f"param.{k}": v.clone().contiguous() for k, v in init_state.items()})
    os.makedirs(os.path.dirname(os.path.abspath(args.export_cpp_data)), exist_ok=True)
    torch.save(out, args.export_cpp_data)
    print(f"wrote {args.export_cpp_data}: {len(x_tr)} train / {len(x_te)} test images, "
          f"{sum(v.numel() for v in init_state.values()):,} parameters")


def main(argv=None, make_task: Callable[[Any], Task] = digits_task,
         args: Optional[argparse.Namespace] = None) -> int:
    """Trains every configuration on `make_task(args)`'s task (digits by default) and writes the
    report. `args`: already parsed (another task's example parses its own)."""
    args = args if args is not None else parse_args(argv)
    if args.export_cpp_data:
        export_cpp_data(args)
        return 0
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if n_gpu >= local_world and n_gpu > 0 else "gloo"
    device = torch.device(f"cuda:{local_rank % n_gpu}") if n_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # The ranks share the machine's cores: one share each, no oversubscription (or
        # --threads: runs compared bit for bit across launch layouts fix it).
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    if "MASTER_ADDR" not in os.environ:  # plain `python train_digits.py`: one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group(backend, rank=rank, world_size=world)
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    task = make_task(args)
    data = tuple(t.to(device) for t in task.data)
    torch.manual_seed(args.seed)
    init_state = {k: v.clone() for k, v in task.make_net().to(device).state_dict().items()}

    def make_model() -> nn.Module:
        m = task.make_net().to(device)
        m.load_state_dict(init_state)
        return m

    n_params = sum(v.numel() for v in init_state.values())
    steps = args.epochs * ((len(data[0]) // world) // args.batch_size)
    if args.powersgd_start is None:
        args.powersgd_start = max(2, round(0.15 * steps))
    if args.quantized_start is None:
        args.quantized_start = args.powersgd_start
    if args.localsgd_start is None:
        # About 20% of the steps, then moved so that the last step averages (the replicas the
        # test scores are then the averaged model, identical on every rank).
        s0 = max(1, round(0.2 * steps))
        args.localsgd_start = s0 + (steps - 1 - s0) % args.localsgd_period
    ctx = WireContext(world=world, backend=backend, device=device,
                      quantized_exchange=args.quantized_exchange)
    log(f"{task.title}: {world} ranks, backend {backend}, device {device.type}, torch "
        f"{torch.__version__}, {n_params:,} parameters, {len(data[0])} train / "
        f"{len(data[2])} test samples, {steps} steps, ddpx from {os.path.dirname(ddpx.__file__)}")

    probe = probe_buckets(make_model, data[0], data[1], device)
    log(f"buckets seen by a hook: {[(b['numel'], b['dtype']) for b in probe]}")

    configs = CONFIGS + (COVERAGE_CONFIGS if args.coverage else [])
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        configs = [configs[0]] + [c for c in configs[1:]
                                  if any(k in f"{c.name} {c.registration}" for k in keys)]
    t_job = time.perf_counter()
    rows = train_all(configs, args, make_model, data, device, ctx, rank, world, log)

    if rank == 0:
        notes = []
        base = rows[0]
        if base["status"] == "ok":
            w0 = base["final_weights_rank0"]
            for r in rows:
                if r["status"] == "ok":
                    r["max_abs_weight_diff_vs_baseline"] = float(
                        (r["final_weights_rank0"] - w0).abs().max())
            # Group the configurations whose final weights (rank 0) are bit-identical.
            groups: List[List[Dict[str, Any]]] = []
            for r in (r for r in rows if r["status"] == "ok"):
                for g in groups:
                    if torch.equal(g[0]["final_weights_rank0"], r["final_weights_rank0"]):
                        g.append(r)
                        break
                else:
                    groups.append([r])
            name = lambda r: f"{r['hook']} ({r['registration']})"  # noqa: E731
            same = ["{" + ", ".join(map(name, g)) + "}" for g in groups if len(g) > 1]
            notes.append("bit-identical final weights: " + ("; ".join(same) if same else "none")
                         + "; max |w - w(no hook)| per row in results.json")
        if base["status"] == "ok":
            psgd_rows = [r for r in rows if r["status"] == "ok" and "powersgd" in r]
            if psgd_rows:
                diffs = [(f"{r['hook']} ({r['registration']})",
                          100 * (r["test_acc"] - base["test_acc"])) for r in psgd_rows]
                missed = [n for n, d in diffs if d < -1.0]
                notes.append(
                    "PowerSGD test accuracy minus no hook's, in points: "
                    + ", ".join(f"{n} {d:+.2f}" for n, d in diffs)
                    + "; more than one point below: " + (", ".join(missed) if missed else "none"))
        lsgd = [r for r in rows if r["status"] == "ok" and "local_sgd" in r]
        if lsgd:
            ls = lsgd[0]["local_sgd"]
            notes.append(
                f"post-local SGD rows: start_localSGD_iter = averager warmup_steps = "
                f"{ls['start_localSGD_iter']} (of {ls['steps']} steps: global gradient allreduce "
                f"before), then gradients allreduced in a subgroup of {ls['subgroup_size']} "
                "rank(s) (built with `dist.new_group`, passed to torch's and ddpx's "
                "PostLocalSGDState alike: the 2 ranks share one machine, so a real intra-node "
                "group would be the whole world, and torch's subgroup=None and "
                "new_subgroups() raise ValueError without CUDA, in 1.13 and 2.x) and the "
                "parameters averaged "
                f"globally every {ls['period']} steps ({ls['averaging_steps']} averagings, the "
                "last after the last step, so the scored replicas are averaged); optimizer "
                "PostLocalSGDOptimizer(SGD, PeriodicModelAverager), torch's classes for the "
                "torch row, ddpx's for the ddpx rows. bytes sent/step: after the warm-up "
                f"{ls['bytes_per_step_after_warmup']:,.0f} B/step (1/{ls['period']} of "
                f"{ls['bytes_per_allreduce_step']:,.0f}); compression: an fp32 allreduce "
                "step's bytes / the row's mean bytes per step. ms/step is the median step, "
                "mostly steps without averaging.")
            if base["status"] == "ok":
                notes.append("post-local SGD test accuracy minus no hook's, in points: "
                             + ", ".join(f"{r['hook']} ({r['registration']}) "
                                         f"{100 * (r['test_acc'] - base['test_acc']):+.2f}"
                                         for r in lsgd))
        zrows = [r for r in rows if r["status"] == "ok" and "zero" in r]
        if zrows:
            z = zrows[0]["zero"]
            shard, total = z["shard_param_bytes_per_rank"], sum(z["shard_param_bytes_per_rank"])
            balanced = [r for r in zrows if "balanced" in r["hook"]]
            same_split = all(r["zero"]["shard_param_bytes_per_rank"] == shard for r in zrows
                             if r not in balanced)
            largest = max(v.numel() for v in init_state.values()) / n_params
            unsharded = (max(base["opt_state_bytes_per_rank"]) if base["status"] == "ok"
                         else None)
            sums_ok = unsharded is not None and all(
                sum(r["opt_state_bytes_per_rank"]) == unsharded for r in zrows)
            notes.append(
                "ZeroRedundancyOptimizer rows: ZeRO stage 1 over ddp.parameters() with "
                f"optimizer_class=torch.optim.SGD (lr {args.lr}, momentum 0.9, as every row), "
                "DDP's default allreduce; each rank keeps the momentum of, updates and "
                "broadcasts the parameters it owns. The partition (torch's: whole tensors, "
                "largest first, each to the least-loaded rank"
                + ("" if same_split else "; it differs between the ZeRO rows, see results.json")
                + ") gives the ranks " + " / ".join(str(n) for n in z["shard_params_per_rank"])
                + " parameter tensors, " + " / ".join(f"{100 * b / total:.1f}%" for b in shard)
                + f" of the parameter bytes: the largest tensor alone is {100 * largest:.1f}% "
                "of them and is not split, so the largest shard is well above 1/W"
                + ("; the balanced rows (ddpx's partition='balanced') split it: "
                   + " / ".join(f"{100 * b / sum(bs):.1f}%"
                                for bs in [balanced[0]["zero"]["shard_param_bytes_per_rank"]]
                                for b in bs)
                   + " of the parameter bytes per rank" if balanced else "")
                + ". Every parameter (every element, for the balanced rows) updated by exactly "
                "one rank: "
                + ("yes" if all(r["zero"]["every_param_owned_once"] for r in zrows) else
                   "NO: " + ", ".join(f"{r['hook']} ({r['registration']})" for r in zrows
                                      if not r["zero"]["every_param_owned_once"]))
                + "; optimizer state summed over the ranks = the unsharded SGD state of no "
                "hook" + (f" ({unsharded:,} B): " + ("yes" if sums_ok else "NO")
                          if unsharded is not None else ": not checked (no baseline)")
                + (". Test accuracy minus no hook's, in points: "
                   + ", ".join(f"{r['hook']} {100 * (r['test_acc'] - base['test_acc']):+.2f}"
                               for r in zrows) if base["status"] == "ok" else ""))
        unsynced = [f"{r['hook']} ({r['registration']})" for r in rows
                    if r["status"] == "ok" and r["replica_spread"] > 0]
        notes.append("replicas differ across ranks at the end (expected for noop only): "
                     + (", ".join(f"{u}" for u in unsynced) if unsynced else "none"))
        for r in rows:
            if r["status"] != "ok" and r.get("error"):
                notes.append(f"{r['hook']} ({r['registration']}): {r['error']}")
        ok = [r for r in rows if r["status"] == "ok"]
        meta = dict(
            world=world, backend=backend, device_type=device.type, torch=torch.__version__,
            task=task.title, model=task.model, test_set=task.test_set,
            n_params=n_params, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
            powersgd_start=(args.powersgd_start if any(c.powersgd for c in configs) else None),
            quantized_start=(args.quantized_start if any(c.quantized for c in configs)
                             else None),
            quantized_exchange=args.quantized_exchange,
            warmup_steps=ok[0]["warmup_steps"] if ok else args.warmup_steps,
            steps_per_config=ok[0]["steps"] if ok else 0,
            buckets=", ".join(f"{b['numel']:,} {b['dtype'].replace('torch.', '')}"
                              for b in (ok[0]["buckets"] if ok else [])),
            probe_buckets=probe, notes=notes,
            job_wall_s=time.perf_counter() - t_job)
        os.makedirs(args.out, exist_ok=True)
        md = render_markdown(rows, meta)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(md)
        if args.save_final_weights:
            os.makedirs(os.path.dirname(os.path.abspath(args.save_final_weights)),
                        exist_ok=True)
            torch.save({f"{r['hook']} ({r['registration']})": r["final_weights_rank0"]
                        for r in rows if r["status"] == "ok"}, args.save_final_weights)
        for r in rows:
            r.pop("final_weights_rank0", None)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2, default=str)
        written = ["results.md", "results.json"]
        if not args.no_plot:
            plot_curves(rows, os.path.join(args.out, "loss_curves.png"),
                        meta["steps_per_config"] // max(1, args.epochs), task.title)
            plot_accuracy_vs_bytes(rows, os.path.join(args.out, "accuracy_vs_bytes.png"),
                                   task.title)
            written += ["loss_curves.png", "accuracy_vs_bytes.png"]
        print(md, flush=True)
        print("wrote " + ", ".join(os.path.join(args.out, f) for f in written), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
