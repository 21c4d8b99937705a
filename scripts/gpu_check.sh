#!/usr/bin/env bash
# One-shot check on the GPU machine: build ddpx with CUDA for its GPU only, run the CUDA tests and
# the GPU benchmarks, and leave every log and figure in one folder. CI compiles and tests the
# torch 2.x build itself on CPU (scripts/test.sh); this script builds here only because the GPU
# machine's Python (3.12) differs from CI's.
#
#   OUT=/some/dir bash scripts/gpu_check.sh          # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --prepare              # here, before: GoogleTest sources to carry
#   bash scripts/gpu_check.sh --dry-run              # CPU machine: every step short of the GPU
#   bash scripts/gpu_check.sh --plan                 # the steps and their limits; checks the sum
#
# Written for the project's GPU machine: one H200, torch 2.11 + CUDA 13 in /opt/torch/.venv (its
# python3 first on PATH), cmake 4.x, g++ 13, ninja, no network, no pip, and maybe no GoogleTest.
#
# Carried dependencies. The CUDA GoogleTests need GoogleTest; where the machine has none
# installed, they are built from the sources in third_party/googletest (git-ignored), which
# `--prepare` copies from /usr/src/googletest (Debian's googletest package; DDPX_GTEST_SOURCES
# names another tree). The device tool copies ignored paths only when asked:
#     carry: ["third_party/googletest"]                               (3.8 MB)
# Without either, the GoogleTest step is SKIPPED (not a failure); the C++ NCCL DDP job needs no
# GoogleTest and is always built.
#
# Budget. The whole run, machine start aside, ends within DDPX_GPU_DEADLINE_S (default 480 s,
# 8 minutes), so that a second try fits in the 15 minutes a task's machine is lent for. The
# required steps' limits add up to 470 s (checked by --plan and tests/python/test_gpu_check.py);
# each is at or near the upper end of its estimate below (the JUnit files and the step times
# that a run leaves in $OUT give the real ones):
#
#   step              limit  estimate  what
#   env                  10     8      machine, torch, CUDA, NCCL versions
#   preflight             5     2      nvcc, Python.h, ninja, cmake, GoogleTest
#   configure            45  20-40     torch's CUDA config, sm_90 only
#   build               140  80-150    the module, the C++ NCCL job, the CUDA GoogleTests (-j16)
#   pytest_kernels       25    20      short gate: casts, sums, Gram-Schmidt, optimizers on CUDA
#   bench_kernels        35  20-40     kernels vs torch and vs a device copy (target >= 0.8)
#   bench_powersgd       90  50-100    PowerSGD overhead per step on NCCL x 1 (target <= 2 ms)
#   -- three lanes at once, 120 s (correctness only: nothing is timed while they share the GPU) --
#   A pytest_cuda       120  80-150    the rest of the CUDA/NCCL pytest, --maxfail=5 (not -x)
#   B ddp_cpp_nccl       15  10-15     the C++ DistributedDataParallel on NCCL (torchrun)
#   B gtest_cuda         50  35-50     the CUDA GoogleTests, bit for bit against the CPU kernels
#   B pytest_cuda_rpc    55  30-60     the RPC DistributedOptimizer on CUDA parameters
#   C pytest_cuda_streams 60  20-40    hook futures vs their kernels, with the GPU lagging
#   -- optional, each only when its whole limit is left; else SKIPPED, not a failure --
#   pytest_nccl_legacy   60            the NCCL tests under torch's other NCCL class
#   ddp_cpp_nccl_legacy  15            (torch 2.15's ProcessGroupNCCL2 vs TORCH_DIST_USE_NCCL2=0;
#                                      N/A where torch has one class, as 2.11)
#   bench_hooks_nccl     60    40-75   every hook on NCCL x 1, torch's beside ddpx's
#   bench_hooks_gloo     50    30-60   Gloo x 2 ranks sharing the GPU
#   bench_averaging      50    30-60   post-local SGD averaging, Gloo x 2
#
# A step that fails or times out is recorded and the script goes on (a step that needs the build
# is skipped when the build failed). A required step that fails, times out or is skipped for a
# failed dependency fails the run; an optional step skipped for the deadline, a step skipped for
# a missing optional dependency (GoogleTest) and an N/A step do not.
#
# Output, all under $OUT (default ./out-gpu), written as the run goes so that a run cut short
# still holds what it measured: NN_<step>.log for every step (the benchmarks print their tables
# there as they go), *.json figures, pytest_*.xml (JUnit, with each test's time), summary.txt
# and summary.json (rewritten after every step). Exit status: 0 when no step failed.
#
# --dry-run (or DDPX_GPU_CHECK_DRY_RUN=1), on a CPU machine with nvcc and a CUDA build of torch
# (CI's newest pip torch): the same steps with the same command lines, each run up to where a GPU
# is needed. It prepares the GoogleTest sources and builds the CUDA GoogleTests from them (as the
# GPU machine would), builds in build-gpu-dry at -j2 (ccache makes a warm build short), collects
# each pytest selection (--collect-only; an empty selection fails), runs each benchmark until it
# stops at its CUDA check, lists the GoogleTests, and runs the C++ DDP job on Gloo instead of
# NCCL. No deadline applies to configure and build there.
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$(pwd)

