"""pytest set-up for the ddpx Python tests.

Which ddpx is tested: an installed ddpx (``pip install --no-build-isolation .``) when there is
one; otherwise the CMake build tree, ``$DDPX_BUILD_PYTHON_DIR`` (default ``<repo>/build/python``).
An installed ddpx that fails to import is an error, never silently replaced by the build tree.
"""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The rank functions live in the test modules and are pickled by reference: a rank process
# imports them by module name, so this directory must be importable there too.
if HERE not in sys.path:
    sys.path.insert(0, HERE)

if importlib.util.find_spec("ddpx") is None:
    _build = os.environ.get("DDPX_BUILD_PYTHON_DIR", os.path.join(REPO, "build", "python"))
    if not os.path.isdir(os.path.join(_build, "ddpx")):
        raise ImportError(
            f"ddpx is neither installed nor built in {_build}: build it (cmake --build build) or "
            "pip-install it, or point DDPX_BUILD_PYTHON_DIR at the folder holding ddpx/")
    sys.path.insert(0, _build)

import pytest  # noqa: E402
import torch  # noqa: E402

import ddpx  # noqa: E402  (after the path set-up; fails loudly on a broken build)
import selection  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cases(*patterns): the cases of the module's batch launches this test reads "
        "(none: only what every launch makes), so that -k launches only those (selection.py)")


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(session, config, items):
    selection.record(items)


def pytest_report_header(config):
    return [
        f"ddpx {ddpx.__version__} from {os.path.dirname(ddpx.__file__)} "
        f"(with_cuda={ddpx._C.with_cuda}, cpu_has_fast_half={ddpx._C.cpu_has_fast_half()})",
        f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}",
    ]
