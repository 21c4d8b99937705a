"""Imports the ddpx of this source tree (python/ddpx) with the compiled parts of a built one.

The API reference documents the docstrings in the tree, not those of the last ``pip install``:
a changed docstring shows up without rebuilding the C++ module. ``ddpx`` is made a package whose
search path is the tree's python/ddpx first and the built package second, so the pure-Python
modules come from the tree and ``_C`` / ``_build_info`` (absent from the tree) from the build:
the installed ddpx when there is one, else the CMake tree's ``$DDPX_BUILD_PYTHON_DIR``
(default build/python), as tests/python/conftest.py chooses. Both must be of the same tree for
the import to work, which ``scripts/test.sh`` (or ``ddpx_pip_install``) makes so.
"""
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(REPO, "python", "ddpx")


def built_ddpx_dir() -> str:
    """The folder of the built ddpx package that provides ``_C``."""
    spec = importlib.util.find_spec("ddpx")
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    build = os.environ.get("DDPX_BUILD_PYTHON_DIR", os.path.join(REPO, "build", "python"))
    path = os.path.join(build, "ddpx")
    if not os.path.isdir(path):
        raise ImportError(f"ddpx is neither installed nor built in {build}: run scripts/test.sh "
                          "(or pip-install ddpx) first")
    return path


def import_tree_ddpx():
    """Imports ``ddpx`` from the source tree (see the module docstring) and returns it."""
    if "ddpx" in sys.modules:
        raise RuntimeError("ddpx is already imported; import_tree_ddpx must come first")
    built = built_ddpx_dir()
    spec = importlib.util.spec_from_file_location(
        "ddpx", os.path.join(SOURCE, "__init__.py"), submodule_search_locations=[SOURCE, built])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddpx"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["ddpx"]
        raise
    return module