MODE=run
DRY=${DDPX_GPU_CHECK_DRY_RUN:-0}
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --plan) MODE=plan ;;
    --prepare) MODE=prepare ;;
    -h | --help)
      sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "gpu_check: unknown argument '$arg' (--dry-run, --plan, --prepare, --help)" >&2
      exit 2
      ;;
  esac
done

DEADLINE_S=${DDPX_GPU_DEADLINE_S:-480}
GTEST_DIR=third_party/googletest

# ---- the plan: name, limit (s), kind (required | optional), lane (main | A | B | C) ------------
# Steps run in this order; the A, B and C lanes run side by side, after the main lane's steps
# above them and before those below.
PLAN=(
  "env 10 required main"
  "preflight 5 required main"
  "configure 45 required main"
  "build 140 required main"
  "pytest_kernels 25 required main"
  "bench_kernels 35 required main"
  "bench_powersgd 90 required main"
  "pytest_cuda 120 required A"
  "ddp_cpp_nccl 15 required B"
  "gtest_cuda 50 required B"
  "pytest_cuda_rpc 55 required B"
  "pytest_cuda_streams 60 required C"
  "pytest_nccl_legacy 60 optional main"
  "ddp_cpp_nccl_legacy 15 optional main"
  "bench_hooks_nccl 60 optional main"
  "bench_hooks_gloo 50 optional main"
  "bench_averaging 50 optional main"
)
declare -A LIMIT KIND INDEX
i=0
for row in "${PLAN[@]}"; do
  read -r name limit kind lane <<<"$row"
  i=$((i + 1))
  LIMIT[$name]=$limit
  KIND[$name]=$kind
  INDEX[$name]=$i
done

# The required steps' worst case: the main lane's limits plus the longest of the side lanes.
plan_total() {
  local main=0 row name limit kind lane
  declare -A side=([A]=0 [B]=0 [C]=0)
  for row in "${PLAN[@]}"; do
    read -r name limit kind lane <<<"$row"
    [ "$kind" = required ] || continue
    if [ "$lane" = main ]; then
      main=$((main + limit))
    else
      side[$lane]=$((${side[$lane]} + limit))
    fi
  done
  local longest=0 l
  for l in "${side[@]}"; do [ "$l" -gt "$longest" ] && longest=$l; done
  echo $((main + longest))
}

if [ "$MODE" = plan ]; then
  printf '%-3s %-20s %6s  %-9s %s\n' '#' step limit kind lane
  for row in "${PLAN[@]}"; do
    read -r name limit kind lane <<<"$row"
    printf '%-3s %-20s %6s  %-9s %s\n' "${INDEX[$name]}" "$name" "$limit" "$kind" "$lane"
  done
  total=$(plan_total)
  echo "required steps at their limits: ${total}s of a ${DEADLINE_S}s deadline"
  [ "$total" -le "$DEADLINE_S" ] || {
    echo "gpu_check: the required limits exceed the deadline" >&2
    exit 1
  }
  exit 0
