"""Builds the ddpx Python package: the pure-Python package in python/ddpx plus the native module
ddpx._C, compiled by CMake against the torch of the interpreter running this script, and the C++
library, headers and CMake package for C++ programs (ddpx/lib, ddpx/include, ddpx/lib/cmake/ddpx;
``ddpx.cmake_prefix_path`` names the folder).

    python -m venv --system-site-packages .venv && .venv/bin/pip install --no-build-isolation .

Environment: DDPX_CUDA=AUTO|ON|OFF (default AUTO), DDPX_BUILD_DIR (default build-pip),
CMAKE_BUILD_PARALLEL_LEVEL (default: number of CPUs).
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("DDPX_BUILD_DIR", os.path.join(ROOT, "build-pip"))
        cfg = [
            "cmake", "-S", ROOT, "-B", build_dir,
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DDDPX_BUILD_TESTS=OFF", "-DDDPX_BUILD_BENCHMARKS=OFF", "-DDDPX_BUILD_MAIN_JOB=OFF",
            "-DDDPX_BUILD_PYTHON=ON",
            f"-DDDPX_CUDA={os.environ.get('DDPX_CUDA', 'AUTO')}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja"):
            cfg += ["-G", "Ninja"]
        env = dict(os.environ, DDPX_PYTHON=sys.executable)
        subprocess.check_call(cfg, env=env)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "_C", "-j", jobs],
                              env=env)
        pkg_dir = os.path.join(build_dir, "python", "ddpx")
        built = [f for f in os.listdir(pkg_dir) if f.startswith("_C") and f.endswith(".so")]
        if len(built) != 1:
            raise RuntimeError(f"ddpx: expected one _C*.so in {pkg_dir}, found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(pkg_dir, built[0]), target)
        # Where the package is imported from: the wheel's folder, or for an editable install
        # (pip install -e, which puts the sources on sys.path and places only the extension
        # itself there) the source package.
        package = os.path.dirname(target)
        if getattr(self, "editable_mode", False):
            package = os.path.join(ROOT, "python", "ddpx")
        # The torch this module was built against, checked by ddpx/_loader.py at import.
        shutil.copyfile(os.path.join(pkg_dir, "_build_info.py"),
                        os.path.join(package, "_build_info.py"))
        # The C++ library, headers and CMake package inside the Python package (lib/,
        # include/, lib/cmake/ddpx), as torch ships its own: ddpx.cmake_prefix_path points
        # there, so a C++ program can find_package(ddpx) from a pip install. Its targets were
        # built above as _C's dependencies.
        for sub in ("lib", "include"):
            shutil.rmtree(os.path.join(package, sub), ignore_errors=True)
        subprocess.check_call(["cmake", "--install", build_dir, "--prefix", package], env=env,
                              stdout=subprocess.DEVNULL)


# Name, version, packages and the other metadata: pyproject.toml ([project], [tool.setuptools]).
setup(
    ext_modules=[CMakeExtension("ddpx._C")],
    cmdclass={"build_ext": CMakeBuild},
)
