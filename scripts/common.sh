# Shared by scripts/test.sh and scripts/main.sh: installing dependencies and building ddpx.
# Source it from the repository root.

DDPX_APT_PACKAGES=(
  cmake ninja-build g++ ccache git
  libtorch-dev python3-torch pybind11-dev python3-pybind11 libgloo-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-venv python3-setuptools python3-wheel python3-pip
  python3-numpy python3-pytest python3-pytest-xdist python3-sklearn python3-matplotlib
)

# The interpreter that has torch: Debian's, not whatever python3 comes first on PATH.
DDPX_SYS_PYTHON=${DDPX_SYS_PYTHON:-/usr/bin/python3}

ddpx_install_deps() {
  local missing=()
  local p
  for p in "${DDPX_APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "ddpx: all apt packages present"
    return 0
  fi
  echo "ddpx: installing ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Configures and builds the CMake tree in build/ (library, Python module, tests, benchmarks).
ddpx_cmake_build() {
  local build_dir=${1:-build}
  shift || true
  cmake -S . -B "$build_dir" -G Ninja -DDDPX_PYTHON="$DDPX_SYS_PYTHON" \
    -DPython_EXECUTABLE="$DDPX_SYS_PYTHON" "$@"
  cmake --build "$build_dir" -j "$(nproc)"
}

# Creates .venv (seeing Debian's torch) and pip-installs ddpx into it, as a user would.
ddpx_pip_install() {
  if [ ! -x .venv/bin/python ]; then
    "$DDPX_SYS_PYTHON" -m venv --system-site-packages .venv
  fi
  .venv/bin/python -m pip install --no-build-isolation --no-deps --no-index -q . 
}