fi

# GoogleTest sources for a machine that has none: copied here, carried there (see the header).
prepare_gtest() {
  local src=${DDPX_GTEST_SOURCES:-/usr/src/googletest}
  if [ -f "$GTEST_DIR/CMakeLists.txt" ]; then
    echo "gpu_check: $GTEST_DIR is there"
    return 0
  fi
  if [ ! -f "$src/CMakeLists.txt" ]; then
    echo "gpu_check: no GoogleTest sources at $src (apt-get install googletest, or set" \
      "DDPX_GTEST_SOURCES)" >&2
    return 1
  fi
  mkdir -p "$(dirname "$GTEST_DIR")"
  cp -r "$src" "$GTEST_DIR.tmp" && mv "$GTEST_DIR.tmp" "$GTEST_DIR"
  echo "gpu_check: copied $src to $GTEST_DIR ($(du -sh "$GTEST_DIR" | cut -f1)); run the check" \
    "with carry [\"$GTEST_DIR\"]"
}
if [ "$MODE" = prepare ]; then
  prepare_gtest
  exit $?
fi

if [ "$DRY" = 1 ]; then
  OUT=${OUT:-./out-gpu-dry}
  BUILD=${DDPX_GPU_BUILD_DIR:-build-gpu-dry}
  JOBS=${DDPX_GPU_JOBS:-2}
  DEADLINE_S=${DDPX_GPU_DEADLINE_S:-3600}
  LIMIT[configure]=600
  LIMIT[build]=1800
  prepare_gtest || exit 1
else
  OUT=${OUT:-./out-gpu}
  BUILD=${DDPX_GPU_BUILD_DIR:-build-gpu}
  JOBS=${DDPX_GPU_JOBS:-16}
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STATUS_DIR="$OUT/.status"
rm -rf "$STATUS_DIR"
mkdir -p "$STATUS_DIR"
T0=$(date +%s)

# The interpreter that has torch: $PYTHON, python3 on PATH, then the GPU machine's venv.
PY=""
for cand in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3 /usr/bin/python3; do
  [ -n "$cand" ] || continue
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch' >/dev/null 2>&1; then
    PY=$(command -v "$cand")
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no python3 that can import torch (set PYTHON=...)" | tee "$OUT/summary.txt"
  exit 1
fi
export DDPX_PYTHON="$PY"  # cmake/DdpxTorch.cmake tries this interpreter first
# Where ccache is (CI), objects compiled in another tree of this checkout are reused.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$ROOT}
# One machine, no network: every transport on loopback (TensorPipe would otherwise guess an
# address from the host name; Gloo and NCCL's bootstrap pick an interface too).
export TP_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
# The run's tests import the module built here.
export PYTHONPATH="$ROOT/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
# Run by `bash -c` in every step: the dry run's stand-ins below.
export DDPX_GPU_DRY=$DRY

remaining() { echo $((DEADLINE_S - ($(date +%s) - T0))); }

# record NAME STATUS SECONDS LOG FAILS: one file per step, so that steps of both lanes can record
# at once; the summary is remade from these files after every step.
record() {
  local n
  n=$(printf '%02d' "${INDEX[$1]}")
  echo "$1|$2|$3|$4|$5" >"$STATUS_DIR/$n.tmp.$BASHPID" && mv "$STATUS_DIR/$n.tmp.$BASHPID" "$STATUS_DIR/$n"
  write_summary
}

