"""Loads the compiled module ddpx._C and checks it matches the installed torch."""
import torch

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "ddpx: cannot load the compiled module ddpx._C ({}). ddpx must be built against the "
        "torch it runs with (installed: torch {}); rebuild it with "
        "`pip install --no-build-isolation .` in this environment.".format(exc, torch.__version__)
    ) from exc

_installed = ".".join(torch.__version__.split("+")[0].split(".")[:2])
if _C.__torch_version__ != _installed:
    raise ImportError(
        "ddpx: the compiled module ddpx._C was built against torch {} but torch {} is "
        "installed; rebuild ddpx with `pip install --no-build-isolation .` in this "
        "environment.".format(_C.__torch_version__, torch.__version__)
    )
