"""Which collective library a process group runs a device's tensors on (``ddpx._compat
.backend_kind``), and the decisions ddpx takes from it, for every NCCL class torch has: the
classic ProcessGroupNCCL ("nccl"), torch 2.15's ProcessGroupNCCL2 (what ``"nccl"`` builds
there; named "nccl2") and its lazy variant ("nccl-lazy"). Without a GPU the NCCL groups cannot
be made, so they are stood in for by objects with torch 2.x's lookup (``_get_backend(device)
.name()``); a real Gloo group checks the lookup itself. The C++ side's counterpart is
``BackendKind.*`` in tests/cpp/test_comm.cpp."""
import pytest
import torch
import torch.distributed as dist

from ddpx import _compat
from ddpx.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from dist_utils import run_ranks

GROUPS_MAP_DEVICES = hasattr(dist.ProcessGroup, "_get_backend")  # torch 2.x


class _Backend:
    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name


class _Group:
    """A torch 2.x ProcessGroup as backend_kind sees it: device type -> backend name."""

    def __init__(self, backends):
        self._backends = backends
        self._device_types = [torch.device(d) for d in backends]

    def _get_backend(self, device):
        if device.type not in self._backends:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return _Backend(self._backends[device.type])


def _comm_device(group, device):
    zero = object.__new__(ZeroRedundancyOptimizer)  # only the attributes _comm_device reads
    zero.process_group, zero._default_device = group, torch.device(device)
    return zero._comm_device()


@pytest.mark.skipif(not GROUPS_MAP_DEVICES, reason="a torch 1.13 group is one backend")
@pytest.mark.parametrize("nccl", _compat.NCCL_KINDS)
def test_every_nccl_class_is_nccl(nccl):
    group = _Group({"cpu": "gloo", "cuda": nccl})  # "cpu:gloo,cuda:<nccl>"
    assert _compat.backend_kind(group, "cuda") == nccl
    assert _compat.backend_kind(group, torch.device("cuda", 1)) == nccl
    assert _compat.backend_kind(group, "cpu") == "gloo"
    assert _compat.is_nccl(group, "cuda") and not _compat.is_nccl(group, "cpu")
    # ZeroRedundancyOptimizer's point-to-point state transfers: on the GPU for every NCCL class
    # (nccl2's send/recv take no CPU tensors), on the CPU for Gloo.
    assert _comm_device(group, "cuda:0") == torch.device("cuda", 0)
    assert _comm_device(_Group({"cpu": "gloo", "cuda": "gloo"}), "cuda:0") == torch.device("cpu")
    assert _comm_device(group, "cpu") == torch.device("cpu")


@pytest.mark.skipif(not GROUPS_MAP_DEVICES, reason="a torch 1.13 group is one backend")
def test_other_and_missing_backends():
    group = _Group({"cpu": "gloo"})
    assert _compat.backend_kind(group, "cuda") == "none"
    assert not _compat.is_nccl(group, "cuda")
    assert _compat.backend_kind(_Group({"cuda": "ucc"}), "cuda") == "ucc"
    assert _compat.backend_kind(_Group({"cuda": "nccl2"})) == "nccl2"  # the group's device


def _rank_kinds(rank, world_size):
    return {"default": _compat.backend_kind(None), "cpu": _compat.backend_kind(None, "cpu"),
            "world": _compat.backend_kind(dist.group.WORLD, torch.device("cpu")),
            "is_nccl": _compat.is_nccl(None, "cpu")}


def test_a_gloo_group_is_gloo():
    for got in run_ranks(_rank_kinds, 2):
        assert got == {"default": "gloo", "cpu": "gloo", "world": "gloo", "is_nccl": False}
