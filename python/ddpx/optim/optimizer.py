"""``ddpx.optim.DistributedOptimizer``: torch's RPC ``DistributedOptimizer`` with the owners'
steps in C++.

torch's class creates one local optimizer per worker that owns parameters and, at each
``step(context_id)``, asks every such worker over RPC to step it with the gradients distributed
autograd accumulated in that context. Unless the optimizer has a TorchScript functional form (a
path torch 2.x deprecates), that remote step is a Python function on the owner, under its GIL:
trainers stepping concurrently, and any Python thread of the owner, serialize on it.

ddpx keeps the API and the semantics, and runs the remote step in C++: the owner's optimizer is
a ddpx functional optimizer (``ddpx/optim/rpc_local_optimizer.h``) registered under an id, and the
RPC the trainer sends is a call to the builtin operator ``aten::_ddpx_rpc_optimizer_step(id,
context_id)``, which fetches the context's gradients and steps: torch's RPC agent runs a builtin
operator on its own thread without Python, so without the owner's GIL. Only the construction runs
Python on the owners (once). No TorchScript is involved (torch 2.14 deprecates it), and no
distributed-autograd C++ header, which Debian's torch 1.13 does not ship. Where the builtin cannot
be registered (``_compat.rpc_builtin``), each step is a Python function on the owner that enters
C++ at once and releases the GIL there, with a one-time warning: correct, but it takes the owner's
GIL briefly a few times per step.

Optimizer classes with a C++ form (``ddpx.optim._options``' table): ``torch.optim.SGD``,
``Adam``, ``AdamW``, ``Adagrad``, ``RMSprop``, ``Adadelta``, ``Adamax``, ``RAdam``, ``Rprop``. Any
other falls back to running torch's optimizer in Python on the owners, as torch's non-scripted
path does, with a one-time warning naming the reason.
"""
import inspect
import threading
import warnings
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef

from .. import _compat
from .._loader import _C
from ._options import cpp_options, has_cpp_form

__all__ = ["DistributedOptimizer"]

_warned: set = set()
_warn_lock = threading.Lock()


def _warn_once(key: Any, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, stacklevel=3)


def _native_options(optimizer_class: type, args: tuple, kwargs: dict) -> Tuple[Any, str]:
    """(C++ options, "") when ``optimizer_class(params, *args, **kwargs)`` has a C++ form, else
    (None, the reason). Bad arguments raise as torch's constructor would."""
    if not has_cpp_form(optimizer_class):
        return None, f"{optimizer_class.__qualname__} has no C++ form in ddpx"
    signature = inspect.signature(optimizer_class)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"DistributedOptimizer: {optimizer_class.__qualname__}: {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))  # params
    return cpp_options(optimizer_class, arguments, tensors=True)


# ---- owner side -----------------------------------------------------------------------------
class _NativeLocalOptimizer:
    """Keeps a worker's registered C++ optimizer alive as long as the trainer's RRef to it:
    deleting it (the DistributedOptimizer is gone) unregisters the optimizer."""

    def __init__(self, local_params_rref: List[RRef], options: Any):
        self._params = [rref.local_value() for rref in local_params_rref]
        self.id = _C._rpc_optimizer_new(self._params, options)

    def __del__(self):
        unregister = getattr(_C, "_rpc_optimizer_delete", None)
        if unregister is not None:  # at interpreter exit the module may be gone
            unregister(self.id)


def _new_native_local_optimizer(local_params_rref, options):
    local = _NativeLocalOptimizer(local_params_rref, options)
    return rpc.RRef(local), local.id


class _PythonLocalOptimizer:
    """The fallback: torch's optimizer in Python on the owner. One lock per process serializes
    steps, as the C++ path's lock (and torch's _LocalOptimizer) do."""

    lock = threading.Lock()

    def __init__(self, optimizer_class, local_params_rref, *args, **kwargs):
        self._params = [rref.local_value() for rref in local_params_rref]
        self.optim = optimizer_class(self._params, *args, **kwargs)

    def step(self, autograd_ctx_id: int) -> None:
        grads = dist_autograd.get_gradients(autograd_ctx_id)
        with _PythonLocalOptimizer.lock:
            for p in self._params:
                p.grad = grads.get(p)
            try:
                self.optim.step()
            finally:
                for p in self._params:
                    p.grad = None


def _new_python_local_optimizer(optimizer_class, local_params_rref, *args, **kwargs):
    return rpc.RRef(_PythonLocalOptimizer(optimizer_class, local_params_rref, *args, **kwargs))


def _python_local_step(local_rref, autograd_ctx_id):
    local_rref.local_value().step(autograd_ctx_id)


def _python_native_step(optimizer_id: int, autograd_ctx_id: int) -> None:
    """The step when the builtin is not available: Python on the owner only to enter C++."""
    _C._rpc_optimizer_step_context(optimizer_id, autograd_ctx_id)


def _ddpx_rpc_optimizer_step(optimizer_id: int, autograd_ctx_id: int) -> bool:
    """The callable trainers pass to ``rpc.rpc_async``: registered as torch's RPC builtin for
    ``aten::_ddpx_rpc_optimizer_step`` (ddpx._C registers the operator), so the RPC carries the
    operator call, not this function. Called directly (not over RPC), it runs the step here."""
    _C._rpc_optimizer_step_context(optimizer_id, autograd_ctx_id)
    return True


_BUILTIN_STEP = _compat.rpc_builtin(_ddpx_rpc_optimizer_step, "aten::_ddpx_rpc_optimizer_step")