write_summary() {
  local f name status secs log fails tmp="$OUT/.summary.tmp.$BASHPID"
  {
    echo "gpu_check summary ($(date -u), $(($(date +%s) - T0))s so far, deadline ${DEADLINE_S}s," \
      "python $PY$([ "$DRY" = 1 ] && echo ', DRY RUN'))"
    printf '%-20s %-9s %-32s %7s  %s\n' step kind status seconds log
    for f in "$STATUS_DIR"/[0-9][0-9]; do
      [ -f "$f" ] || continue
      IFS='|' read -r name status secs log fails <"$f"
      printf '%-20s %-9s %-32s %7s  %s\n' "$name" "${KIND[$name]}" "$status" "$secs" "$log"
    done
  } >"$tmp" && mv "$tmp" "$OUT/summary.txt"
  "$PY" - "$STATUS_DIR" "$OUT/summary.json" "$DEADLINE_S" "$DRY" <<'EOF' 2>/dev/null || true
import glob, json, os, sys
d, path, deadline, dry = sys.argv[1:]
steps = []
for f in sorted(glob.glob(os.path.join(d, "[0-9][0-9]"))):
    name, status, secs, log, fails = open(f).read().rstrip("\n").split("|")
    steps.append({"step": name, "status": status, "seconds": int(secs), "log": log,
                  "fails_run": fails == "1"})
with open(path + ".tmp%d" % os.getpid(), "w") as out:
    json.dump({"deadline_s": int(deadline), "dry_run": dry == "1", "steps": steps}, out, indent=1)
os.replace(path + ".tmp%d" % os.getpid(), path)
EOF
}

# run_step NAME COMMAND: runs COMMAND (a bash -c string) under its plan limit, cut to the time
# left before the deadline, its output in $OUT/NN_NAME.log (pytest's exit status 5, no test
# selected, is a failure: a selection that selects nothing checks nothing). An optional step runs
# only when its whole limit is left. Returns 0 when the step passed.
run_step() {
  local name=$1 cmd=$2
  local limit=${LIMIT[$name]} kind=${KIND[$name]} log left
  log=$(printf '%s/%02d_%s.log' "$OUT" "${INDEX[$name]}" "$name")
  left=$(remaining)
  if [ "$kind" = optional ] && [ "$left" -lt "$limit" ]; then
    echo "== [$name] skipped: ${left}s left before the deadline, it needs ${limit}s" | tee "$log"
    record "$name" "SKIPPED(deadline)" 0 "$log" 0
    return 1
  fi
  if [ "$left" -lt 5 ]; then
    echo "== [$name] skipped: the ${DEADLINE_S}s deadline is reached" | tee "$log"
    record "$name" "SKIPPED(deadline)" 0 "$log" 1
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== [$name] (limit ${limit}s) $cmd" | tee "$log"
  local s e rc status fails=0
  s=$(date +%s)
  timeout --kill-after=5 "$limit" bash -c "$cmd" >>"$log" 2>&1
  rc=$?
  e=$(date +%s)
  status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMEOUT(${limit}s)"
    fails=1
  elif [ "$rc" -ne 0 ]; then
    status="FAILED(rc=$rc)"
    fails=1
  fi
  tail -n 3 "$log" | sed "s/^/   [$name] /"
  echo "== [$name] $status in $((e - s))s" | tee -a "$log"
  record "$name" "$status" $((e - s)) "$log" $fails
  return $fails
}

# A step that cannot run: skipped for a failed step before it (fails the run when the step is
# required), for a missing optional dependency (never fails it), or not applicable here.
skip_step() {  # skip_step NAME REASON FAILS
  echo "== [$1] skipped: $2"
  record "$1" "SKIPPED($2)" 0 - "$3"
}
na_step() {
  echo "== [$1] not applicable: $2"
  record "$1" "N/A($2)" 0 - 0
}

