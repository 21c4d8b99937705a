"""The C++ package inside the pip-installed ddpx: ``ddpx.cmake_prefix_path`` holds the library,
headers and CMake package, and a C++ program configured with only that folder on
CMAKE_PREFIX_PATH finds ddpx (and the torch ddpx was built against), builds and trains a step of
``ddpx::ddp::DistributedDataParallel`` with a ddpx hook on a one-process Gloo group.

Skipped when the ddpx under test is a build tree (PYTHONPATH=build/python), which has no
installed C++ package; scripts/test.sh tests the pip-installed package.
"""
import os
import shutil
import subprocess
import textwrap

import pytest

import ddpx
from dist_utils import build_cmake_project, free_port

PREFIX = ddpx.cmake_prefix_path
CONFIG = os.path.join(PREFIX, "lib", "cmake", "ddpx", "ddpxConfig.cmake")
installed = pytest.mark.skipif(
    not os.path.exists(CONFIG),
    reason=f"ddpx at {PREFIX} is not a pip-installed package (no lib/cmake/ddpx)")

PROGRAM = textwrap.dedent(r"""
    #include <ddpx/ddp.h>
    #include <ddpx/hooks.h>
    #include <torch/nn/modules/linear.h>
    #include <cstdio>
    #include <cstdlib>

    int main(int argc, char** argv) {
      auto pg = ddpx::ddp::init_process_group("gloo", 0, 1, "127.0.0.1", std::atoi(argv[1]));
      torch::nn::Linear net(4, 2);
      ddpx::ddp::DistributedDataParallel ddp(net, pg);
      ddp.register_comm_hook(ddpx::hooks::fp16_compress_hook(pg));
      ddp.forward(at::ones({3, 4})).sum().backward();
      // One rank: the mean is the local gradient, through fp16 (exact for these values: 3).
      const bool ok = at::equal(net->weight.grad(), at::full({2, 4}, 3.0));
      std::printf("%s\n", ok ? "ddpx C++ package: ok" : "ddpx C++ package: wrong gradient");
      return ok ? 0 : 1;
    }
""")


@installed
def test_package_layout():
    assert PREFIX == os.path.dirname(os.path.abspath(ddpx.__file__))
    for rel in ("include/ddpx/ddp.h", "include/ddpx/hooks.h", "include/ddpx/optim/zero.h",
                "lib/cmake/ddpx/ddpxTargets.cmake", "lib/cmake/ddpx/ddpxConfigVersion.cmake"):
        assert os.path.exists(os.path.join(PREFIX, rel)), rel
    libs = os.listdir(os.path.join(PREFIX, "lib"))
    assert "libddpx.a" in libs and "libddpx_kernels.a" in libs, libs
    # The version CMake checks is the package's.
    with open(os.path.join(PREFIX, "lib", "cmake", "ddpx", "ddpxConfigVersion.cmake")) as f:
        assert f'"{ddpx.__version__}"' in f.read()


@installed
@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
def test_find_package_from_cmake_prefix_path(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(textwrap.dedent("""
        cmake_minimum_required(VERSION 3.18)
        project(uses_ddpx LANGUAGES CXX)
        set(CMAKE_CXX_STANDARD 17)
        find_package(ddpx REQUIRED)
        add_executable(uses_ddpx main.cpp)
        target_link_libraries(uses_ddpx PRIVATE ddpx::ddpx)
    """))
    (src / "main.cpp").write_text(PROGRAM)
    build = tmp_path / "build"
    build_cmake_project(src, build, PREFIX)
    done = subprocess.run([str(build / "uses_ddpx"), str(free_port())], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ddpx C++ package: ok" in done.stdout
