"""The overlap of ``ddpx.optim.ZeroRedundancyOptimizer``'s step with DDP's backward pass: torch's
``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` functions, same names and
signatures, for a ZeroRedundancyOptimizer built with ``overlap_with_ddp=True``.

Each wraps any comm hook (ddpx's or torch's: allreduce, fp16, PowerSGD, ...). The wrapped hook
reduces a bucket as usual; the optimizer then steps this rank's share of that bucket's
parameters with the reduced gradients and exchanges them, from inside the hook call, so the
exchange's broadcasts go out in bucket order on every rank, never from a completion callback:

* :func:`hook_with_zero_step`: at the last bucket, waits for every bucket's reduction in turn
  and steps and exchanges each bucket's parameters as its reduction completes (the step follows
  the backward computation, overlapping the remaining reductions);
* :func:`hook_with_zero_step_interleaved`: at bucket i, steps and exchanges bucket i-1's
  parameters (whose reduction had bucket i's backward computation to finish), and the last
  bucket's at the last bucket (the step interleaves with the backward computation).

Differences from torch's: Gloo works (torch refuses it: its broadcasts, issued from future
callbacks, can hang there); parameters are updated from the first iteration (torch's first two
or three iterations do not update: it waits for DDP to rebuild its buckets, because it assigns
whole buckets to ranks, where ddpx keeps torch's usual per-parameter partition); ``shard_buckets``
is accepted and has no effect (the partition is per parameter already). The optimizer must have
a functional form in torch (SGD, Adam, AdamW, Adagrad, Adadelta, RMSprop, Rprop, Adamax), as
torch requires; SGD, Adam and AdamW run ddpx's fused kernels.
"""
from typing import Any, Callable, List

import torch
import torch.distributed as dist

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]


def _check(zero: Any, ddp: Any) -> None:
    from ..optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("ddpx.hooks.hook_with_zero_step: ddp must be the DistributedDataParallel "
                        f"model, got {type(ddp).__name__}")
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError("ddpx.hooks.hook_with_zero_step needs a ddpx.optim."
                        f"ZeroRedundancyOptimizer, got {type(zero).__name__}")
    if not zero._overlap_with_ddp:
        raise ValueError("ZeroRedundancyOptimizer must be constructed with "
                         "`overlap_with_ddp=True` to use this hook properly")


def _reduced(fut: torch.futures.Future) -> torch.Tensor:
    """The reduced bucket a hook's future holds (a tensor, or a one-tensor list)."""
    value = fut.wait()
    if isinstance(value, (list, tuple)):
        value = value[0]
    return value


def _step_bucket(zero: Any, params: List[torch.Tensor], reduced: torch.Tensor) -> None:
    """Steps and exchanges one bucket's parameters: their gradients are consecutive slices of the
    reduced bucket, in ``bucket.parameters()`` order (DDP's bucket layout)."""
    flat = reduced.view(-1)
    grads, offset = [], 0
    for p in params:
        n = p.numel()
        grads.append(flat[offset:offset + n].view_as(p))
        offset += n
    zero._step_params(params, grads)


def hook_with_zero_step(hook: Callable[[Any, dist.GradBucket], torch.futures.Future], ddp: Any,
                        zero: Any, shard_buckets: bool = False
                        ) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """``hook`` with ``zero``'s step after the backward computation: at the last bucket, every
    bucket's parameters are stepped and exchanged as their reduction completes. Register the
    result with ``ddp.register_comm_hook(state, ...)``; do not call ``zero.step()``.

    Args:
        hook: the comm hook that reduces the buckets (``hook(state, bucket) -> Future``).
        ddp: the DistributedDataParallel model ``zero`` optimizes.
        zero: a ``ddpx.optim.ZeroRedundancyOptimizer`` built with ``overlap_with_ddp=True``.
        shard_buckets: accepted for torch's signature; no effect (ddpx's partition is per
            parameter).
    """
    _check(zero, ddp)
    pending: List[Any] = []

    def hook_with_zero_fn(state: Any, bucket: dist.GradBucket
                          ) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        if bucket.index() == 0:
            pending.clear()  # an interrupted backward pass left nothing to step
        pending.append((bucket.parameters(), fut))
        if not bucket.is_last():
            return fut
        items = list(pending)
        pending.clear()
        for params, bucket_fut in items:
            _step_bucket(zero, params, _reduced(bucket_fut))
        return fut

    hook_with_zero_fn.__name__ = "hook_with_zero_fn"
    return hook_with_zero_fn


def hook_with_zero_step_interleaved(
        hook: Callable[[Any, dist.GradBucket], torch.futures.Future], ddp: Any, zero: Any,
        shard_buckets: bool = False
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """``hook`` with ``zero``'s step interleaved with the backward computation: bucket i-1's
    parameters are stepped and exchanged at bucket i, the last bucket's at the last bucket.
    Arguments as :func:`hook_with_zero_step`."""
    _check(zero, ddp)
    previous: List[Any] = []

    def hook_with_zero_interleaved_fn(state: Any, bucket: dist.GradBucket
                                      ) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        if bucket.index() == 0:
            previous.clear()
        if previous:
            params, prev_fut = previous.pop()
            _step_bucket(zero, params, _reduced(prev_fut))
        if bucket.is_last():
            _step_bucket(zero, bucket.parameters(), _reduced(fut))
        else:
            previous.append((bucket.parameters(), fut))
        return fut

    hook_with_zero_interleaved_fn.__name__ = "hook_with_zero_interleaved_fn"
    return hook_with_zero_interleaved_fn