# ---- the dry run's stand-ins, used inside the steps' commands ----------------------------------
# pytest_sel ARGS...: pytest on the GPU machine; --collect-only in a dry run (an empty selection
# exits 5 there as it would on the GPU machine).
pytest_sel() {
  if [ "$DDPX_GPU_DRY" = 1 ]; then
    "$DDPX_PYTHON" -m pytest --collect-only "$@"
    return $?
  fi
  "$DDPX_PYTHON" -m pytest "$@"
}
# bench ARGS...: a GPU benchmark; in a dry run it must get as far as its CUDA check.
bench() {
  if [ "$DDPX_GPU_DRY" = 1 ]; then
    local out rc
    out=$("$DDPX_PYTHON" "$@" 2>&1)
    rc=$?
    echo "$out"
    if grep -q 'torch.cuda.is_available() is False' <<<"$out"; then
      echo "dry run: the arguments were accepted; the benchmark stopped at its CUDA check"
      return 0
    fi
    return $((rc == 0 ? 1 : rc))
  fi
  "$DDPX_PYTHON" "$@"
}
# ddp_job TORCHRUN_ARGS... JOB: the C++ DDP job on NCCL; on Gloo in a dry run.
ddp_job() {
  local backend=nccl
  [ "$DDPX_GPU_DRY" = 1 ] && backend=gloo
  "$DDPX_PYTHON" -m torch.distributed.run "$@" "$backend"
}
export -f pytest_sel bench ddp_job

PYTEST_OPTS="-q -p no:cacheprovider -rfE --durations=15"
# The kernel gate: test_cuda.py's kernel and optimizer tests (about 20 s), before the benchmarks
# that time those kernels; the rest of the CUDA tests after them.
KERNEL_TESTS="test_cuda_scaled_cast or test_cuda_sum_rows or test_cuda_orthogonalize or \
test_cuda_functional_optim"

# torch 2.15's "nccl" is its nccl2 class unless TORCH_DIST_USE_NCCL2=0 (the classic
# ProcessGroupNCCL): where torch has both, the NCCL steps run once more with the other class.
HAS_NCCL2=$("$PY" -c 'import torch.distributed as d; print(int(hasattr(d, "ProcessGroupNCCL2")))' \
  2>/dev/null || echo 0)

# ---- 1. the machine ---------------------------------------------------------------------------
run_step env "
  set -x
  date -u; uname -a; nvidia-smi || true; nproc; free -g | head -2
  git -C '$ROOT' log -1 --oneline || true; git -C '$ROOT' status --short | head -40 || true
  '$PY' -c 'import torch, sys; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\"); import torch.cuda.nccl as n; print(\"nccl\", n.version())'
  cmake --version | head -1; ninja --version; g++ --version | head -1
  command -v nvcc && nvcc --version | tail -2 || ls /usr/local/cuda/bin/nvcc || true
"

# ---- 2. preflight (seconds): what the build needs, found before anything is configured ----------
# nvcc: PATH, then the usual install prefixes (torch's CMake needs the toolkit: without it every
# later step would fail after a slow configure).
NVCC=$(command -v nvcc || true)
for cand in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc /opt/cuda/bin/nvcc; do
  [ -n "$NVCC" ] && break
  [ -x "$cand" ] && NVCC=$cand
done
[ -n "$NVCC" ] && export CUDACXX="$NVCC"
# The C++ compiler: one that links libstdc++ as a shared library. The GPU machine's first g++ on
# PATH (/opt/gcc/bin/g++) put a copy of libstdc++ inside ddpx._C, and the first
# `std::ostringstream << int64_t` (PowerSGDState's config line) crashed with SIGSEGV; the static
# copy is the suspect (docs/guide/gpu-check.md). The build refuses such a compiler and such a
# module itself (cmake/DdpxLibstdcxx.cmake: at configure, and after the module's link); here the
# same probe picks a compiler that passes, so that the run goes on instead of failing there: the
# first candidate whose small shared library (an ostringstream) needs libstdc++.so is taken
# (CMAKE_CXX_COMPILER, and nvcc's host compiler with it). CMake's own choice (CXX, else c++ on
# PATH) comes first: ccache keys on the compiler's name, so the same name as CI's other builds
# lets the dry run take their objects from the cache.
cxx_links_shared_libstdcxx() {  # cxx_links_shared_libstdcxx COMPILER
  cmake -DDDPX_PROBE_CXX="$1" -P "$ROOT/cmake/DdpxLibstdcxx.cmake" >/dev/null 2>&1
}
CXX_PICK=""
for cand in "${CXX:-}" c++ /usr/bin/c++ /usr/bin/g++ /usr/bin/g++-13 /usr/bin/g++-14 g++; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
  if cxx_links_shared_libstdcxx "$(command -v "$cand")"; then
    CXX_PICK=$(command -v "$cand")
    break
  fi
  echo "gpu_check: $cand links libstdc++ statically into shared libraries: not used"