def _native_step():
    """What a trainer sends for a native step: the builtin where it could be registered, else the
    Python fallback (with a one-time warning)."""
    if _BUILTIN_STEP is not None:
        return _BUILTIN_STEP
    _warn_once("no-builtin", "ddpx.optim.DistributedOptimizer: torch's RPC builtin table could "
                             "not be extended; each step runs a Python function on the owners "
                             "that releases their GIL at once")
    return _python_native_step


# ---- trainer side ---------------------------------------------------------------------------
def _wait_all(futures, owners, what: str) -> list:
    """Every future's value; the first failure raised (after all are done) with its worker named."""
    results, failure = [], None
    for fut, owner in zip(futures, owners):
        try:
            results.append(fut.wait())
        except Exception as exc:  # noqa: BLE001 - re-raised below with the worker named
            results.append(None)
            if failure is None:
                failure = (owner, exc)
    if failure is not None:
        owner, exc = failure
        raise RuntimeError(f"DistributedOptimizer.{what} failed on worker {owner!r}: "
                           f"{type(exc).__name__}: {exc}") from exc
    return results


def _owner_name(worker) -> str:
    return getattr(worker, "name", str(worker))


class DistributedOptimizer:
    r"""torch's :class:`torch.distributed.optim.DistributedOptimizer`, with the owners' steps in
    C++ (no GIL on the owners).

    Takes RRefs to parameters scattered across workers; on each worker that owns some, builds
    one local optimizer of ``optimizer_class`` over them (with ``*args, **kwargs``); and
    :meth:`step` updates each worker's parameters on that worker with the gradients of the
    given distributed autograd context. All owners step concurrently and :meth:`step` returns
    when all are done; an error on one is raised with the worker named. Concurrent steps on one
    worker (several trainers, several optimizers) are serialized there, never interleaved within
    a parameter update; as with torch, the gradients a step applies need not be those of the
    latest forward pass on that worker, and there is no ordering across workers.

    ``torch.optim.SGD``, ``Adam``, ``AdamW``, ``Adagrad``, ``RMSprop``, ``Adadelta``, ``Adamax``,
    ``RAdam`` and ``Rprop`` run as ddpx's C++ functional optimizers (every argument of torch's: lr,
    momentum, dampening, nesterov, weight_decay, betas, eps, amsgrad, decoupled_weight_decay,
    lr_decay, initial_accumulator_value, alpha, centered, rho, etas, step_sizes, maximize;
    ``foreach`` is ignored). The arguments
    reach the owners as ddpx's typed C++ options (``ddpx.optim._options``). Any other class, or
    an argument the C++ form lacks (``fused``, ``differentiable``...), runs torch's optimizer in
    Python on the owners, with a one-time warning. ``Adam(decoupled_weight_decay=True)``, which
    torch's own class cannot build on the owners (its functional Adam lacks the argument), runs
    as ddpx's C++ AdamW.

    Args:
        optimizer_class: the optimizer class to build on each worker.
        params_rref (list[RRef]): RRefs to local or remote parameters.
        args, kwargs: the optimizer's constructor arguments.
    """

    def __init__(self, optimizer_class, params_rref, *args, **kwargs):
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("DistributedOptimizer: optimizer_class must be a torch.optim."
                            f"Optimizer subclass, got {optimizer_class!r}")
        params_rref = list(params_rref)
        per_worker: Dict[Any, List[RRef]] = defaultdict(list)
        for i, rref in enumerate(params_rref):
            if not isinstance(rref, rpc.PyRRef):  # rpc.remote returns the base class
                raise TypeError(f"DistributedOptimizer: params_rref[{i}] is a "
                                f"{type(rref).__name__}, not an RRef")
            per_worker[rref.owner()].append(rref)
        if has_cpp_form(optimizer_class):
            # torch's own checks and messages for the arguments (lr required in 1.13's SGD, a
            # negative eps...), on a throwaway parameter, before any worker is involved.
            optimizer_class([torch.zeros(1, requires_grad=True)], *args, **kwargs)
        options, reason = _native_options(optimizer_class, args, kwargs)
        self.is_native = options is not None
        # torch's name for "the owners' steps avoid Python" (its TorchScript path; ddpx's C++).
        self.is_functional_optim = self.is_native
        if not self.is_native:
            _warn_once(reason, f"ddpx.optim.DistributedOptimizer: {reason}; its steps run torch's "
                               "optimizer in Python on the owners (under their GIL)")
        owners = list(per_worker)
        futures = []
        for worker in owners:
            if self.is_native:
                futures.append(rpc.rpc_async(worker, _new_native_local_optimizer,
                                             args=(per_worker[worker], options)))
            else:
                futures.append(rpc.rpc_async(worker, _new_python_local_optimizer,
                                             args=(optimizer_class, per_worker[worker]) + args,
                                             kwargs=kwargs))
        made = _wait_all(futures, [_owner_name(w) for w in owners], "__init__")
        # (owner name, RRef keeping the local optimizer alive, C++ id or None)
        self._locals = [(_owner_name(w), m[0], m[1]) if self.is_native else
                        (_owner_name(w), m, None) for w, m in zip(owners, made)]
        self.remote_optimizers = [local for _, local, _ in self._locals]

    def step(self, context_id: int) -> None:
        """One step on every owner with the gradients of distributed autograd context
        ``context_id``; blocks until all owners are done."""
        dist_autograd._is_valid_context(context_id)
        futures = []
        for owner, local, optimizer_id in self._locals:
            if self.is_native:
                futures.append(rpc.rpc_async(owner, _native_step(),
                                             args=(optimizer_id, context_id)))
            else:
                futures.append(rpc.rpc_async(owner, _python_local_step,
                                             args=(local, context_id)))
        _wait_all(futures, [owner for owner, _, _ in self._locals], "step")
