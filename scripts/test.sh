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
# DDPX_TEST_CPP=0 skips the CMake tree and ctest (the C++ library and its GoogleTests do not
# depend on the Python version: CI runs them once per torch, and pytest still builds a C++
# consumer against the pip install). DDPX_PYTEST_PATHS (default tests/python) picks test files;
# DDPX_PYTEST_WORKERS (default 3) is pytest-xdist's -n: on 2 cores, 3 workers finish the suite
# about a sixth sooner than 2, the fault-injection cases being mostly a wait for a timeout.
# DDPX_MULTINODE=1 runs tests/multinode (jobs across network namespaces, scripts/multinode.py;
# skipped with the reason where the machine allows none) after the suite; its default is
# 1 on the newest torch with python3 (the README's command), 0 on the other lines.
# DDPX_MULTINODE_EXIT_RUNS (default 20) is how many runs in a row its clean-exit test makes.
# Extra arguments go to pytest (e.g. -k powersgd, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

T0=$(ddpx_now)
ddpx_install_deps
ddpx_setup_python
if [ "${DDPX_TEST_CPP:-1}" != 0 ]; then
  ddpx_cmake_build -DDDPX_BUILD_TESTS=ON -DDDPX_BUILD_BENCHMARKS=ON
  t0=$(ddpx_now)
  (cd "$DDPX_BUILD" && ctest --output-on-failure)
  ddpx_step "ctest ($DDPX_BUILD) in $(( $(ddpx_now) - t0 )) s"
fi
ddpx_pip_install
paths=${DDPX_PYTEST_PATHS:-tests/python}
multinode_default=0
[ "$DDPX_TORCH" = newest ] && [ -z "$DDPX_PYTHON_VERSION" ] && multinode_default=1
multinode=0
if [ -z "${DDPX_PYTEST_PATHS:-}" ] && [ "${DDPX_MULTINODE:-$multinode_default}" = 1 ]; then
  multinode=1
  # The C++ job of the multi-node tests: the main job's C++ program, built in the CMake tree above.
  if [ "${DDPX_TEST_CPP:-1}" != 0 ]; then
    export DDPX_CPP_TRAIN_DIGITS="$PWD/$DDPX_BUILD/benchmarks/cpp/train_digits"
  fi
fi
# pytest runs from the repository root, whose python/ddpx is not importable as ddpx: the tests
# import the installed package (conftest.py prints which).
t0=$(ddpx_now)
# shellcheck disable=SC2086
"$DDPX_PY" -m pytest $paths -q -p no:cacheprovider \
  -n "${DDPX_PYTEST_WORKERS:-3}" "$@"
ddpx_step "pytest in $(( $(ddpx_now) - t0 )) s"
if [ "$multinode" = 1 ]; then
  # After the suite, not beside it, with DDPX_MULTINODE_WORKERS (default 1) jobs at a time: the
  # fault tests time how soon each rank reports a lost peer, and the step-time figures of the
  # jobs mean something only on cores that the suite's workers do not share.
  t0=$(ddpx_now)
  "$DDPX_PY" -m pytest tests/multinode -q -p no:cacheprovider \
    -n "${DDPX_MULTINODE_WORKERS:-1}" "$@"
  ddpx_step "pytest tests/multinode in $(( $(ddpx_now) - t0 )) s"
fi
ddpx_step "test suite ($(ddpx_describe_python)) done in $(( $(ddpx_now) - T0 )) s"
