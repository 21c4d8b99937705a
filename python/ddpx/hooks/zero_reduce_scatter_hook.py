"""ZeRO-2 style gradient sharding for ``ddpx.optim.ZeroRedundancyOptimizer`` (ddpx's; torch has
none): a DDP comm hook that reduce-scatters each bucket's gradients to the ranks that own them,
instead of all-reducing them to every rank.

With ZeRO, a rank only reads the gradients of the parameters (or, under
``partition="balanced"``, of the pieces) it owns: the rest of an all-reduce's result is thrown
away. :func:`reduce_scatter_hook` sends each owner only its share: per step, a rank sends about
one model size for the gradients (an all-reduce sends two) and one for the parameter exchange of
``zero.step()``, two model sizes in all instead of three.

    zero = ddpx.optim.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
    ddp.register_comm_hook(zero, ddpx.hooks.reduce_scatter_hook)
    for x, y in data:
        zero.zero_grad(); loss_fn(ddp(x), y).backward(); zero.step()

or, with ``overlap_with_ddp=True``, wrapped by :func:`ddpx.hooks.hook_with_zero_step` (or its
interleaved variant) with the ZeRO optimizer as the state:
``ddp.register_comm_hook(zero, hook_with_zero_step(reduce_scatter_hook, ddp, zero))``.

What a user sees: after ``backward()``, ``param.grad`` holds the averaged gradient on the elements
this rank owns and zeros elsewhere, so anything that reads whole gradients on every rank (gradient
clipping by global norm, an unsharded optimizer) must not be used with it. DDP's own gradient
buckets stay allocated (DDP owns them), so the saving is in bytes sent, not in memory.
Not with ``torch.distributed.algorithms.join.Join`` (uneven inputs): a joined rank shadows DDP's
all-reduces, not these point-to-point messages, so the other ranks would wait for it.

How: at bucket i, each rank divides the bucket by the world size and sends every other rank the
elements that rank owns (one message per peer: the owner's ranges packed, or a view when they are
one range) and posts the receives of its own elements; point-to-point (send/recv, on Gloo and
NCCL), tagged with the bucket's index. A later hook call completes (sums) the buckets whose
messages have all arrived, without waiting for the others, and the last bucket's call completes
every one, waiting: no communication is issued from a completion callback, nothing waits on a
thread, and the backward computation never blocks on a transfer. The owner adds the
contributions in rank order (deterministic; not bit for bit DDP's all-reduce, which sums in
another order).
"""
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from .._loader import _C

__all__ = ["reduce_scatter_hook"]


class _Layout:
    """Where a bucket's elements go: for each owner rank, its ranges [begin, end) of the bucket
    (merged where adjacent), and how many elements that is."""

    def __init__(self, zero: Any, params: List[torch.Tensor]):
        ranges: List[List[Tuple[int, int]]] = [[] for _ in range(zero.world_size)]
        offset = 0
        for p in params:
            try:
                pieces = zero._owner_ranges(p)
            except KeyError:
                raise ValueError("ddpx.hooks.reduce_scatter_hook: a parameter of DDP's bucket (of "
                                 f"shape {tuple(p.shape)}) is not one of the "
                                 "ZeroRedundancyOptimizer's parameters: build the optimizer over "
                                 "ddp.parameters()") from None
            for b, e, owner in pieces:
                if e > b:
                    mine = ranges[owner]
                    if mine and mine[-1][1] == offset + b:
                        mine[-1] = (mine[-1][0], offset + e)
                    else:
                        mine.append((offset + b, offset + e))
            offset += p.numel()
        self.ranges = ranges
        self.counts = [sum(e - b for b, e in r) for r in ranges]
        self.numel = offset


class _Pending:
    """One bucket's reduce-scatter in flight. ``bits``/``block``: the quantized messages' format
    (bits 32: the values themselves)."""
    __slots__ = ("buffer", "layout", "works", "recvs", "future", "keep", "bits", "block")

    def __init__(self, buffer, layout, works, recvs, future, keep, bits=32, block=0):
        self.buffer, self.layout, self.works, self.recvs = buffer, layout, works, recvs
        self.future, self.keep, self.bits, self.block = future, keep, bits, block


