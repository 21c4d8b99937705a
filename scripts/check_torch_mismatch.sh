#!/usr/bin/env bash
# The real thing behind tests/python/test_loader.py: import the ddpx built for one torch line
# under another line's torch (the venvs and build trees scripts/test.sh makes; the 2.11 line's
# module is its pip build, CI builds no CMake tree there), and require an
# ImportError that names both versions and says how to rebuild. Pairs of the same Python
# version: the newest torch and Debian's 1.13 (Python 3.11) both ways, the newest and 2.11
# (Python 3.12) both ways. Run by .ci/run after the lines; skips a pair whose build or venv is
# missing (the newest torch on 3.12 is made by `DDPX_CI_FULL=1 bash .ci/run` only).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
status=0
check() {  # check VENV_PYTHON BUILD_PYTHON_DIR
  local py=$1 dir=$2
  if [ ! -x "$py" ] || [ ! -f "$dir/ddpx/_build_info.py" ]; then
    echo "check_torch_mismatch: skipped $py with $dir (not built)"
    return 0
  fi
  local out
  if out=$(cd /tmp && env PYTHONPATH="$ROOT/$dir" "$ROOT/$py" -W ignore -c 'import ddpx' 2>&1); then
    echo "check_torch_mismatch: FAILED: $dir imported under $py without an error"
    status=1
    return 0
  fi
  local built installed
  built=$(sed -n 's/^TORCH_VERSION = "\(.*\)"/\1/p' "$dir/ddpx/_build_info.py")
  installed=$("$py" -W ignore -c 'import torch; print(torch.__version__)')
  if grep -q "ImportError: ddpx was built against torch $built but torch $installed is installed" <<<"$out" \
     && grep -q "pip install --no-build-isolation ." <<<"$out"; then
    echo "check_torch_mismatch: ok: $dir (torch $built) under torch $installed:"
    grep "^ImportError" <<<"$out" | sed 's/^/    /'
  else
    echo "check_torch_mismatch: FAILED: unexpected error for $dir under $py:"
    echo "$out" | tail -5
    status=1
  fi
}
check .venv/bin/python build-debian/python
check .venv-debian/bin/python build/python
check .venv-py3.12/bin/python build-pip-2.11-py3.12/python
check .venv-2.11-py3.12/bin/python build-pip-py3.12/python
exit $status
