# Shared by scripts/test.sh, scripts/main.sh and .ci/run: installing dependencies and building
# ddpx against one of the torch lines it supports. Source it from the repository root.
#
#   DDPX_TORCH=newest  (default) the newest torch on PyPI, pinned in
#                      scripts/requirements-torch-newest.txt, in its own venv .venv (no system
#                      site packages); CMake tree build/, pip build tree build-pip/.
#   DDPX_TORCH=2.11    pip's torch 2.11 (the GPU machine's), scripts/requirements-torch-2.11.txt:
#                      .venv-2.11, build-2.11/, build-pip-2.11/.
#   DDPX_TORCH=debian  Debian's torch 1.13 (apt: python3-torch, libtorch-dev), in .venv-debian
#                      (--system-site-packages, to see it); trees build-debian/, build-pip-debian/.
#
#   DDPX_PYTHON_VERSION=3.12 (pip lines only) makes the venv from that CPython (python3.12 on
#                      PATH, or pyenv's); its trees get a -py3.12 suffix (.venv-py3.12,
#                      build-2.11-py3.12/, ...). Default: python3 on PATH, no suffix.
#
# Wheels are downloaded once into a wheelhouse outside the repository (DDPX_WHEELHOUSE, default
# ~/.cache/ddpx/wheels) and installed from it, so a second command, a fresh clone, another line
# or a rebuilt venv on the same machine downloads only what it lacks. A venv whose requirements
# and interpreter are unchanged since it was made is reused as it is. ccache (installed below)
# keeps its objects in one cache for every line; CCACHE_BASEDIR makes paths in this checkout
# relative, so the torch-free kernels, compiled with the same flags on every line, are compiled
# once and taken from the cache by the other lines and by fresh clones.

DDPX_TORCH=${DDPX_TORCH:-newest}
DDPX_PYTHON_VERSION=${DDPX_PYTHON_VERSION:-}
case "$DDPX_TORCH" in
  newest) _ddpx_line="" ;;
  2.11) _ddpx_line="-2.11" ;;
  debian)
    _ddpx_line="-debian"
    if [ -n "$DDPX_PYTHON_VERSION" ]; then
      echo "ddpx: DDPX_PYTHON_VERSION applies to the pip torch lines; Debian's torch is" \
        "/usr/bin/python3's" >&2
      exit 2
    fi
    ;;
  *)
    echo "ddpx: DDPX_TORCH must be 'newest', '2.11' or 'debian', got '$DDPX_TORCH'" >&2
    exit 2
    ;;
esac
[ -n "$DDPX_PYTHON_VERSION" ] && _ddpx_line="$_ddpx_line-py$DDPX_PYTHON_VERSION"
DDPX_VENV=${DDPX_VENV:-.venv$_ddpx_line}
DDPX_BUILD=${DDPX_BUILD:-build$_ddpx_line}
DDPX_PIP_BUILD=${DDPX_PIP_BUILD:-build-pip$_ddpx_line}
DDPX_PY="$DDPX_VENV/bin/python"
DDPX_REQUIREMENTS=scripts/requirements-torch-$DDPX_TORCH.txt
DDPX_WHEELHOUSE=${DDPX_WHEELHOUSE:-$HOME/.cache/ddpx/wheels}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

# Build tools, the C++ test dependencies (GoogleTest, Google Benchmark, Gloo's headers for the
# C++ tests that build ProcessGroupGloo directly), python3-venv, and iproute2 (ip, tc) for the
# multi-node harness (scripts/multinode.py).
DDPX_APT_PACKAGES=(
  cmake ninja-build g++ ccache git clang-format
  libgloo-dev libgtest-dev libgmock-dev libbenchmark-dev
  python3-venv python3-pip iproute2
)
# Debian's torch 1.13 line, and the Python packages its tests and main job use.
DDPX_APT_PACKAGES_DEBIAN=(
  libtorch-dev python3-torch pybind11-dev python3-pybind11
  python3-setuptools python3-wheel
  python3-numpy python3-pytest python3-pytest-xdist python3-sklearn python3-matplotlib
)

# Seconds since the epoch, for the step timings the scripts print.
ddpx_now() { date +%s; }
ddpx_step() { echo "ddpx: [$(date +%H:%M:%S)] $*"; }

ddpx_install_deps() {
  local wanted=("${DDPX_APT_PACKAGES[@]}")
  [ "$DDPX_TORCH" = debian ] && wanted+=("${DDPX_APT_PACKAGES_DEBIAN[@]}")
  ddpx_apt_install "${wanted[@]}"
}

# Installs those of the Debian packages named that are not installed yet (after an apt-get update).
ddpx_apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    ddpx_step "all apt packages present"
    return 0
  fi
  ddpx_step "apt: installing ${missing[*]}"
  local sudo="" t0
  t0=$(ddpx_now)
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  ddpx_step "apt: done in $(( $(ddpx_now) - t0 )) s"
}

# The interpreter to make a pip-torch venv from: $DDPX_BASE_PYTHON; else, with
# DDPX_PYTHON_VERSION=X.Y, pythonX.Y on PATH or pyenv's newest X.Y; else python3 on PATH, else
# Debian's (python3-venv is installed above). It must have venv and ensurepip.
ddpx_base_python() {
  local cands=("${DDPX_BASE_PYTHON:-}") cand
  if [ -n "$DDPX_PYTHON_VERSION" ]; then
    cands+=("python$DDPX_PYTHON_VERSION")
    for cand in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$DDPX_PYTHON_VERSION".*/bin 2>/dev/null \
        | sort -V -r); do
      cands+=("$cand/python$DDPX_PYTHON_VERSION")
    done
  else
    cands+=(python3 /usr/bin/python3)
  fi
  for cand in "${cands[@]}"; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import venv, ensurepip' >/dev/null 2>&1; then
      command -v "$cand"
      return 0
    fi
  done
  echo "ddpx: no python${DDPX_PYTHON_VERSION:-3} with venv and ensurepip found" \
    "(tried: ${cands[*]})" >&2
  return 1
}