done
run_step preflight "
  set -e
  echo 'nvcc: ${NVCC:-MISSING}'; test -n '$NVCC'
  echo 'C++ compiler linking libstdc++ as a shared library: ${CXX_PICK:-NONE}'; test -n '$CXX_PICK'
  '$PY' -c 'import os, sysconfig; h = os.path.join(sysconfig.get_paths()[\"include\"], \"Python.h\"); print(\"Python.h:\", h); assert os.path.exists(h)'
  command -v ninja; command -v cmake
  ls /usr/include/gtest/gtest.h /usr/local/include/gtest/gtest.h 2>/dev/null || echo 'GoogleTest: not installed'
  test -f '$GTEST_DIR/CMakeLists.txt' && echo 'GoogleTest sources: $GTEST_DIR' || echo 'GoogleTest sources: none carried'
"

# ---- 3. configure and build what the GPU run needs -----------------------------------------------
# The CPU suites, the C++ benchmarks and the consumer example run in CI on every change; here only
# the module, the C++ DDP job and the CUDA GoogleTests are built, for the H200 only (sm_90 + PTX).
# GoogleTest: installed, else the carried sources, else none (DDPX_GTEST=OPTIONAL: the CUDA
# GoogleTests are then skipped, the rest built). The dry run hides an installed GoogleTest, to
# build from the sources as the GPU machine may have to.
TORCH_PREFIX=$("$PY" -c 'import torch;print(torch.utils.cmake_prefix_path)')
CONFIGURE="cmake -S . -B '$BUILD' -G Ninja -DCMAKE_PREFIX_PATH='$TORCH_PREFIX' \
  -DDDPX_CUDA_ARCHS=${DDPX_GPU_ARCHS:-90} -DDDPX_CUDA=ON -DPython_EXECUTABLE='$PY' \
  -DDDPX_BUILD_BENCHMARKS=OFF -DDDPX_BUILD_MAIN_JOB=OFF -DDDPX_BUILD_TESTS=ON \
  -DDDPX_GTEST=OPTIONAL -DDDPX_GTEST_SOURCE_DIR='$ROOT/$GTEST_DIR'"
[ -n "$CXX_PICK" ] && CONFIGURE="$CONFIGURE -DCMAKE_CXX_COMPILER='$CXX_PICK'"
[ "$DRY" = 1 ] && CONFIGURE="$CONFIGURE -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON"
BUILD_OK=0
GTEST_PROVIDER=none
if run_step configure "$CONFIGURE"; then
  GTEST_PROVIDER=$(sed -n 's/^DDPX_GTEST_PROVIDER:INTERNAL=//p' "$BUILD/CMakeCache.txt")
  TARGETS="_C ddp_torchrun_job"
  [ "${GTEST_PROVIDER:-none}" != none ] && TARGETS="$TARGETS test_cuda_kernels test_orthogonalize"
  # -k 0: keep building the other targets past a failing one, so that a broken test file does
  # not cost the module.
  run_step build "echo 'GoogleTest: ${GTEST_PROVIDER:-none}'; \
    cmake --build '$BUILD' -j $JOBS --target $TARGETS -- -k 0"
  # A module with a static libstdc++ inside fails its own link step and is removed (see CXX_PICK
  # above): the build step fails with the reason in its log, and nothing below runs.
  compgen -G "$BUILD/python/ddpx/_C*.so" >/dev/null && BUILD_OK=1
else
  skip_step build "configure failed" 1
fi
HAVE_JOB=0
[ -x "$BUILD/tests/cpp/ddp_torchrun_job" ] && HAVE_JOB=1

