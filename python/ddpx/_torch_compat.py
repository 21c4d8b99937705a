"""What ddpx's Python side, its tests and its benchmarks need to know about the installed torch,
in one place (the C++ side's counterpart is include/ddpx/common/compat.h). Each fact says where
it was seen: Debian's torch 1.13.1 (reports 1.13.0a0) and pip's torch 2.11.0+cu130.
"""
import torch
import torch.distributed as dist

def major_minor(version: str) -> tuple:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11), "1.13.0a0" -> (1, 13)."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


TORCH_VERSION = major_minor(torch.__version__)


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
        return tuple(torch.cuda.nccl.version())[:2] >= (2, 10)
    except Exception:  # noqa: BLE001 - no NCCL library loadable
        return False


TORCH_BF16_HOOKS_ON_GLOO = _torch_bf16_hooks_on_gloo()
