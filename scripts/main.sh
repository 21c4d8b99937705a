#!/usr/bin/env bash
# The ddpx main job, from a fresh Debian 12 machine: installs what it needs (apt, as root or with
# sudo; skipped when everything is installed), builds ddpx, then trains an MLP on the `digits`
# data set with 2 DDP processes (torchrun, Gloo on CPU), once per communication hook, and prints
# the results table. Outputs: out/results.md, out/results.json, out/loss_curves.png.
#
# Extra arguments go to examples/train_digits.py (e.g. --epochs 3, --only fp16).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh  # DDPX_APT_PACKAGES, ddpx_install_deps, ddpx_cmake_build, DDPX_SYS_PYTHON

OUT_DIR=${OUT_DIR:-out}

# Builds ddpx and sets DDPX_PYTHONPATH to where `import ddpx` finds it.
build_ddpx() {
  ddpx_cmake_build build -DDDPX_BUILD_TESTS=OFF -DDDPX_BUILD_BENCHMARKS=OFF
  DDPX_PYTHONPATH=$PWD/build/python
}

run_job() {
  mkdir -p "$OUT_DIR"
  rm -f "$OUT_DIR/results.md"
  # `--redirects 1 --tee 1`: Debian's torchrun (torch 1.13) crashes on Python 3.11 without it.
  # Each rank's stdout is then tee'd with a "[default<rank>]:" prefix; the table is printed
  # again, unprefixed, from out/results.md below.
  PYTHONPATH="$DDPX_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}" \
    "$DDPX_SYS_PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 \
    --redirects 1 --tee 1 examples/train_digits.py --out "$OUT_DIR/" "$@"
}

ddpx_install_deps
build_ddpx
start=$(date +%s)
run_job "$@"
echo
echo "==================== $OUT_DIR/results.md ===================="
cat "$OUT_DIR/results.md"
echo "(training job: $(( $(date +%s) - start )) s; loss curves: $OUT_DIR/loss_curves.png," \
  "all numbers: $OUT_DIR/results.json)"
