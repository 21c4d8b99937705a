"""What ddpx's Python side, its tests and its benchmarks need to know about the installed torch,
in one place (the C++ side's counterpart is include/ddpx/common/compat.h).

Two kinds of entries, each saying where it was seen (Debian's torch 1.13.1, which reports
1.13.0a0, and pip's torch 2.11.0+cu130):

* facts about the installed torch (``TORCH_VERSION``, ``TORCH_BF16_HOOKS_ON_GLOO``);
* every private or undocumented torch attribute the package reads, behind a small function.
  No other module of the package reads one, so a torch release that moves one breaks here.
"""
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist


def major_minor(version: str) -> tuple:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11), "1.13.0a0" ->
    (1, 13)."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


TORCH_VERSION = major_minor(torch.__version__)


# ---- facts about the installed torch ------------------------------------------------------------

def _nccl_version() -> tuple:
    """``torch.cuda.nccl.version()``: the NCCL torch was built with, (major, minor, patch[,
    suffix]) in 1.13 and 2.x. Raises when torch has no NCCL library."""
    return tuple(torch.cuda.nccl.version())


def _torch_bf16_hooks_on_gloo() -> bool:
    """Whether torch's own bf16_compress_hook / bf16_compress_wrapper run on Gloo (CPU).

    DDP's _check_comm_hook refuses them unless torch is a CUDA 11+ build with NCCL >= 2.10 (a
    GPU is not needed: pip's CUDA wheel passes on a CPU-only machine, Debian's CPU-only 1.13
    does not), and Gloo must reduce bf16, which 1.13's Gloo cannot. Seen: 2.11.0+cu130 runs
    both on 2 Gloo CPU ranks; 1.13 raises "BF16 all reduce communication hook required CUDA
    11+ and NCCL 2.10+"."""
    if TORCH_VERSION < (2, 0) or not torch.version.cuda:
        return False
    if int(torch.version.cuda.split(".")[0]) < 11 or not dist.is_nccl_available():
        return False
    try:
        return _nccl_version()[:2] >= (2, 10)
    except Exception:  # noqa: BLE001 - no NCCL library loadable
        return False


TORCH_BF16_HOOKS_ON_GLOO = _torch_bf16_hooks_on_gloo()


# ---- private / undocumented torch attributes ----------------------------------------------------

def process_group_ranks(group: dist.ProcessGroup) -> List[int]:
    """The global ranks of a (non-WORLD) group, in group-rank order. torch 2.x:
    ``dist.get_process_group_ranks`` (public). torch 1.13 has no such function: the private
    ``dist.distributed_c10d._pg_group_ranks[group]`` maps global rank -> group rank."""
    getter = getattr(dist, "get_process_group_ranks", None)
    if getter is not None:
        return list(getter(group))
    mapping = dist.distributed_c10d._pg_group_ranks[group]
    return [g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1])]


def is_non_group_member(group: Any) -> bool:
    """Whether ``group`` is the placeholder ``dist.new_group`` returns on ranks outside the group:
    ``dist.GroupMember.NON_GROUP_MEMBER`` (undocumented; an ``object()`` in 1.13, the int -100 in
    2.x, the same object every time in both)."""
    return group is dist.GroupMember.NON_GROUP_MEMBER


def reducer_of(ddp_model: torch.nn.parallel.DistributedDataParallel) -> Any:
    """DDP's C++ Reducer (``ddp_model.reducer``: undocumented, set in ``__init__`` in 1.13 and
    2.x), where a native hook is installed."""
    return ddp_model.reducer


def set_comm_hook_name(ddp_model: torch.nn.parallel.DistributedDataParallel, name: str) -> None:
    """Names the hook in DDP's logging data, as ``register_comm_hook`` does for Python hooks:
    the private ``ddp_model.logger._set_comm_hook_name`` (1.13 and 2.x; the logger is None when
    DDP logging is off)."""
    logger = getattr(ddp_model, "logger", None)
    if logger is not None:
        logger._set_comm_hook_name(name)


def record_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel,
                     hook: Callable, state: Any) -> None:
    """torch 2.x's DDP keeps the registered (hook, state) pairs in the private list
    ``ddp_model._comm_hooks`` for its own bookkeeping: keep it truthful for a natively
    registered hook. torch 1.13 has no such list."""
    hooks = getattr(ddp_model, "_comm_hooks", None)
    if isinstance(hooks, list):
        hooks.append((hook, state))


