#!/usr/bin/env bash
# The ddpx main job, from a fresh Debian 12 machine: installs what it needs (apt, as root or with
# sudo; skipped when everything is installed), pip-installs ddpx into .venv as a user would
# (build tree build-pip/; the CMake tree build/ of scripts/test.sh is left alone), then trains an
# MLP on the `digits` data set with 2 DDP processes (torchrun, Gloo on CPU), once per
# communication hook, and prints the results table. Outputs: out/results.md, out/results.json,
# out/loss_curves.png.
#
# Extra arguments go to examples/train_digits.py (e.g. --epochs 3, --only fp16, --lr 0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh  # DDPX_APT_PACKAGES, ddpx_install_deps, ddpx_pip_install

OUT_DIR=${OUT_DIR:-out}

run_job() {
  mkdir -p "$OUT_DIR"
  rm -f "$OUT_DIR/results.md"
  # The workers import the installed ddpx: the repository root holds python/ddpx, not ddpx/,
  # so neither the working directory nor examples/ shadows it (the job logs where it came from).
  # `--redirects 1 --tee 1`: Debian's torchrun (torch 1.13) crashes on Python 3.11 without it.
  # Each rank's stdout is then tee'd with a "[default<rank>]:" prefix; the table is printed
  # again, unprefixed, from out/results.md below.
  # PYTHONPATH is dropped so that a build tree on it (e.g. build/python) cannot shadow it either.
  env -u PYTHONPATH .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \
    --redirects 1 --tee 1 examples/train_digits.py --out "$OUT_DIR/" "$@"
}

ddpx_install_deps
ddpx_pip_install
# From examples/, as the workers see it: `import ddpx` must find the package in .venv.
(cd examples && env -u PYTHONPATH ../.venv/bin/python -c '
import os, sys, ddpx
where, venv = os.path.realpath(ddpx.__file__), os.path.realpath(sys.prefix)
if not where.startswith(venv + os.sep):
    sys.exit(f"ddpx: import ddpx resolves to {where}, not to the package installed in {venv}")
print(f"ddpx: using the installed package {os.path.dirname(where)}")')
start=$(date +%s)
run_job "$@"
echo
echo "==================== $OUT_DIR/results.md ===================="
cat "$OUT_DIR/results.md"
echo "(training job: $(( $(date +%s) - start )) s; loss curves: $OUT_DIR/loss_curves.png," \
  "all numbers: $OUT_DIR/results.json)"
