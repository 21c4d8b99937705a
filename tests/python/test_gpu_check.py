"""scripts/gpu_check.sh, the one-shot check on the GPU machine, checked without a GPU.

Its plan (--plan, instant): the required steps' limits fit in the deadline, in the order of their
value (the build, a short kernel gate, the kernel and PowerSGD benchmarks, then the correctness
steps, the other benchmarks last and optional). The dry run (--dry-run: every step's command up
to where a GPU is needed, with a configure and a build of its own tree) takes minutes; it runs
here only with DDPX_TEST_GPU_CHECK_DRY_RUN=1, and in CI as its own line of .ci/run.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def plan(deadline=None):
    env = dict(os.environ)
    if deadline is not None:
        env["DDPX_GPU_DEADLINE_S"] = str(deadline)
    done = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True,
                          env=env, timeout=60)
    rows = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0].isdigit():
            rows.append({"step": parts[1], "limit": int(parts[2]), "kind": parts[3],
                         "lane": parts[4]})
    return done, rows


def test_required_limits_fit_the_deadline():
    done, rows = plan()
    assert done.returncode == 0, done.stdout + done.stderr
    required = [r for r in rows if r["kind"] == "required"]
    main = sum(r["limit"] for r in required if r["lane"] == "main")
    lanes = [sum(r["limit"] for r in required if r["lane"] == lane) for lane in ("A", "B", "C")]
    # 8 minutes, with margin: a second try fits in the 15 minutes of device time.
    assert main + max(lanes) <= 480 - 5, (main, lanes)
    assert f"{main + max(lanes)}s of a 480s deadline" in done.stdout


def test_a_plan_over_its_deadline_is_refused():
    done, _ = plan(deadline=300)
    assert done.returncode == 1
    assert "exceed the deadline" in done.stderr


def test_steps_in_order_of_value():
    _, rows = plan()
    order = [r["step"] for r in rows]
    first = ["env", "preflight", "configure", "build", "pytest_kernels", "bench_kernels",
             "bench_powersgd"]
    assert order[:len(first)] == first
    # The correctness steps after the two benchmarks that matter most, and before the others.
    for step in ("pytest_cuda", "ddp_cpp_nccl", "gtest_cuda", "pytest_cuda_rpc",
                 "pytest_cuda_streams"):
        assert order.index("bench_powersgd") < order.index(step) < order.index("bench_hooks_nccl")
    kinds = {r["step"]: r["kind"] for r in rows}
    for step in ("bench_hooks_nccl", "bench_hooks_gloo", "bench_averaging",
                 "pytest_nccl_legacy", "ddp_cpp_nccl_legacy"):
        assert kinds[step] == "optional", step
    # Only correctness steps share the GPU (the side lanes): no benchmark is timed beside them.
    for r in rows:
        if r["step"].startswith("bench_"):
            assert r["lane"] == "main", r


def test_header_documents_the_carried_googletest():
    text = SCRIPT.read_text()
    assert 'carry: ["third_party/googletest"]' in text
    assert "GTEST_DIR=third_party/googletest" in text
    assert "/third_party/" in (ROOT / ".gitignore").read_text().splitlines()
    # The CUDA pytest goes on past a failure (--maxfail), so that one failure hides no other.
    assert "--maxfail=5" in text and "pytest tests/python -q -x" not in text


@pytest.mark.skipif(os.environ.get("DDPX_TEST_GPU_CHECK_DRY_RUN") != "1",
                    reason="minutes (a configure and a build); set DDPX_TEST_GPU_CHECK_DRY_RUN=1")
def test_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                          env=env, timeout=3600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"]
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    _, rows = plan()
    assert set(statuses) == {r["step"] for r in rows}
    for r in rows:
        if r["kind"] == "required":
            assert statuses[r["step"]] == "ok", (r["step"], statuses[r["step"]])
