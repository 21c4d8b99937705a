"""The build's refusal of a ddpx._C that carries its own libstdc++ (cmake/DdpxLibstdcxx.cmake).

The module must use the shared libstdc++ that Python and torch have loaded. Checked without
building ddpx: configuring the project with ``-static-libstdc++`` in the module's link flags
fails in seconds, before torch is looked for, with the reason and the fix; the check the build
runs on the linked module refuses (and removes) a shared library with a static copy inside, and
passes one that needs libstdc++.so; gpu_check.sh's compiler probe says the same of a compiler.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUARD = ROOT / "cmake" / "DdpxLibstdcxx.cmake"
CXX = shutil.which(os.environ.get("CXX", "") or "c++") or shutil.which("g++")

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an ELF check (Linux)"),
    pytest.mark.skipif(shutil.which("cmake") is None or CXX is None, reason="needs cmake and c++"),
]


def words(text):
    """CMake wraps its error messages: compare them word by word."""
    return " ".join(text.split())


def cmake_script(**defs):
    args = ["cmake"] + [f"-D{k}={v}" for k, v in defs.items()] + ["-P", str(GUARD)]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def shared_library(tmp_path, name, *flags):
    src = tmp_path / "lib.cpp"
    src.write_text("#include <sstream>\n#include <string>\n"
                   "std::string f(long v) { std::ostringstream os; os << v; return os.str(); }\n")
    out = tmp_path / name
    subprocess.run([CXX, "-shared", "-fPIC", *flags, "-o", str(out), str(src)], check=True,
                   timeout=120)
    return out


@pytest.mark.parametrize("how", ["CMAKE_MODULE_LINKER_FLAGS", "LDFLAGS"])
def test_configure_refuses_a_static_libstdcxx(tmp_path, how):
    env = dict(os.environ)
    args = ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), f"-DCMAKE_CXX_COMPILER={CXX}"]
    if how == "LDFLAGS":
        env["LDFLAGS"] = "-static-libstdc++"  # CMake starts its link flags from it
    else:
        args.append(f"-D{how}=-static-libstdc++")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    out = words(done.stdout + done.stderr)
    assert done.returncode != 0, out
    assert "links libstdc++ statically into shared libraries" in out, out
    assert "Drop -static-libstdc++" in out, out
    # Refused before torch: the probe comes first.
    assert "Python with torch" not in out, out


def test_module_check_refuses_and_removes_a_static_copy(tmp_path):
    lib = shared_library(tmp_path, "static.so", "-static-libstdc++")
    done = cmake_script(DDPX_CHECK_MODULE=lib)
    assert done.returncode != 0
    assert "carries a static copy of libstdc++" in words(done.stderr), done.stderr
    assert not lib.exists()  # so that the next build links it again


def test_module_check_passes_a_shared_libstdcxx(tmp_path):
    lib = shared_library(tmp_path, "shared.so")
    done = cmake_script(DDPX_CHECK_MODULE=lib)
    assert done.returncode == 0, done.stderr
    assert lib.exists()


def test_compiler_probe():
    assert cmake_script(DDPX_PROBE_CXX=CXX).returncode == 0
    done = cmake_script(DDPX_PROBE_CXX=CXX, DDPX_PROBE_FLAGS="-static-libstdc++")
    assert done.returncode != 0
    assert "links libstdc++ statically" in words(done.stderr), done.stderr
