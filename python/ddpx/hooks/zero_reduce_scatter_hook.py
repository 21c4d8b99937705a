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

natively (no Python per bucket):
``ddpx.register_comm_hook(ddp, zero, ddpx.hooks.reduce_scatter_hook)`` (or a
``functools.partial`` of it with ``bits=8``), or, with ``overlap_with_ddp=True``, wrapped by
:func:`ddpx.hooks.hook_with_zero_step` (or its interleaved variant) with the ZeRO optimizer as the
state: ``ddp.register_comm_hook(zero, hook_with_zero_step(reduce_scatter_hook, ddp, zero))``.

What a user sees: after ``backward()``, ``param.grad`` holds the averaged gradient on the elements
this rank owns and zeros elsewhere, so anything that reads whole gradients on every rank (gradient
clipping by global norm, an unsharded optimizer) must not be used with it. DDP's own gradient
buckets stay allocated (DDP owns them), so the saving is in bytes sent, not in memory.
Not with ``torch.distributed.algorithms.join.Join`` (uneven inputs): a joined rank shadows DDP's
all-reduces with its own, not this exchange, so the other ranks would wait for it.

How: at bucket i, each rank sends every other rank, in one all-to-all, the elements that rank
owns; the owner adds its own elements and the peers' (each divided by the world size first), in
rank order, and the bucket gets that mean on its own elements and zeros elsewhere. This is the
scatter round of ddpx's owner-sharded exchange (the one ``quantized_hook`` runs), in C++: no
Python runs per bucket on the native path. The owner's sum is deterministic; not bit for bit
DDP's all-reduce, which sums in another order.
"""
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from .._loader import _C
from .._native import check_int, make_hook

__all__ = ["reduce_scatter_hook"]

_WHO = "ddpx.hooks.reduce_scatter_hook"
_DEFAULTS = (32, 256, True)


def _check_format(bits: Any, block_size: Any, use_error_feedback: Any) -> Tuple[int, int, bool]:
    check_int(_WHO, "bits", bits)
    check_int(_WHO, "block_size", block_size)
    if bits not in (32, 8, 4, 2, 1):
        raise ValueError(f"{_WHO}: bits must be 32 (no quantization), 8, 4, 2 or 1, got {bits}")
    if block_size < 8 or block_size % 8 or block_size > 1 << 20:
        raise ValueError(f"{_WHO}: block_size must be a multiple of 8 in [8, 1048576], got "
                         f"{block_size}")
    return bits, block_size, bool(use_error_feedback)


def _zero_of(state: Any) -> Any:
    from ..optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
    if not isinstance(state, ZeroRedundancyOptimizer):
        raise TypeError(f"{_WHO}: the hook's state must be the ddpx.optim.ZeroRedundancyOptimizer, "
                        f"got {type(state).__name__}: "
                        "ddp.register_comm_hook(zero, ddpx.hooks.reduce_scatter_hook)")
    return state


def _native_state(zero: Any, options: Tuple[int, int, bool]) -> "_C.ReduceScatterState":
    """The optimizer's one native state (made at the first use), with ``options`` in force."""
    state = getattr(zero, "_reduce_scatter_state", None)
    if state is None:
        group = zero.process_group
        state = _C.ReduceScatterState(group, zero._layout, *options)
        zero._reduce_scatter_state = state
        pending = zero.__dict__.pop("_reduce_scatter_pending", None)
        if pending is not None:
            state.load_state_dict(pending)
    elif tuple(state.options) != options:
        state.set_options(*options)
    return state


# One hook function (and so one native hook per optimizer) per format used.
_hooks: Dict[Tuple[int, int, bool], Any] = {}


def _hook_for(options: Tuple[int, int, bool]) -> Any:
    hook = _hooks.get(options)
    if hook is None:
        hook = make_hook(
            "reduce_scatter_hook",
            lambda zero: _C.reduce_scatter_hook(_native_state(_zero_of(zero), options)),
            _DOC, state_type=object, qualname="reduce_scatter_hook")
        _hooks[options] = hook
    return hook


_DOC = """Reduce-scatters ``bucket`` to the ranks that own its elements under ``state``'s partition
    (``state`` is the ``ddpx.optim.ZeroRedundancyOptimizer`` that steps these parameters): the
    averaged gradient lands on each element's owner, zeros elsewhere. See the module docstring.

    ``bits`` 8, 4, 2 or 1 quantizes what each rank sends an owner as :func:`quantized_hook`
    does (a scale per ``block_size`` values, symmetric integers, or signs at 1 bit), with error
    feedback per rank (``use_error_feedback``): the bytes a rank sends shrink by ``32 / bits``
    (plus 4 bytes of scale per block). The owner adds its own contribution exactly and the
    peers' dequantized ones, in rank order. Natively: ``ddpx.register_comm_hook(ddp, zero,
    functools.partial(ddpx.hooks.reduce_scatter_hook, bits=8))``; drop-in, through a named
    function (DDP reads a hook's ``__name__``, which a ``functools.partial`` lacks)::

        def hook(state, bucket):
            return ddpx.hooks.reduce_scatter_hook(state, bucket, bits=8)

        ddp.register_comm_hook(zero, hook)

    The residuals are kept per parameter, so they survive DDP's bucket rebuild, and travel in the
    optimizer's checkpoints: ``consolidate_state_dict()`` gathers every rank's, ``state_dict()``
    holds them by rank (key ``"ddpx_reduce_scatter"``) and ``load_state_dict()`` gives each rank
    its own (at another world size they restart from zero, with a warning). Every rank must use
    the same options: the first bucket checks it (a ValueError naming the option otherwise).
    ``bits=32`` (the default) sends the values themselves."""


def reduce_scatter_hook(state: Any, bucket: dist.GradBucket, bits: int = 32,
                        block_size: int = 256, use_error_feedback: bool = True
                        ) -> torch.futures.Future[torch.Tensor]:
    return _hook_for(_check_format(bits, block_size, use_error_feedback))(state, bucket)


reduce_scatter_hook.__doc__ = _DOC
# For ddpx.register_comm_hook: the default format, or functools.partial's keywords.
reduce_scatter_hook._ddpx_factory = (  # type: ignore[attr-defined]
    lambda state: _hook_for(_DEFAULTS)._ddpx_factory(state))  # type: ignore[attr-defined]
reduce_scatter_hook._ddpx_name = "reduce_scatter_hook"  # type: ignore[attr-defined]
reduce_scatter_hook._ddpx_bind = (  # type: ignore[attr-defined]
    lambda bits=32, block_size=256, use_error_feedback=True:
    _hook_for(_check_format(bits, block_size, use_error_feedback)))
