"""What the tests rely on that differs between the torch versions ddpx supports (facts the
library or the benchmarks need too live in ddpx/_compat.py and are re-exported here).

Checked on Debian's torch 1.13.1 and pip's torch 2.11.0. Tests read these names instead of
comparing versions, so a new difference is added here, once, with what was seen on each torch.
"""
import contextlib
import inspect
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpx._compat import TORCH_VERSION  # noqa: E402

# An exception raised by a Python comm hook during backward(): torch 1.13 reports it as a
# RuntimeError whose text carries the original type's name and message; torch 2.x re-raises the
# original exception (a TypeError stays a TypeError).
HOOK_ERRORS_KEEP_TYPE = TORCH_VERSION >= (2, 0)


def hook_error_type(raised: str) -> str:
    """The exception type backward() shows for `raised` raised inside a Python comm hook."""
    return raised if HOOK_ERRORS_KEEP_TYPE else "RuntimeError"


# DDP's cap for its first bucket after the rebuild. torch 1.13 always takes it from
# dist._DEFAULT_FIRST_BUCKET_BYTES; torch 2.x does so only when bucket_cap_mb is not given, and
# otherwise uses bucket_cap_mb for the first bucket too. torch 2.x has bucket_cap_mb_list
# instead ([first, rest...]), used for the first iteration and for the rebuild alike.
DDP_HAS_BUCKET_CAP_LIST = "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters


def ddp_bucket_kwargs(bucket_bytes: int, first_bucket_bytes: int) -> Dict[str, Any]:
    """DDP keyword arguments (and the global torch 1.13 reads) for buckets of `bucket_bytes`
    after a first bucket of `first_bucket_bytes`, on either torch."""
    dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket_bytes
    if first_bucket_bytes != bucket_bytes and DDP_HAS_BUCKET_CAP_LIST:
        return {"bucket_cap_mb_list": [first_bucket_bytes / 2 ** 20, bucket_bytes / 2 ** 20]}
    return {"bucket_cap_mb": bucket_bytes / 2 ** 20}


def _torch_batched_powersgd_works() -> bool:
    """torch's batched_powerSGD_hook fails on its first compressed step: it passes the 2-D Q to
    _orthogonalize, which asserts a 3-D batch. Seen on 1.13.1 and on 2.11.0 alike (False on
    both); a torch whose _orthogonalize takes 2-D input makes this True."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
    try:
        tp._orthogonalize(torch.ones(4, 1))
    except AssertionError:
        return False
    return True


TORCH_BATCHED_POWERSGD_WORKS = _torch_batched_powersgd_works()


# Whether torch's own bf16 hooks run on Gloo: a fact about torch that the benchmarks need too.
from ddpx._compat import TORCH_BF16_HOOKS_ON_GLOO  # noqa: E402,F401

# torch 1.13's torchrun crashes at launch on Python 3.11 ('NoneType' object has no attribute
# 'get' in elastic's to_map: 3.11 no longer iterates the zero member of the Std flag enum);
# `--redirects 1 --tee 1` avoids it. torch 2.x launches plainly.
TORCHRUN_WORKAROUND_ARGS = ["--redirects", "1", "--tee", "1"] if TORCH_VERSION < (2, 0) else []


def _new_subgroups_without_cuda() -> bool:
    """torch 1.13's new_subgroups_by_enumeration (and so new_subgroups with any group_size)
    raises "Subgroups can only be created when CUDA is available"; torch 2.x's builds them on
    CPU (only new_subgroups() with the default size, one per GPU, still needs CUDA). Seen on
    2 Gloo ranks: 1.13 raises for both; 2.11 builds new_subgroups(group_size=1)."""
    import torch.distributed.distributed_c10d as c10d
    try:
        source = inspect.getsource(c10d.new_subgroups_by_enumeration)
    except (OSError, TypeError):  # pragma: no cover - no sources installed
        return TORCH_VERSION >= (2, 0)
    return "Subgroups can only be created when CUDA is available" not in source


NEW_SUBGROUPS_WITHOUT_CUDA = _new_subgroups_without_cuda()


def _cpu_half_bmm() -> bool:
    """torch 1.13 has no CPU kernel for bmm in float16 ("bmm" not implemented for 'Half'), so
    torch's PowerSGD under fp16_compress_wrapper fails on CPU there; torch 2.x has one."""
    try:
        one = torch.ones(1, 2, 2, dtype=torch.float16)
        torch.bmm(one, one)
    except RuntimeError:
        return False
    return True


TORCH_CPU_HALF_BMM = _cpu_half_bmm()


def gloo_exit_race(out: str) -> bool:
    """Whether a torchrun job's output shows torch's Gloo exit race rather than a fault of the
    program: "terminate called without an active exception" where the aborting thread is one of
    ProcessGroupGloo's workers that called pthread_exit. A worker that destroys a finished work
    (a barrier keeps the works it waited for until it is destroyed) drops the Python objects in
    that work's captured ThreadLocalState; if the main thread has begun finalizing Python by
    then, taking the GIL exits the thread, and unwinding through a noexcept frame terminates the
    process after the program's last line ran. Seen about once in 30 runs of a short job on a
    loaded 2-core machine (torch 2.15). Needs DDPX_STACKS_ON_ABORT=1 (every thread's stack)."""
    if "terminate called without an active exception" not in out:
        return False
    # One block per thread, each opened by torch's fatal-signal handler.
    blocks = out.split("SIGABRT(6), PID: ")[1:]
    return any("pthread_exit" in b and "ProcessGroupGloo::runLoop" in b for b in blocks)


@contextlib.contextmanager
def exact_sqrt():
    """torch.Tensor.sqrt / sqrt_ correctly rounded (numpy's) inside, as ddpx's kernels and torch
    1.13 compute it: pip's torch 2.x CPU sqrt is not (about 15% of float32 results are 1 ulp
    off). For comparing an optimizer with torch's bit for bit, and for problems that magnify that
    rounding past any useful tolerance."""
    import numpy as np  # scripts/requirements-torch2.txt; Debian's python3-numpy

    def sqrt(t):
        return torch.from_numpy(np.sqrt(t.numpy()))

    def sqrt_(t):
        return t.copy_(sqrt(t))

    old = torch.Tensor.sqrt, torch.Tensor.sqrt_
    torch.Tensor.sqrt, torch.Tensor.sqrt_ = sqrt, sqrt_
    try:
        yield
    finally:
        torch.Tensor.sqrt, torch.Tensor.sqrt_ = old