def uses_python_reducer(ddp_model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``ddp_model`` was built under ``torch._dynamo.config.optimize_ddp =
    "python_reducer"`` (torch.compile's compiled-autograd DDP): DDP then never runs its C++
    Reducer's buckets and calls each registered hook once per gradient as ``hook(state, (grad,
    param))``, ignoring what it returns. DDP decides it in ``__init__`` (the private
    ``_use_python_reducer``: 2.11 and 2.15; 1.13 has no such mode)."""
    return bool(getattr(ddp_model, "_use_python_reducer", False))


PYTHON_REDUCER_MESSAGE = (
    "ddpx's hooks need DDP's gradient buckets, which a DDP model built under "
    "torch._dynamo.config.optimize_ddp=\"python_reducer\" does not have (DDP then calls hooks once "
    "per gradient with a (grad, param) tuple; torch's own allreduce_hook fails there too). Build "
    "the model under the default optimize_ddp=\"ddp_optimizer\": torch.compile works with every "
    "ddpx hook there, drop-in and native.")

# ---- torch.optim internals read by ddpx.optim.ZeroRedundancyOptimizer ---------------------------

def optimizer_has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step pre/post hooks are registered on ``optimizer`` or globally (2.x's
    ``register_step_pre_hook`` / ``register_optimizer_step_pre_hook``; 1.13 has none). ZeRO's fused
    step runs the local optimizer's arithmetic without calling its ``step``, so it steps aside when
    a hook expects that call."""
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if getattr(optimizer, attr, None):
            return True
    import torch.optim.optimizer as optimizer_module
    for attr in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        if getattr(optimizer_module, attr, None):
            return True
    return False


_SGD_NONE_BUFFER: List[bool] = []


def sgd_stores_none_momentum_buffer() -> bool:
    """Whether ``torch.optim.SGD`` without momentum writes ``state['momentum_buffer'] = None`` for
    every stepped parameter (seen in 1.13) or leaves the state empty (seen in 2.11). Found by
    stepping a one-element SGD once; the answer is cached."""
    if not _SGD_NONE_BUFFER:
        p = torch.zeros(1, requires_grad=True)
        p.grad = torch.zeros(1)
        opt = torch.optim.SGD([p], lr=0.1)
        opt.step()
        _SGD_NONE_BUFFER.append("momentum_buffer" in opt.state[p])
    return _SGD_NONE_BUFFER[0]


def functional_optimizer_map() -> dict:
    """``torch.distributed.optim.utils.functional_optim_map``: torch.optim classes -> torch's
    functional optimizer classes (the optimizers ZeRO's ``overlap_with_ddp=True`` accepts)."""
    try:
        from torch.distributed.optim.utils import functional_optim_map
    except ImportError:  # pragma: no cover
        return {}
    return dict(functional_optim_map)


def functional_optimizer_classes() -> tuple:
    """torch's functional optimizer classes, which only ``overlap_with_ddp=True`` accepts."""
    return tuple(functional_optimizer_map().values())


# ---- process groups' backends -------------------------------------------------------------------

#: The backend kinds ``backend_kind`` returns for NCCL: torch's classic ``ProcessGroupNCCL``
#: ("nccl"), torch 2.15's ``ProcessGroupNCCL2`` (what ``"nccl"`` builds there unless
#: ``TORCH_DIST_USE_NCCL2=0``; also ``"nccl2"``) and its lazy variant ``"nccl-lazy"``.
NCCL_KINDS = ("nccl", "nccl2", "nccl-lazy")


def backend_kind(group: Any, device: Any = None) -> str:
    """The collective library ``group`` runs ``device``'s tensors on: "gloo", "nccl" (torch's
    classic ProcessGroupNCCL), "nccl2", "nccl-lazy", another backend's own name, or "none" when
    the group has no backend for that device type. ``device`` None: the group's default.

    Decided by the backend object's name, never by the name the group was created with: in torch
    2.15 ``init_process_group("nccl")`` builds a ``ProcessGroupNCCL2`` (its ``name()`` is
    "nccl2") while ``dist.get_backend`` still says "nccl", and ``"nccl2"``/``"nccl-lazy"`` groups
    report "custom" as their ProcessGroup's name. torch 1.13's group is its one backend."""
    if group is None:
        group = dist.group.WORLD
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is not None:  # torch 2.x
        if device is None:
            device = next(iter(getattr(group, "_device_types", ()) or ()), None)
            if device is None:
                device = "cpu"
        try:
            return str(get_backend(torch.device(device)).name())
        except RuntimeError:  # "No backend type associated with device type ..."
            return "none"
    return str(dist.get_backend(group))


def is_nccl(group: Any, device: Any = None) -> bool:
    """Whether ``group`` runs ``device``'s tensors on NCCL, of any of torch's classes
    (``NCCL_KINDS``)."""
    return backend_kind(group, device) in NCCL_KINDS


# ---- RPC --------------------------------------------------------------------------------------

def rpc_builtin(stub: Callable, qualified_name: str) -> Optional[Callable]:
    """Makes ``stub`` stand for the builtin operator ``qualified_name`` (an ``aten::`` operator
    registered in the JIT's table) in torch's RPC: ``rpc.rpc_async(to, stub, args)`` then sends
    the operator call, which the callee's agent runs without Python. torch's RPC looks callables
    up in ``torch.jit._builtins``' table (``_find_builtin``; private, the same in 1.13, 2.11 and
    2.15), which only knows torch's own functions: ``_register_builtin`` adds ``stub``. The
    operator must be registered on caller and callee alike (ddpx._C registers ddpx's). Returns
    ``stub``, or None when that table is missing (the caller falls back)."""
    try:
        from torch.jit import _builtins
        register, find = _builtins._register_builtin, _builtins._find_builtin
    except (ImportError, AttributeError):
        return None
    register(stub, qualified_name)
    return stub if find(stub) == qualified_name else None
