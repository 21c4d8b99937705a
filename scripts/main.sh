#!/usr/bin/env bash
# The ddpx main job, from a fresh Debian 12 machine: installs what it needs (apt, as root or with
# sudo, skipped when present; the newest pip torch and the job's Python packages into .venv, from a
# wheelhouse shared with scripts/test.sh), pip-installs ddpx into the venv as a user would
# (build tree build-pip/), then trains an MLP on the `digits` data set with 2 DDP processes
# (torchrun, Gloo on CPU), once per communication hook, and prints the results table. Then the
# same training as a C++ program: benchmarks/cpp/train_digits.cpp, built with CMake against the
# pip-installed ddpx (find_package(ddpx) through ddpx.cmake_prefix_path, build tree
# build-cpp-job/), launched by torchrun --no-python on the data and initial weights the Python job
# exports, each row checked bit for bit against the Python row it repeats. Last, the model-parallel
# job (benchmarks/train_digits_rpc.py, 3 RPC workers): the same training with the MLP split over two
# owners and stepped by ddpx's and torch's DistributedOptimizer. Outputs: out/results.md,
# out/results.json, out/loss_curves.png, out/results_cpp.md, out/results_rpc.md.
#
#   ./scripts/main.sh                       the newest pip torch (the primary target)
#   DDPX_TORCH=2.11 ./scripts/main.sh       pip torch 2.11 (.venv-2.11, build-pip-2.11/)
#   DDPX_TORCH=debian ./scripts/main.sh     Debian's torch 1.13 (.venv-debian, build-pip-debian/)
# DDPX_PYTHON_VERSION=3.12 picks the interpreter of a pip line (scripts/common.sh).
#
# Extra arguments go to benchmarks/train_digits.py (e.g. --epochs 3, --only fp16, --lr 0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

OUT_DIR=${OUT_DIR:-out}

torchrun_args() {
  if [ "$DDPX_TORCH" = debian ]; then
    # Debian's torchrun (torch 1.13) crashes on Python 3.11 at launch without these (a torch
    # bug fixed in 2.x). Each rank's stdout is then tee'd with a "[default<rank>]:" prefix.
    echo --redirects 1 --tee 1
  fi
}

run_job() {
  mkdir -p "$OUT_DIR"
  rm -f "$OUT_DIR/results.md"
  # The workers import the installed ddpx: the repository root holds python/ddpx, not ddpx/,
  # so neither the working directory nor benchmarks/ shadows it (the job logs where it came from).
  # PYTHONPATH is dropped so that a build tree on it (e.g. build/python) cannot shadow it either.
  # shellcheck disable=SC2046
  env -u PYTHONPATH "$DDPX_VENV/bin/python" -m torch.distributed.run --standalone \
    --nproc_per_node=2 $(torchrun_args) benchmarks/train_digits.py --out "$OUT_DIR/" \
    --save-final-weights "$OUT_DIR/final_weights.pt" "$@"
}

# The C++ job: built against the installed package as a C++ user builds it, on the Python job's
# exported data and settings (the same extra arguments), compared with its final weights.
run_cpp_job() {
  local prefix build="build-cpp-job$_ddpx_line" no_python=--no-python
  prefix=$(env -u PYTHONPATH "$DDPX_PY" -c "import ddpx; print(ddpx.cmake_prefix_path)")
  cmake -S benchmarks/cpp -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" > "$OUT_DIR/cpp_build.log"
  cmake --build "$build" --target train_digits -j "$(nproc)" >> "$OUT_DIR/cpp_build.log"
  env -u PYTHONPATH "$DDPX_PY" benchmarks/train_digits.py --export-cpp-data \
    "$OUT_DIR/digits_cpp.pt" "$@"
  [ "$DDPX_TORCH" = debian ] && no_python=--no_python
  # shellcheck disable=SC2046
  "$DDPX_PY" -m torch.distributed.run --standalone --nproc_per_node=2 $(torchrun_args) \
    "$no_python" "$build/train_digits" --data "$OUT_DIR/digits_cpp.pt" --out "$OUT_DIR/" \
    --compare "$OUT_DIR/final_weights.pt"
}

ddpx_install_deps
ddpx_setup_python
ddpx_pip_install
# From benchmarks/ (the job's directory), as the workers see it: `import ddpx` must find the package in the venv.
(cd benchmarks && env -u PYTHONPATH "../$DDPX_PY" -W ignore -c '
import os, sys, ddpx
where, venv = os.path.realpath(ddpx.__file__), os.path.realpath(sys.prefix)
if not where.startswith(venv + os.sep):
    sys.exit(f"ddpx: import ddpx resolves to {where}, not to the package installed in {venv}")
print(f"ddpx: using the installed package {os.path.dirname(where)}")')
start=$(ddpx_now)
run_job "$@"
echo
echo "==================== $OUT_DIR/results.md ===================="
cat "$OUT_DIR/results.md"
echo "(training job: $(( $(ddpx_now) - start )) s; loss curves: $OUT_DIR/loss_curves.png," \
  "all numbers: $OUT_DIR/results.json)"
start=$(ddpx_now)
run_cpp_job "$@" > "$OUT_DIR/cpp_job.log" 2>&1 || { cat "$OUT_DIR/cpp_job.log"; exit 1; }
echo
echo "==================== $OUT_DIR/results_cpp.md (the C++ program) ===================="
cat "$OUT_DIR/results_cpp.md"
echo "(C++ job, build included: $(( $(ddpx_now) - start )) s; log: $OUT_DIR/cpp_job.log)"
start=$(ddpx_now)
# shellcheck disable=SC2046
env -u PYTHONPATH "$DDPX_PY" -m torch.distributed.run --standalone --nproc_per_node=3 \
  $(torchrun_args) benchmarks/train_digits_rpc.py --out "$OUT_DIR/" \
  --compare "$OUT_DIR/final_weights.pt" > "$OUT_DIR/rpc_job.log" 2>&1 \
  || { cat "$OUT_DIR/rpc_job.log"; exit 1; }
echo
echo "==================== $OUT_DIR/results_rpc.md (model parallel, RPC) ===================="
cat "$OUT_DIR/results_rpc.md"
echo "(RPC job: $(( $(ddpx_now) - start )) s; log: $OUT_DIR/rpc_job.log)"
