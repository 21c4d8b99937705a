"""ddpx: native C++ DDP communication hooks for torch.distributed.

Two ways to use a hook, with the same hook objects:

* drop-in: ``ddp_model.register_comm_hook(state, ddpx.hooks.fp16_compress_hook)``, the same
  call, names, arguments and defaults as torch's own hooks;
* native: ``ddpx.register_comm_hook(ddp_model, state, ddpx.hooks.fp16_compress_hook)`` puts
  the C++ hook straight into DDP's C++ Reducer: no Python runs per bucket during backward.

C++ programs: ``ddpx.cmake_prefix_path`` is the folder to put on ``CMAKE_PREFIX_PATH`` for
``find_package(ddpx)`` against this installed ddpx (as ``torch.utils.cmake_prefix_path``).

Post-local SGD: ``ddpx.hooks.post_localSGD_hook`` with ``ddpx.hooks.PostLocalSGDState``, the model
averagers of ``ddpx.model_averaging`` and ``ddpx.optim.PostLocalSGDOptimizer``.
"""
# The loader first: it raises a clear ImportError on a torch mismatch, before anything else.
from ._loader import _C  # noqa: F401

# isort: split
import os as _os

from . import hooks, model_averaging, optim
from ._version import __version__
from .hooks import register_comm_hook
from .model_averaging import HierarchicalModelAverager, PeriodicModelAverager
from .optim import PostLocalSGDOptimizer

# DDPX_STACKS_ON_ABORT=1 turns on torch's fatal-signal handler: on SIGABRT, SIGSEGV, SIGBUS, SIGILL,
# SIGFPE or SIGINT every thread prints its C++ stack before the process dies. An abort at
# interpreter exit ("terminate called without an active exception") then names the thread whose
# std::thread was destroyed joinable. The test harnesses set it; it costs nothing until a signal.
if _os.environ.get("DDPX_STACKS_ON_ABORT", "") not in ("", "0"):
    import torch as _torch

    _torch._C._set_print_stack_traces_on_fatal_signal(True)

#: ``CMAKE_PREFIX_PATH`` for ``find_package(ddpx)``: the installed package holds the C++ library,
#: headers and CMake package (lib/, include/, lib/cmake/ddpx/), put there by ``pip install``. A
#: build tree on PYTHONPATH (build/python) has none: use ``cmake --install`` there.
cmake_prefix_path = _os.path.dirname(_os.path.abspath(__file__))

__all__ = [
    "hooks",
    "model_averaging",
    "optim",
    "register_comm_hook",
    "PeriodicModelAverager",
    "HierarchicalModelAverager",
    "PostLocalSGDOptimizer",
    "__version__",
    "cmake_prefix_path",
]