# ---- 4. the kernel gate, then the benchmarks that matter most, alone on the GPU ----------------
if [ "$BUILD_OK" = 1 ]; then
  run_step pytest_kernels "pytest_sel tests/python/test_cuda.py -k '$KERNEL_TESTS' \
    $PYTEST_OPTS --junitxml='$OUT/pytest_kernels.xml'"
  # Kernels vs torch and vs a device-to-device copy of the same bytes (target: >= 0.8 of it),
  # and Gram-Schmidt vs torch's PowerSGD _orthogonalize (batched QR above rank 2) on P shapes up
  # to 4096 x 32.
  run_step bench_kernels "bench benchmarks/bench_kernels.py --device cuda --reps 10 \
    --json '$OUT/kernels_cuda.json'"
  # PowerSGD, NCCL world size 1, 16 x Linear(4096,4096)+GELU, batch 512, DDP's 25 MB buckets:
  # no hook, ddpx noop, torch allreduce, torch powerSGD_hook vs ddpx drop-in/native at ranks 1,
  # 4, 32, ddpx batched and fp16-wrapped at rank 1; overheads vs noop, bytes per step, and the
  # memory-bandwidth floor from a device copy measured in the same run (target: ddpx overhead
  # <= 2 ms/step at ranks 1-4).
  run_step bench_powersgd "bench benchmarks/bench_powersgd.py --device cuda --ranks 1,4,32 \
    --rounds 4 --steps 3 --json '$OUT/powersgd_cuda_nccl.json'"
else
  for s in pytest_kernels bench_kernels bench_powersgd; do skip_step "$s" "no ddpx._C built" 1; done
fi

# ---- 5. the correctness steps, three lanes side by side -----------------------------------------
lane_a() {
  if [ "$BUILD_OK" = 1 ]; then
    run_step pytest_cuda "pytest_sel tests/python -k '(cuda or nccl) and not ($KERNEL_TESTS)' \
      --ignore=tests/python/test_cuda_dist_optim.py --ignore=tests/python/test_cuda_streams.py \
      --maxfail=5 $PYTEST_OPTS --junitxml='$OUT/pytest_cuda.xml'"
  else
    skip_step pytest_cuda "no ddpx._C built" 1
  fi
}
lane_b() {
  # The C++ DistributedDataParallel on NCCL (init_process_group_from_env("nccl"), GPU
  # LOCAL_RANK): one process, 4 steps, replicas checked. No GoogleTest needed.
  if [ "$HAVE_JOB" = 1 ]; then
    run_step ddp_cpp_nccl "ddp_job --standalone --nproc_per_node=1 --no-python \
      '$BUILD/tests/cpp/ddp_torchrun_job'"
  else
    skip_step ddp_cpp_nccl "ddp_torchrun_job not built" 1
  fi
  # The CUDA GoogleTests (bit-exact casts and sums for every dtype pair, Gram-Schmidt plans and
  # the cooperative launch's fallback) and the architectures in the fatbins.
  if [ "${GTEST_PROVIDER:-none}" = none ]; then
    skip_step gtest_cuda "no GoogleTest installed or carried" 0
  elif [ "$DRY" = 1 ]; then
    run_step gtest_cuda "set -eo pipefail; '$BUILD/tests/cpp/test_cuda_kernels' --gtest_list_tests | tail -3; \
      '$BUILD/tests/cpp/test_orthogonalize' --gtest_filter='*Cuda*' --gtest_list_tests | tail -3; \
      ctest --test-dir '$BUILD' -N -R cuda_architectures | grep 'Total Tests: [1-9]'"
  else
    # test_orthogonalize's CUDA cases only: CI runs its CPU cases.
    run_step gtest_cuda "set -eo pipefail; '$BUILD/tests/cpp/test_cuda_kernels'; \
      '$BUILD/tests/cpp/test_orthogonalize' --gtest_filter='*Cuda*'; \
      ctest --test-dir '$BUILD' --output-on-failure --timeout 30 -R cuda_architectures"
  fi
  # The RPC DistributedOptimizer on CUDA parameters (3 TensorPipe workers on the one GPU with
  # device maps, ddpx vs torch).
  if [ "$BUILD_OK" = 1 ]; then
    run_step pytest_cuda_rpc "pytest_sel tests/python/test_cuda_dist_optim.py $PYTEST_OPTS \
      --junitxml='$OUT/pytest_cuda_rpc.xml'"
  else
    skip_step pytest_cuda_rpc "no ddpx._C built" 1
  fi
}
# The hooks' futures against their kernels' streams (PowerSGD's round two, the exchanges' second
# rounds and completions), with the GPU far behind the host.
lane_c() {
  if [ "$BUILD_OK" = 1 ]; then
    run_step pytest_cuda_streams "pytest_sel tests/python/test_cuda_streams.py --maxfail=5 \
      $PYTEST_OPTS --junitxml='$OUT/pytest_cuda_streams.xml'"
  else
    skip_step pytest_cuda_streams "no ddpx._C built" 1
  fi
}
lane_a &
PID_A=$!
lane_b &
PID_B=$!
lane_c &
PID_C=$!
wait "$PID_A" "$PID_B" "$PID_C"

