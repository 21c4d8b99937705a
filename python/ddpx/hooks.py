"""DDP communication hooks with torch's names, arguments and defaults, run by native C++ code.

Every hook here is a plain Python function that ``DistributedDataParallel.register_comm_hook``
accepts (drop-in), and also carries the factory of its C++ object so that
:func:`register_comm_hook` can hand that object to DDP's C++ Reducer (native path).
"""
import atexit
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist

from . import _compat
from ._groups import resolve_group
from ._loader import _C

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "noop_hook",
    "PowerSGDState",
    "powerSGD_hook",
    "batched_powerSGD_hook",
    "PostLocalSGDState",
    "post_localSGD_hook",
    "register_comm_hook",
    "native_hook",
]

HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]

# Native hook objects built for a given (hook, state): the drop-in path reuses them across
# buckets and iterations. The state is kept in the value so its id() stays unique.
_native_cache: Dict[Tuple[int, int], Tuple[Any, Any, "_C.CommHook"]] = {}


@atexit.register
def _clear_native_cache() -> None:
    _native_cache.clear()


def _make_hook(name: str, factory: Callable[[Any], "_C.CommHook"], doc: str) -> HookFn:
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        native = native_hook(hook, state)
        # DDP's Python path expects the future to hold a Python object: `then` provides it.
        return native.run(bucket).then(_value)

    # torch 1.13's DDP refuses any hook *named* bf16_compress_hook unless torch has CUDA and
    # NCCL >= 2.10, before the hook runs. ddpx's bf16 hooks work on Gloo and CPU, so their
    # function objects carry a ddpx_ prefix; the module attribute keeps torch's name.
    hook.__name__ = ("ddpx_" + name) if name.startswith("bf16") else name
    hook.__qualname__ = hook.__name__
    hook.__doc__ = doc
    hook._ddpx_factory = factory  # type: ignore[attr-defined]
    hook._ddpx_name = name  # type: ignore[attr-defined]
    return hook


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


def native_hook(hook: HookFn, state: Any = None) -> "_C.CommHook":
    """Returns the C++ hook object behind a ddpx hook function for ``state`` (cached)."""
    factory = getattr(hook, "_ddpx_factory", None)
    if factory is None:
        raise TypeError(
            "expected a ddpx hook (one of ddpx.hooks.allreduce_hook, fp16_compress_hook, "
            "bf16_compress_hook, noop_hook, or a ddpx fp16/bf16_compress_wrapper), got "
            f"{getattr(hook, '__qualname__', repr(hook))}; Python hooks register with "
            "ddp_model.register_comm_hook instead"
        )
    # Stateful hooks (PowerSGDState, ...) keep their native objects on the state itself, so that
    # they (and the process group they hold) die with it; None / ProcessGroup states share a
    # module cache, emptied at exit before torch tears the process groups down.
    if hasattr(state, "__dict__"):
        cache = state.__dict__.setdefault("_ddpx_native_hooks", {})
        entry = cache.get(id(hook))
        if entry is None or entry[0] is not hook:
            entry = (hook, factory(state))
            cache[id(hook)] = entry
        return entry[1]
    # None means "the default group at call time": key by the group it resolves to now, so that a
    # re-initialised default group gets a fresh native hook.
    group = dist.group.WORLD if state is None and dist.is_initialized() else state
    key = (id(hook), id(group))
    entry = _native_cache.get(key)
    if entry is None or entry[0] is not hook or entry[1] is not group:
        entry = (hook, group, factory(state))
        _native_cache[key] = entry
    return entry[2]


def _group_factory(make: Callable[[dist.ProcessGroup], "_C.CommHook"], name: str):
    return lambda state: make(resolve_group(state, name, arg="state"))


allreduce_hook = _make_hook(
    "allreduce_hook",
    _group_factory(lambda pg: _C.allreduce_hook(pg), "allreduce_hook"),
    """Averages the bucket over the group with one allreduce, like torch's ``allreduce_hook``
    (same result, bit for bit, for fp32 gradients). ``state`` is a ProcessGroup or None for the
    default group.

    Example::
        >>> ddp_model.register_comm_hook(process_group, ddpx.hooks.allreduce_hook)
    """,
)

fp16_compress_hook = _make_hook(
    "fp16_compress_hook",
    _group_factory(lambda pg: _C.compress_hook(pg, torch.float16), "fp16_compress_hook"),
    """Divides the bucket by the group size and casts it to ``torch.float16`` in one fused pass,
    exchanges the half-precision values and writes the mean back in the bucket's dtype.
    On Gloo the fp16 values are gathered and summed in fp32 (faster than Gloo's scalar fp16
    sums, and no fp16 rounding of partial sums).

    Example::
        >>> ddp_model.register_comm_hook(process_group, ddpx.hooks.fp16_compress_hook)
    """,
)

bf16_compress_hook = _make_hook(
    "bf16_compress_hook",
    _group_factory(lambda pg: _C.compress_hook(pg, torch.bfloat16), "bf16_compress_hook"),
    """Like :func:`fp16_compress_hook` with ``torch.bfloat16``. Works on Gloo and on CPU too
    (torch's own refuses anything but NCCL >= 2.10 with CUDA).

    Example::
        >>> ddp_model.register_comm_hook(process_group, ddpx.hooks.bf16_compress_hook)
    """,
)