def _gather(buffer: torch.Tensor, ranges: List[Tuple[int, int]]) -> torch.Tensor:
    if len(ranges) == 1:
        b, e = ranges[0]
        return buffer[b:e]
    return torch.cat([buffer[b:e] for b, e in ranges])


def _finish(item: _Pending, rank: int) -> None:
    """Waits for a bucket's messages, sums this rank's elements (its own contribution, then the
    peers' in rank order), zeroes the others and completes the bucket's future."""
    try:
        for work in item.works:
            work.wait()
        buffer, mine = item.buffer, item.layout.ranges[rank]
        if mine:
            total = _gather(buffer, mine)  # a view of the bucket for one range, else a copy
            for received in item.recvs:
                received = received.to(buffer.device, non_blocking=True)
                if item.bits != 32:  # a peer's quantized message: its values, then the sum
                    values = torch.empty_like(total)
                    _C.dequantize_(received, item.bits, item.block, values)
                    received = values
                total.add_(received)
            if len(mine) > 1:
                offset = 0
                for b, e in mine:
                    buffer[b:e].copy_(total[offset:offset + e - b])
                    offset += e - b
        start = 0
        for b, e in mine:  # ascending
            buffer[start:b].zero_()
            start = e
        buffer[start:].zero_()
        item.future.set_result(buffer)
    except Exception as exc:  # noqa: BLE001 - delivered to DDP through the future
        item.future.set_exception(exc)


class _HookState:
    """Per ZeroRedundancyOptimizer: the layouts by bucket, the buckets in flight, and with
    quantized messages the error-feedback residuals, per bucket layout and owner."""

    def __init__(self):
        self.layouts: Dict[Tuple[int, ...], _Layout] = {}
        self.pending: List[_Pending] = []
        self.residuals: Dict[Tuple[Tuple[int, ...], int], torch.Tensor] = {}
        self.sent_elements = 0  # elements this rank sent (for tests and benchmarks)
        self.sent_bytes = 0  # bytes of those messages


def _state_of(zero: Any) -> _HookState:
    state = getattr(zero, "_reduce_scatter_state", None)
    if state is None:
        state = _HookState()
        zero._reduce_scatter_state = state
    return state


def _check_format(bits: Any, block_size: Any) -> None:
    who = "ddpx.hooks.reduce_scatter_hook"
    for name, value in (("bits", bits), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__}")
    if bits not in (32, 8, 4, 2, 1):
        raise ValueError(f"{who}: bits must be 32 (no quantization), 8, 4, 2 or 1, got {bits}")
    if block_size < 8 or block_size % 8 or block_size > 1 << 20:
        raise ValueError(f"{who}: block_size must be a multiple of 8 in [8, 1048576], got "
                         f"{block_size}")


