"""Distributed optimizers, laid out as ``torch.distributed.optim``: ``DiLoCo`` (DiLoCo and
Streaming DiLoCo, ``diloco``), ``PostLocalSGDOptimizer`` over ddpx's native model averagers
(``post_localSGD_optimizer``), ``ZeroRedundancyOptimizer`` over ddpx's ZeRO engine
(``zero_redundancy_optimizer``), and the RPC ``DistributedOptimizer`` with the owners' steps in C++
(``optimizer``)."""
from .diloco import DiLoCo
from .post_localSGD_optimizer import PostLocalSGDOptimizer
from .zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["DiLoCo", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer"]

try:  # torch.distributed.rpc is missing from some builds of torch
    from .optimizer import DistributedOptimizer  # noqa: F401

    __all__.append("DistributedOptimizer")
except ImportError:  # pragma: no cover
    pass
