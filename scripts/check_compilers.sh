#!/usr/bin/env bash
# ddpx built with the compilers users have besides Debian 12's default g++ 12: g++ 11 and clang 15
# (Ubuntu 22.04's), from Debian's packages, installed here. For each, against the newest pip
# torch (the venv scripts/test.sh makes): the library (torch-free kernels, their CUDA twins, hooks,
# optimizers) and the Python module, ddpx's own code with warnings as errors; then the module,
# imported from that tree, runs a short pytest selection. CI runs it as a line of .ci/run.
#
#   bash scripts/check_compilers.sh                        g++-11 and clang++-15
#   DDPX_COMPILERS="clang++-15" bash scripts/check_compilers.sh
#
# What differs between compilers is what they accept and which vector paths they take (GCC 12
# and clang have __builtin_shufflevector, GCC 11 runs the plain loops; GCC clones kernels for
# AVX2 with target_clones, clang does not), so the tests are those that check the CPU kernels'
# results (casts, Gram-Schmidt, the elementwise optimizers) and PowerSGD's first steps against
# torch's (the hooks end to end, and PowerSGDState's iostreams, where a module with its own
# libstdc++ crashed). No GoogleTests: their torch-including files would double the time.
#
# Time (docs/torch-versions.md has the figures): the build of each compiler is cold on a fresh
# machine (no compiler shares objects with another in ccache), and the CUDA kernels are built
# for one architecture only: their device code is the same for every host compiler.
# Trees: build-cxx-<compiler>/ (DDPX_COMPILERS_ARCH: the CUDA architecture, default 90).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

T0=$(ddpx_now)
read -r -a compilers <<<"${DDPX_COMPILERS:-g++-11 clang++-15}"
# Debian's package of each compiler: g++-N is its own, clang++-N comes with clang-N.
packages=()
for cxx in "${compilers[@]}"; do
  case "$cxx" in
    g++-*) packages+=("$cxx") ;;
    clang++-*) packages+=("clang-${cxx#clang++-}") ;;
    *) echo "check_compilers: no Debian package known for '$cxx'" >&2; exit 2 ;;
  esac
done
ddpx_install_deps
ddpx_apt_install "${packages[@]}"
ddpx_setup_python

TESTS="tests/python/test_kernels.py tests/python/test_elementwise_optim.py
  tests/python/test_powersgd.py::test_first_steps_match_torch"
times=()
for cxx in "${compilers[@]}"; do
  t0=$(ddpx_now)
  DDPX_BUILD="build-cxx-$cxx"
  # CMAKE_COMPILE_WARNING_AS_ERROR: -Werror on ddpx's targets only (torch's headers come in as
  # system headers); nvcc's host compiler is the same compiler (cmake/DdpxTorch.cmake).
  ddpx_cmake_build -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_COMPILE_WARNING_AS_ERROR=ON \
    -DDDPX_BUILD_TESTS=OFF -DDDPX_BUILD_BENCHMARKS=OFF -DDDPX_BUILD_MAIN_JOB=OFF \
    -DDDPX_CUDA_ARCHS="${DDPX_COMPILERS_ARCH:-90}"
  t1=$(ddpx_now)
  # The tree's module, not the venv's installed ddpx (conftest.py takes whichever imports first).
  PYTHONPATH="$PWD/$DDPX_BUILD/python" "$DDPX_PY" -c "
import sys, ddpx
sys.exit(0 if ddpx.__file__.startswith('$PWD/$DDPX_BUILD/') else 'imported ' + ddpx.__file__)"
  # shellcheck disable=SC2086
  PYTHONPATH="$PWD/$DDPX_BUILD/python" "$DDPX_PY" -m pytest $TESTS -q -p no:cacheprovider
  times+=("$(printf '%-12s build %4d s, tests %3d s' "$cxx" $((t1 - t0)) $(($(ddpx_now) - t1)))")
done
ddpx_step "compilers checked in $(( $(ddpx_now) - T0 )) s:"
printf '  %s\n' "${times[@]}"
