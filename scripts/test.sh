#!/usr/bin/env bash
# The whole ddpx test suite on a fresh machine: installs what it needs (apt; the newest pip torch
# into .venv), builds, runs the GoogleTest suites (ctest, including the find_package(ddpx) consumer
# example), pip-installs the package into the venv as a user would, and runs the pytest suite
# against that install.
#
#   ./scripts/test.sh                     the newest pip torch (the primary target)
#   DDPX_TORCH=2.11 ./scripts/test.sh     pip torch 2.11, the GPU machine's (own venv and trees)
#   DDPX_TORCH=debian ./scripts/test.sh   Debian's torch 1.13 (own venv and build trees)
#   DDPX_PYTHON_VERSION=3.13 ./scripts/test.sh   a pip line on another CPython (scripts/common.sh)
#
# Extra arguments go to pytest (e.g. -k powersgd, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

T0=$(ddpx_now)
ddpx_install_deps
ddpx_setup_python
ddpx_cmake_build -DDDPX_BUILD_TESTS=ON -DDDPX_BUILD_BENCHMARKS=ON
(cd "$DDPX_BUILD" && ctest --output-on-failure)
ddpx_pip_install
# pytest runs from the repository root, whose python/ddpx is not importable as ddpx: the tests
# import the installed package (conftest.py prints which).
"$DDPX_PY" -m pytest tests/python -q -p no:cacheprovider -n 2 "$@"
ddpx_step "test suite ($DDPX_TORCH torch) done in $(( $(ddpx_now) - T0 )) s"