def reduce_scatter_hook(state: Any, bucket: dist.GradBucket, bits: int = 32,
                        block_size: int = 256, use_error_feedback: bool = True
                        ) -> torch.futures.Future[torch.Tensor]:
    """Reduce-scatters ``bucket`` to the ranks that own its elements under ``state``'s partition
    (``state`` is the ``ddpx.optim.ZeroRedundancyOptimizer`` that steps these parameters): the
    averaged gradient lands on each element's owner, zeros elsewhere. See the module docstring.

    ``bits`` 8, 4, 2 or 1 quantizes what each rank sends an owner as :func:`quantized_hook`
    does (a scale per ``block_size`` values, symmetric integers, or signs at 1 bit), with error
    feedback per owner (``use_error_feedback``): the bytes a rank sends shrink by ``32 / bits``
    (plus 4 bytes of scale per block). The owner adds its own contribution exactly and the
    peers' dequantized ones, in rank order. Pass the options through a named function (DDP
    reads a hook's ``__name__``, which a ``functools.partial`` lacks)::

        def hook(state, bucket):
            return ddpx.hooks.reduce_scatter_hook(state, bucket, bits=8)

        ddp.register_comm_hook(zero, hook)

    Residuals are kept per bucket layout: DDP's rebuild after the first iteration restarts them
    from zero. ``bits=32`` (the default) sends the values themselves."""
    from ..optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
    _check_format(bits, block_size)
    zero = state
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError("ddpx.hooks.reduce_scatter_hook: the hook's state must be the ddpx.optim."
                        f"ZeroRedundancyOptimizer, got {type(zero).__name__}: "
                        "ddp.register_comm_hook(zero, ddpx.hooks.reduce_scatter_hook)")
    hs = _state_of(zero)
    if bucket.index() == 0 and hs.pending:
        hs.pending.clear()  # an interrupted backward pass: its buckets are gone
    params = bucket.parameters()
    buffer = bucket.buffer()
    key = (bucket.index(),) + tuple(id(p) for p in params)
    layout = hs.layouts.get(key)
    if layout is None:
        if bucket.index() == 0:
            hs.layouts.clear()  # DDP rebuilt its buckets
            hs.residuals.clear()
        layout = hs.layouts[key] = _Layout(zero, params)
    if layout.numel != buffer.numel():
        raise RuntimeError(f"ddpx.hooks.reduce_scatter_hook: bucket {bucket.index()} holds "
                           f"{buffer.numel()} elements, its parameters {layout.numel}")
    if buffer.is_cuda:
        future = torch.futures.Future(devices=[buffer.device])
    else:
        future = torch.futures.Future()
    world, rank, pg = zero.world_size, zero.rank, zero.process_group
    # Where the bytes travel: the bucket's device, or the CPU for Gloo on CUDA tensors (Gloo's
    # send/recv take CPU tensors).
    wire = zero._comm_device()
    buffer.div_(world)
    works, recvs, keep = [], [], []
    tag = bucket.index()
    for peer in range(world):
        if peer == rank:
            continue
        ops = []
        if layout.counts[peer]:
            out = _gather(buffer, layout.ranges[peer])
            hs.sent_elements += out.numel()
            if bits != 32:
                residual = None
                if use_error_feedback:
                    residual = hs.residuals.get((key, peer))
                    if residual is None:
                        residual = torch.zeros(out.numel(), dtype=torch.float32,
                                               device=buffer.device)
                        hs.residuals[(key, peer)] = residual
                out = _C.quantize_ef_(out.contiguous(), residual, bits, block_size)
            out = out.to(wire)
            hs.sent_bytes += out.numel() * out.element_size()
            keep.append(out)
            ops.append(lambda out=out: pg.send([out], peer, tag))
        if layout.counts[rank] and bits != 32:
            incoming = torch.empty(_C.quantized_message_bytes(layout.counts[rank], bits,
                                                              block_size),
                                   dtype=torch.uint8, device=wire)
            recvs.append(incoming)
            ops.append(lambda incoming=incoming: pg.recv([incoming], peer, tag))
        elif layout.counts[rank]:
            incoming = torch.empty(layout.counts[rank], dtype=buffer.dtype, device=wire)
            recvs.append(incoming)
            ops.append(lambda incoming=incoming: pg.recv([incoming], peer, tag))
        # The lower rank of a pair sends first, the higher receives first: NCCL runs a pair's
        # operations in order on one stream, where "both send first" could wait forever.
        if rank > peer:
            ops.reverse()
        works.extend(op() for op in ops)
    hs.pending.append(_Pending(buffer, layout, works, recvs, future, keep, bits, block_size))
    # Complete the buckets whose messages have all arrived (in order, without waiting), and at
    # the last bucket every one, waiting: the backward computation never blocks on a transfer.
    last = bucket.is_last()
    while hs.pending and (last or all(w.is_completed() for w in hs.pending[0].works)):
        _finish(hs.pending.pop(0), rank)
    return future
