"""ddpx built for another torch: `import ddpx` raises an ImportError naming both torch versions
and how to rebuild, before the compiled module is loaded (which would fail with an undefined
symbol, or load and misbehave). The package is copied and its _build_info.py altered; the
real cross-torch import (a 1.13 build under torch 2.11 and back) is scripts/check_torch_mismatch.sh,
run by CI once both builds exist.

Also import time: DDPX_STACKS_ON_ABORT turns on the dump of every thread's stack on an abort."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ddpx

PKG = os.path.dirname(os.path.abspath(ddpx.__file__))


def _import_with_build_info(tmp_path, text: str) -> subprocess.CompletedProcess:
    dst = tmp_path / "ddpx"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "_build_info.py").write_text(text)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, "-c", "import ddpx"], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120)


def test_build_info_is_installed_and_matches():
    from ddpx import _build_info
    built = _build_info.TORCH_VERSION.split(".")[:2]
    assert built == torch.__version__.split("+")[0].split(".")[:2]
    assert (_build_info.TORCH_CUDA or None) == torch.version.cuda
    assert _build_info.DDPX_WITH_CUDA == ddpx._C.with_cuda


def test_other_torch_version_names_both(tmp_path):
    other = "1.12.1" if not torch.__version__.startswith("1.12") else "2.11.0"
    cuda = torch.version.cuda or ""
    res = _import_with_build_info(
        tmp_path, f'TORCH_VERSION = "{other}"\nTORCH_CUDA = "{cuda}"\nDDPX_WITH_CUDA = False\n')
    assert res.returncode != 0
    assert "ImportError" in res.stderr
    assert f"built against torch {other}" in res.stderr
    assert f"torch {torch.__version__} is installed" in res.stderr
    assert "pip install --no-build-isolation ." in res.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_cuda_build_under_cpu_torch_is_refused(tmp_path):
    version = torch.__version__.split("+")[0]
    res = _import_with_build_info(
        tmp_path, f'TORCH_VERSION = "{version}"\nTORCH_CUDA = "13.0"\nDDPX_WITH_CUDA = True\n')
    assert res.returncode != 0
    assert "CUDA build of torch" in res.stderr and "has no CUDA" in res.stderr


@pytest.mark.parametrize("knob", ["1", "0", None])
def test_stacks_on_abort_knob(knob):
    """With DDPX_STACKS_ON_ABORT=1 an abort prints each thread's C++ stack, the aborting one with
    its abort frame; unset or 0, only the abort itself."""
    env = {k: v for k, v in os.environ.items() if k != "DDPX_STACKS_ON_ABORT"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(PKG),
                                                    env.get("PYTHONPATH")) if p)
    if knob is not None:
        env["DDPX_STACKS_ON_ABORT"] = knob
    code = ("import threading, time, os, ddpx\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "os.abort()\n")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    dumps = res.stderr.split("SIGABRT(6), PID")[1:]
    if knob == "1":
        assert len(dumps) >= 2, res.stderr[-3000:]  # the main thread and the sleeper at least
        assert any("abort" in b for b in dumps), res.stderr[-3000:]
    else:
        assert dumps == [], res.stderr[-3000:]
