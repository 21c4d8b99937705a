"""torch's default hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``fp16_compress_wrapper``, ``bf16_compress_wrapper``) and debugging ``noop_hook``, run by native
C++ code. Their state is a ProcessGroup, or None for the default group."""
import importlib
import re
from typing import Dict, Tuple

import torch

from .._loader import _C
from .._native import HookFn, make_hook, native_hook


def _example(hook: str) -> str:
    return f"""

    Example::
        >>> ddp_model.register_comm_hook(process_group, ddpx.hooks.{hook})
    """


allreduce_hook = make_hook(
    "allreduce_hook",
    _C.allreduce_hook,
    """Averages the bucket over the group with one allreduce, like torch's ``allreduce_hook``
    (same result, bit for bit, for fp32 gradients). ``state`` is a ProcessGroup or None for the
    default group.""" + _example("allreduce_hook"),
    first_param="process_group",
)

fp16_compress_hook = make_hook(
    "fp16_compress_hook",
    lambda group: _C.compress_hook(group, torch.float16),
    """Divides the bucket by the group size and casts it to ``torch.float16`` in one fused pass,
    exchanges the half-precision values and writes the mean back in the bucket's dtype.
    On Gloo the fp16 values are gathered and summed in fp32 (faster than Gloo's scalar fp16
    sums, and no fp16 rounding of partial sums).""" + _example("fp16_compress_hook"),
    first_param="process_group",
)

bf16_compress_hook = make_hook(
    "bf16_compress_hook",
    lambda group: _C.compress_hook(group, torch.bfloat16),
    """Like :func:`fp16_compress_hook` with ``torch.bfloat16``. Works on Gloo and on CPU too
    (torch's own refuses anything but NCCL >= 2.10 with CUDA).""" + _example("bf16_compress_hook"),
    first_param="process_group",
)

noop_hook = make_hook(
    "noop_hook",
    lambda state: _C.noop_hook(),
    """Returns the bucket unchanged without any communication: for headroom analysis only
    (gradients are *not* synchronised).

    Example::
        >>> ddp_model.register_comm_hook(None, ddpx.hooks.noop_hook)
    """,
    state_type=object,
    first_param="_",
)


# The hooks the wrappers made, by wrapper and wrapped hook: a wrapper called twice on the same
# hook returns the same function, the one pickle finds again by its __qualname__ (see
# __getattr__ below).
_wrapped: Dict[Tuple[str, HookFn], HookFn] = {}


def _make_wrapper(dtype: torch.dtype, name: str):
    def wrapper(hook: HookFn) -> HookFn:
        if getattr(hook, "_ddpx_factory", None) is None:
            raise TypeError(
                f"{name}: hook must be a ddpx hook (e.g. ddpx.hooks.allreduce_hook), got "
                f"{getattr(hook, '__qualname__', repr(hook))}; to wrap a Python hook use "
                f"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.{name}"
            )
        wrapped = _wrapped.get((name, hook))
        if wrapped is None:
            # The state goes to the wrapped hook as it is: that hook checks it.
            wrapped = make_hook(
                f"{name}_hook",
                lambda state: _C.compress_wrapper(native_hook(hook, state), dtype),
                f"{name}({hook._ddpx_name}): runs the wrapped hook on a {dtype} copy of the "
                "bucket and casts its result back into the bucket's dtype.",
                state_type=object,
                first_param="hook_state",
                qualname=f"{name}({hook.__qualname__})",
            )
            _wrapped[(name, hook)] = wrapped
        return wrapped

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = f"""Casts the bucket to ``{dtype}``, runs the given ddpx hook on it, and casts
    the result back to the bucket's dtype, like torch's ``{name}``.
    ``{name}(allreduce_hook)`` averages like the compress hook of the same dtype.

    The hook it returns is named ``{name}(<the wrapped hook's name>)`` (its ``__qualname__``,
    which DDP's logging data records) and, unlike torch's (a local function), pickles when the
    wrapped hook is one of ``ddpx.hooks``' (or a wrapper of one): it unpickles to the same
    function, ``{name}(hook)`` of the same hook.

    Example::
        >>> state = ddpx.hooks.PowerSGDState(process_group, matrix_approximation_rank=1)
        >>> ddp_model.register_comm_hook(state, ddpx.hooks.{name}(ddpx.hooks.powerSGD_hook))
    """
    return wrapper


fp16_compress_wrapper = _make_wrapper(torch.float16, "fp16_compress_wrapper")
bf16_compress_wrapper = _make_wrapper(torch.bfloat16, "bf16_compress_wrapper")


_WRAPPED_NAME = re.compile(r"(fp16_compress_wrapper|bf16_compress_wrapper)\((.+)\)")


def __getattr__(name: str) -> HookFn:
    """Pickle's lookup of a wrapped hook: ``fp16_compress_wrapper(powerSGD_hook)`` (its
    ``__qualname__``) is the wrapper applied to the hook of ``ddpx.hooks`` of that name (or to the
    wrapped hook such a name spells, for a wrapper of a wrapper), the same function whichever
    process builds it first. Other names raise AttributeError, as for any module."""
    match = _WRAPPED_NAME.fullmatch(name)
    if match is not None:
        wrapper, inner = match.groups()
        if _WRAPPED_NAME.fullmatch(inner):
            hook = __getattr__(inner)
        else:
            hook = getattr(importlib.import_module(__package__), inner, None)
        if getattr(hook, "_ddpx_factory", None) is not None:
            return globals()[wrapper](hook)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