# ---- 6. optional: the other NCCL class, then the remaining benchmarks -------------------------
if [ "$HAS_NCCL2" = 1 ] && [ "$BUILD_OK" = 1 ]; then
  run_step pytest_nccl_legacy "TORCH_DIST_USE_NCCL2=0 pytest_sel tests/python -k nccl \
    --ignore=tests/python/test_cuda_dist_optim.py --maxfail=5 $PYTEST_OPTS \
    --junitxml='$OUT/pytest_nccl_legacy.xml'"
else
  na_step pytest_nccl_legacy "torch has one NCCL class"
fi
if [ "$HAS_NCCL2" = 1 ] && [ "$HAVE_JOB" = 1 ]; then
  run_step ddp_cpp_nccl_legacy "TORCH_DIST_USE_NCCL2=0 ddp_job --standalone --nproc_per_node=1 \
    --no-python '$BUILD/tests/cpp/ddp_torchrun_job'"
else
  na_step ddp_cpp_nccl_legacy "torch has one NCCL class"
fi
if [ "$BUILD_OK" = 1 ]; then
  # NCCL, world size 1 (NCCL refuses two ranks on one GPU): the default GPU model,
  # 16 x Linear(4096,4096)+GELU, batch 512, all hooks including torch's bf16.
  run_step bench_hooks_nccl "bench benchmarks/bench_hooks.py --device cuda --backends nccl \
    --rounds 4 --steps 3 --json '$OUT/hooks_cuda_nccl.json'"
  # Gloo, 2 ranks sharing the GPU: Gloo stages CUDA tensors through host memory, so a smaller
  # model (2 x Linear(4096,4096), 128 MB of gradients) and fewer rounds.
  run_step bench_hooks_gloo "bench benchmarks/bench_hooks.py --device cuda --backends gloo \
    --world-size 2 --layers 2 --rounds 3 --steps 3 --json '$OUT/hooks_cuda_gloo.json'"
  # Parameter averaging (post-local SGD) on CUDA tensors: Gloo, 2 ranks sharing the GPU (NCCL
  # world size 1 would return at once); torch's flat-buffer average vs ddpx's in-place buckets,
  # time and torch.cuda.max_memory_allocated.
  run_step bench_averaging "bench benchmarks/bench_averaging.py --device cuda --backend gloo \
    --world-size 2 --layers 6 --rounds 5 --json '$OUT/averaging_cuda_gloo.json'"
else
  for s in bench_hooks_nccl bench_hooks_gloo bench_averaging; do
    skip_step "$s" "no ddpx._C built" 0
  done
fi

# ---- summary ------------------------------------------------------------------------------------
write_summary
FAILED=0
for f in "$STATUS_DIR"/[0-9][0-9]; do
  IFS='|' read -r _ _ _ _ fails <"$f"
  [ "$fails" = 1 ] && FAILED=1
done
if [ "$FAILED" = 0 ]; then
  echo "ALL REQUIRED STEPS OK ($(($(date +%s) - T0))s)" >>"$OUT/summary.txt"
else
  echo "SOME STEPS FAILED (see the logs)" >>"$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
exit "$FAILED"
