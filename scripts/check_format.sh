#!/usr/bin/env bash
# Fails when a tracked C++/CUDA file differs from what clang-format (.clang-format: Google base,
# 100 columns) makes of it, or when ruff finds a problem in a tracked Python file (lint only: the
# Python is not reformatted). Run by .ci/run; to fix: `bash scripts/check_format.sh --fix`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
ddpx_install_deps >/dev/null
# cmake/compat mirrors a torch header for Debian's libtorch-dev: kept as torch writes it.
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' | grep -v '^cmake/compat/')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  ddpx_step "formatted ${#files[@]} files"
elif ! clang-format --dry-run --Werror "${files[@]}" 2>/tmp/ddpx_format.log; then
  grep -E "^[^ ].*: (error|warning):" /tmp/ddpx_format.log | cut -d: -f1 | sort -u | sed 's/^/  /' >&2
  echo "ddpx: the files above are not clang-formatted; run: bash scripts/check_format.sh --fix" >&2
  exit 1
fi
ddpx_step "clang-format: ${#files[@]} files clean ($(clang-format --version | grep -o '[0-9][0-9.]*' | head -1))"

# Python: ruff (rules in pyproject.toml's [tool.ruff], version pinned in
# scripts/requirements-lint.txt), from a small venv of its own, .venv-lint: this runs on a fresh
# machine before any torch venv exists. The wheel goes through the wheelhouse, as common.sh's do.
lint_venv=.venv-lint
lint_stamp="$lint_venv/.ddpx-requirements"
lint_want=$(sha256sum scripts/requirements-lint.txt | cut -d' ' -f1)
if [ ! -x "$lint_venv/bin/ruff" ] || [ "$(cat "$lint_stamp" 2>/dev/null)" != "$lint_want" ]; then
  rm -rf "$lint_venv"
  python3 -m venv "$lint_venv"
  mkdir -p "$DDPX_WHEELHOUSE"
  "$lint_venv/bin/python" -m pip download -q --no-cache-dir --no-deps -d "$DDPX_WHEELHOUSE" \
    -r scripts/requirements-lint.txt
  "$lint_venv/bin/python" -m pip install -q --no-cache-dir --no-index \
    --find-links "$DDPX_WHEELHOUSE" -r scripts/requirements-lint.txt
  echo "$lint_want" >"$lint_stamp"
fi
mapfile -t pyfiles < <(git ls-files '*.py')
if [ "${1:-}" = "--fix" ]; then
  "$lint_venv/bin/ruff" check --fix "${pyfiles[@]}" || true
fi
if ! "$lint_venv/bin/ruff" check --quiet "${pyfiles[@]}"; then
  echo "ddpx: ruff found the problems above; \`bash scripts/check_format.sh --fix\` fixes the safe" \
    "ones (imports, unused names); the rest by hand" >&2
  exit 1
fi
ddpx_step "ruff: ${#pyfiles[@]} Python files clean ($("$lint_venv/bin/ruff" --version))"
