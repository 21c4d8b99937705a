#!/usr/bin/env bash
# Builds the documentation site (the user guide and the API reference generated from the code)
# into build-docs/html, with Sphinx's warnings (and Doxygen's) as errors:
#
#   bash scripts/docs.sh            # the venv of scripts/test.sh (.venv), where ddpx is installed
#   DDPX_VENV=.venv-2.11 bash scripts/docs.sh
#
# Installs what it lacks: Doxygen from apt, the pinned doc tools (docs/requirements.txt) into the
# venv through the wheelhouse (scripts/common.sh). Needs ddpx built in that venv (scripts/test.sh
# or ddpx_pip_install): autodoc imports it, with the Python modules taken from this tree
# (docs/api/ddpx_tree.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
t0=$(ddpx_now)

if ! command -v doxygen >/dev/null 2>&1; then
  ddpx_step "apt: installing doxygen"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq doxygen >/dev/null
fi
if [ ! -x "$DDPX_PY" ]; then
  echo "ddpx: no $DDPX_VENV; run scripts/test.sh first (it makes the venv and installs ddpx)" >&2
  exit 2
fi
stamp="$DDPX_VENV/.ddpx-docs-requirements"
want=$(sha256sum docs/requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  mkdir -p "$DDPX_WHEELHOUSE"
  ddpx_step "pip: doc tools into $DDPX_VENV (docs/requirements.txt)"
  "$DDPX_PY" -m pip download -q --no-cache-dir -d "$DDPX_WHEELHOUSE" -r docs/requirements.txt
  "$DDPX_PY" -m pip install -q --no-cache-dir --no-index --find-links "$DDPX_WHEELHOUSE" \
    -r docs/requirements.txt
  echo "$want" >"$stamp"
fi

out=${DDPX_DOCS_BUILD:-build-docs}
export DDPX_DOCS_BUILD="$PWD/$out"
rm -rf "$out/html" "$out/doctrees" "$out/doxygen"
ddpx_step "sphinx-build (warnings are errors)"
"$DDPX_PY" -m sphinx -q -W --keep-going -c docs/api -d "$out/doctrees" docs "$out/html"
ddpx_step "docs built in $(( $(ddpx_now) - t0 )) s: $PWD/$out/html/index.html"
