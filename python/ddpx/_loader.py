"""Loads the compiled module ddpx._C and checks that it was built for the installed torch.

ddpx's C++ code links one torch's libraries and C++ ABI, so a ddpx built for another torch
cannot work: it fails to load (undefined symbols) or, worse, loads and misbehaves. The build
writes ``_build_info.py`` beside the module (the torch it was compiled against); it is checked
*before* the module is loaded, so the error names both versions and says how to rebuild.
"""
import torch

from ._compat import TORCH_VERSION, major_minor

_REBUILD = ("rebuild ddpx in this environment: `pip install --no-build-isolation .` from the "
            "ddpx sources (no build isolation, so that this torch is the one it builds against)")


try:
    from . import _build_info
except ImportError:  # pragma: no cover - a build tree from before _build_info existed
    _build_info = None

if _build_info is not None:
    _built = _build_info.TORCH_VERSION
    if major_minor(_built) != TORCH_VERSION:
        raise ImportError(
            f"ddpx was built against torch {_built} but torch {torch.__version__} is installed "
            f"(ddpx needs the same torch major.minor it was compiled for); {_REBUILD}.")
    if bool(_build_info.TORCH_CUDA) and not torch.version.cuda:
        raise ImportError(
            f"ddpx was built against a CUDA build of torch {_built} (CUDA "
            f"{_build_info.TORCH_CUDA}) but the installed torch {torch.__version__} has no CUDA; "
            f"{_REBUILD}.")

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - depends on the install
    built = f" (built against torch {_build_info.TORCH_VERSION})" if _build_info else ""
    raise ImportError(
        f"ddpx: cannot load the compiled module ddpx._C{built} with the installed torch "
        f"{torch.__version__}: {exc}. {_REBUILD}.") from exc

# Without _build_info (a build tree older than it), the module's own record; with it, the same
# fact as checked above, at no cost.
if major_minor(_C.__torch_version__) != TORCH_VERSION:
    raise ImportError(
        f"ddpx: the compiled module ddpx._C was built against torch {_C.__torch_version__} but "
        f"torch {torch.__version__} is installed; {_REBUILD}.")