noop_hook = _make_hook(
    "noop_hook",
    lambda state: _C.noop_hook(),
    """Returns the bucket unchanged without any communication: for headroom analysis only
    (gradients are *not* synchronised).

    Example::
        >>> ddp_model.register_comm_hook(None, ddpx.hooks.noop_hook)
    """,
)


def _make_wrapper(dtype: torch.dtype, name: str):
    def wrapper(hook: HookFn) -> HookFn:
        inner = getattr(hook, "_ddpx_factory", None)
        if inner is None:
            raise TypeError(
                f"{name}: hook must be a ddpx hook (e.g. ddpx.hooks.allreduce_hook), got "
                f"{getattr(hook, '__qualname__', repr(hook))}; to wrap a Python hook use "
                f"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.{name}"
            )
        return _make_hook(
            f"{name}_hook",
            lambda state: _C.compress_wrapper(native_hook(hook, state), dtype),
            f"{name}({hook._ddpx_name}): runs the wrapped hook on a {dtype} copy of the bucket "
            "and casts its result back into the bucket's dtype.",
        )

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = f"""Casts the bucket to ``{dtype}``, runs the given ddpx hook on it, and casts
    the result back to the bucket's dtype, like torch's ``{name}``.
    ``{name}(allreduce_hook)`` averages like the compress hook of the same dtype.

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group, matrix_approximation_rank=1)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.{name}(ddpx.hooks.allreduce_hook))
    """
    return wrapper


from .powersgd import PowerSGDState, _native_state  # noqa: E402

powerSGD_hook = _make_hook(
    "powerSGD_hook",
    lambda state: _C.powersgd_hook(_native_state(state, "powerSGD_hook"), batched=False),
    """PowerSGD gradient compression (Vogels et al., NeurIPS 2019), torch's ``powerSGD_hook``:
    matrices worth compressing travel as rank-r factors P and Q, the rest is allreduced, with
    error feedback and warm start as configured in ``state`` (a :class:`PowerSGDState`). Plain
    allreduce before ``state.start_powerSGD_iter``.

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
        ...                                  start_powerSGD_iter=10, min_compression_rate=0.5)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.powerSGD_hook)
    """,
)

batched_powerSGD_hook = _make_hook(
    "batched_powerSGD_hook",
    lambda state: _C.powersgd_hook(_native_state(state, "batched_powerSGD_hook"), batched=True),
    """Torch's ``batched_powerSGD_hook``: the whole bucket compressed as one zero-padded square
    matrix. Faster than :func:`powerSGD_hook` but usually less accurate unless the rank is 1.
    (torch's own crashes with an AssertionError; this one works.)

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.batched_powerSGD_hook)
    """,
)

from .post_localsgd import PostLocalSGDState, native_state as _post_local_state  # noqa: E402

_post_localSGD_native = _make_hook(
    "post_localSGD_hook",
    lambda state: _C.post_localsgd_hook(_post_local_state(state, "post_localSGD_hook")),
    "",
)


def post_localSGD_hook(state: PostLocalSGDState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    native = native_hook(post_localSGD_hook, state)
    if not state._params_tagged:
        # First iteration: mark the parameters, for the model averagers' warm-up check.
        state._tag(bucket.parameters())
        if bucket.is_last():
            state._params_tagged = True
    return native.run(bucket).then(_value)


post_localSGD_hook._ddpx_factory = _post_localSGD_native._ddpx_factory  # type: ignore
post_localSGD_hook._ddpx_name = "post_localSGD_hook"  # type: ignore
post_localSGD_hook.__doc__ = """Post-local SGD (Lin et al., ICLR 2020), torch's ``post_localSGD_hook``:
    averages gradients over ``state.process_group`` (bit-identical to ``allreduce_hook``) until
    ``state.start_localSGD_iter``, then within ``state.subgroup`` only (or not at all when
    ``state.post_local_gradient_allreduce`` is False). Combine it with a model averager run after
    the optimizer step, e.g. :class:`ddpx.optim.PostLocalSGDOptimizer` with a
    :class:`ddpx.model_averaging.PeriodicModelAverager` whose ``warmup_steps`` equals
    ``start_localSGD_iter``.

    Example::
        >>> state = ddpx.hooks.PostLocalSGDState(process_group=None, subgroup=None,
        ...                                      start_localSGD_iter=100)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.post_localSGD_hook)
    """

fp16_compress_wrapper = _make_wrapper(torch.float16, "fp16_compress_wrapper")
bf16_compress_wrapper = _make_wrapper(torch.bfloat16, "bf16_compress_wrapper")


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, state: Any,
                       hook: HookFn) -> None:
    """Registers a ddpx hook natively: its C++ object goes straight into DDP's C++ Reducer, so
    no Python and no GIL run per bucket during backward.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        state: the hook's state, as for ``ddp_model.register_comm_hook`` (a ProcessGroup or
            None for the default group for the default hooks).
        hook: a ddpx hook, e.g. ``ddpx.hooks.fp16_compress_hook``.

    A DDP model takes one communication hook: registering a second one (by either path)
    raises RuntimeError, as in torch.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "register_comm_hook: ddp_model must be a torch.nn.parallel.DistributedDataParallel, "
            f"got {type(ddp_model).__name__}"
        )
    native = native_hook(hook, state)
    if isinstance(state, PostLocalSGDState):
        state._tag(ddp_model.parameters())
        state._params_tagged = True
    _compat.set_comm_hook_name(ddp_model, "ddpx." + hook._ddpx_name)
    _C.register_comm_hook(_compat.reducer_of(ddp_model), native)
    _compat.record_comm_hook(ddp_model, hook, state)
