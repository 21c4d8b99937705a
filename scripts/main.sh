#!/usr/bin/env bash
# The ddpx main job, from a fresh Debian 12 machine: installs what it needs (apt, as root or with
# sudo, skipped when present; pip torch 2.11 and the job's Python packages into .venv, from a
# wheelhouse shared with scripts/test.sh), pip-installs ddpx into the venv as a user would
# (build tree build-pip/), then trains an MLP on the `digits` data set with 2 DDP processes
# (torchrun, Gloo on CPU), once per communication hook, and prints the results table. Outputs:
# out/results.md, out/results.json, out/loss_curves.png.
#
#   ./scripts/main.sh                       pip torch 2.x (the primary target)
#   DDPX_TORCH=debian ./scripts/main.sh     Debian's torch 1.13 (.venv-debian, build-pip-debian/)
#
# Extra arguments go to examples/train_digits.py (e.g. --epochs 3, --only fp16, --lr 0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

OUT_DIR=${OUT_DIR:-out}

run_job() {
  mkdir -p "$OUT_DIR"
  rm -f "$OUT_DIR/results.md"
  # The workers import the installed ddpx: the repository root holds python/ddpx, not ddpx/,
  # so neither the working directory nor examples/ shadows it (the job logs where it came from).
  # PYTHONPATH is dropped so that a build tree on it (e.g. build/python) cannot shadow it either.
  local launcher_args=()
  if [ "$DDPX_TORCH" = debian ]; then
    # Debian's torchrun (torch 1.13) crashes on Python 3.11 at launch without these (a torch
    # bug fixed in 2.x). Each rank's stdout is then tee'd with a "[default<rank>]:" prefix.
    launcher_args=(--redirects 1 --tee 1)
  fi
  env -u PYTHONPATH "$DDPX_VENV/bin/python" -m torch.distributed.run --standalone \
    --nproc_per_node=2 "${launcher_args[@]}" examples/train_digits.py --out "$OUT_DIR/" "$@"
}

ddpx_install_deps
ddpx_setup_python
ddpx_pip_install
# From examples/, as the workers see it: `import ddpx` must find the package in the venv.
(cd examples && env -u PYTHONPATH "../$DDPX_PY" -W ignore -c '
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