# Creates the venv of the chosen torch line (reused when its requirements and interpreter are
# unchanged).
ddpx_setup_python() {
  local t0 stamp_file want base=""
  t0=$(ddpx_now)
  stamp_file="$DDPX_VENV/.ddpx-requirements"
  if [ "$DDPX_TORCH" = debian ]; then
    want="debian-system-site-packages"
  else
    base=$(ddpx_base_python)
    want="$(cat "$DDPX_REQUIREMENTS" scripts/requirements-common.txt | sha256sum | cut -d' ' -f1)"
    want="$want $("$base" -c 'import sys; print(sys.version.split()[0])')"
  fi
  if [ -x "$DDPX_PY" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$want" ]; then
    ddpx_step "reusing $DDPX_VENV ($(ddpx_describe_python))"
    return 0
  fi
  rm -rf "$DDPX_VENV"
  if [ "$DDPX_TORCH" = debian ]; then
    /usr/bin/python3 -m venv --system-site-packages "$DDPX_VENV"
  else
    "$base" -m venv "$DDPX_VENV"
    mkdir -p "$DDPX_WHEELHOUSE"
    ddpx_step "pip: downloading into $DDPX_WHEELHOUSE what is not there yet"
    # --no-cache-dir: the wheelhouse is the cache; pip's own would hold a second copy.
    "$DDPX_PY" -m pip download -q --no-cache-dir -d "$DDPX_WHEELHOUSE" -r "$DDPX_REQUIREMENTS"
    ddpx_step "pip: installing into $DDPX_VENV from the wheelhouse"
    "$DDPX_PY" -m pip install -q --no-cache-dir --no-index --find-links "$DDPX_WHEELHOUSE" \
      -r "$DDPX_REQUIREMENTS"
    ddpx_share_venv_files
  fi
  echo "$want" >"$stamp_file"
  ddpx_step "$DDPX_VENV ready in $(( $(ddpx_now) - t0 )) s ($(ddpx_describe_python))"
}

# One torch on several CPythons installs byte-identical libraries in each venv: all but a handful
# of torch's 13k files (libtorch_cpu, libtorch_cuda), the nvidia-* and cuda-* wheels (py3-none),
# triton's abi3 wheel. Hard links between the venvs of this checkout keep one copy of each on
# disk: a 2.15 venv is 5.7 GB, a second one on another Python adds a few hundred MB. CI makes
# four pip venvs on one disk, and ran out of it with a copy each. Nothing writes installed files
# in place (pip replaces a file by unlinking it), so a shared inode stays the same in every venv.
ddpx_share_venv_files() {
  local t0 before after d dirs=()
  if ! command -v hardlink >/dev/null 2>&1; then
    ddpx_step "no hardlink(1) (util-linux): $DDPX_VENV keeps its own copies"
    return 0
  fi
  t0=$(ddpx_now)
  for d in .venv*/lib; do [ -d "$d" ] && dirs+=("$d"); done
  before=$(df -Pk . | awk 'NR==2 {print $4}')
  # -c: equal contents (pip sets its own times and modes); -f: the same file name only, which
  # is where the copies are, and spares hashing the rest; -s 1M: the bytes are in the big files.
  hardlink -q -c -f -s 1M "${dirs[@]}" || ddpx_step "hardlink failed; the venvs keep copies"
  after=$(df -Pk . | awk 'NR==2 {print $4}')
  ddpx_step "hard links between ${#dirs[@]} venvs freed $(( (after - before) / 1024 )) MB" \
    "in $(( $(ddpx_now) - t0 )) s"
}

# "torch 2.15.0+cu132, Python 3.11.7" for the venv's interpreter.
ddpx_describe_python() {
  "$DDPX_PY" -W ignore -c 'import sys, torch; print("torch", torch.__version__ + ", Python", sys.version.split()[0])'
}

# Configures and builds the CMake tree $DDPX_BUILD (library, Python module, tests, benchmarks)
# against the venv's torch.
ddpx_cmake_build() {
  local t0
  t0=$(ddpx_now)
  cmake -S . -B "$DDPX_BUILD" -G Ninja -DDDPX_PYTHON="$PWD/$DDPX_PY" \
    -DPython_EXECUTABLE="$PWD/$DDPX_PY" "$@"
  cmake --build "$DDPX_BUILD" -j "$(nproc)"
  ddpx_step "CMake build ($DDPX_BUILD) in $(( $(ddpx_now) - t0 )) s"
}

# pip-installs ddpx into the venv, as a user would: no build isolation (the venv's torch is the
# one CMake finds), no index (everything it needs is already there).
ddpx_pip_install() {
  local t0
  t0=$(ddpx_now)
  DDPX_BUILD_DIR="$PWD/$DDPX_PIP_BUILD" "$DDPX_PY" -m pip install -q --no-build-isolation \
    --no-deps --no-index .
  ddpx_step "pip install --no-build-isolation . in $(( $(ddpx_now) - t0 )) s"
}
