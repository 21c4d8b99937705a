#!/usr/bin/env bash
# Fails when a tracked C++/CUDA file differs from what clang-format (.clang-format: Google base,
# 100 columns) makes of it. Run by .ci/run; to fix: `bash scripts/check_format.sh --fix`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
ddpx_install_deps >/dev/null
# cmake/compat mirrors a torch header for Debian's libtorch-dev: kept as torch writes it.
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' | grep -v '^cmake/compat/')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  ddpx_step "formatted ${#files[@]} files"
  exit 0
fi
if ! clang-format --dry-run --Werror "${files[@]}" 2>/tmp/ddpx_format.log; then
  grep -E "^[^ ].*: (error|warning):" /tmp/ddpx_format.log | cut -d: -f1 | sort -u | sed 's/^/  /' >&2
  echo "ddpx: the files above are not clang-formatted; run: bash scripts/check_format.sh --fix" >&2
  exit 1
fi
ddpx_step "clang-format: ${#files[@]} files clean ($(clang-format --version | grep -o '[0-9][0-9.]*' | head -1))"
