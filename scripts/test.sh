#!/usr/bin/env bash
# The whole ddpx test suite on a fresh machine: installs what it needs (apt), builds, runs the
# GoogleTest suites (ctest, including the find_package(ddpx) consumer example), pip-installs the
# package into .venv as a user would, and runs the pytest suite against that install.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

ddpx_install_deps
ddpx_cmake_build build -DDDPX_BUILD_TESTS=ON -DDDPX_BUILD_BENCHMARKS=ON
(cd build && ctest --output-on-failure)
ddpx_pip_install
# Run from tests/ so that `import ddpx` resolves to the installed package, not the sources.
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider "$@"
