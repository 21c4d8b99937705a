"""Every ddpx capability across machines: the main job (every hook drop-in and native, both
wrappers, PowerSGD and its batched form, noop, post-local SGD with both averagers,
PostLocalSGDOptimizer, ZeroRedundancyOptimizer with both partitions, bucket views, overlap and
ZeRO-2: benchmarks/train_digits.py --coverage), the C++ DistributedDataParallel program
(torchrun --no-python) and the model-parallel DistributedOptimizer job over RPC, each launched on
N network namespaces joined by 1 Gbit/s links (scripts/multinode.py) and compared with the same
job launched on one machine.

Same ranks, same data, same collectives: the results must be bit-identical. Gloo's algorithms
depend on the rank and the world size only, not on where the peers are, so a difference means a
path that behaves differently between machines (an address or interface taken from the wrong
place, an exchange that depends on timing, state that is per host rather than per rank).
"""
import json
import os
import re
import subprocess
import sys
from typing import Dict, List, Sequence

import pytest
import torch

import multinode
import torch_compat as tc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESSES = os.path.join(REPO, "benchmarks")  # the main job and its RPC twin
JOB = os.path.join(HARNESSES, "train_digits.py")
RPC_JOB = os.path.join(HARNESSES, "train_digits_rpc.py")
# A small model and one epoch (22 steps at 2 ranks): CI-sized. One intra-op thread per rank in
# both layouts (the default would give a lone rank per node both cores).
SMALL = ["--epochs", "1", "--hidden", "32", "--depth", "2", "--threads", "1",
         "--warmup-steps", "2"]
RATE = "1gbit"


def _env() -> Dict[str, str]:
    """The test's environment without a launcher's variables (this process may run under one)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GROUP_RANK", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    # An exit-time abort prints every thread's stack (see ddpx/__init__.py).
    env["DDPX_STACKS_ON_ABORT"] = "1"
    return env


def _tail(results: Sequence[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"--- node {i} (exit {r.returncode}):\n{(r.stdout or '')[-4000:]}"
                     for i, r in enumerate(results))


def one_machine(script: List[str], nproc: int, timeout: float = 600.0,
                no_python: bool = False) -> subprocess.CompletedProcess:
    """`script` under torchrun --standalone with nproc ranks on this machine (loopback)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *tc.TORCHRUN_WORKAROUND_ARGS]
    if no_python:
        argv.append("--no-python")
    res = subprocess.run(argv + script, capture_output=True, text=True, timeout=timeout,
                         env=_env(), cwd=REPO)
    assert res.returncode == 0, _tail([res])
    return res


def several_machines(script: List[str], nodes: int, timeout: float = 600.0,
                     no_python: bool = False) -> List[subprocess.CompletedProcess]:
    """`script` on `nodes` namespaces, one rank each, RATE links; every node must exit 0."""
    with multinode.Cluster(nodes, rate=RATE) as cluster:
        results = cluster.torchrun(script, timeout=timeout, env=_env(), no_python=no_python,
                                   extra=tc.TORCHRUN_WORKAROUND_ARGS)
        sent = [cluster.tx_bytes(i) for i in range(nodes)]
    assert all(r.returncode == 0 for r in results), _tail(results)
    # The job's traffic went over the links the harness made (its interface counters).
    assert all(s > 10_000 for s in sent), sent
    return results


def _assert_same_weights(a_path: str, b_path: str, min_rows: int) -> Dict[str, torch.Tensor]:
    a, b = torch.load(a_path), torch.load(b_path)
    assert sorted(a) == sorted(b)
    assert len(a) >= min_rows, sorted(a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, {k: float((a[k] - b[k]).abs().max()) for k in differ}
    return a


@pytest.mark.parametrize("nodes", [2, 3])
def test_main_job_matches_one_machine(tmp_path, nodes):
    runs = {}
    for layout in ("one", "several"):
        out = tmp_path / layout
        script = [JOB, "--out", str(out), "--save-final-weights", str(out / "weights.pt"),
                  "--coverage", *SMALL]
        if layout == "one":
            one_machine(script, nodes)
        else:
            several_machines(script, nodes)
        with open(out / "results.json") as f:
            runs[layout] = {f"{r['hook']} ({r['registration']})": r for r in json.load(f)["rows"]}
    one, several = runs["one"], runs["several"]
    assert sorted(one) == sorted(several)
    # Every row ran (torch's bf16 hook is refused by torch on Gloo: the only expected refusal).
    bad = {k: (r["status"], r.get("error")) for k, r in several.items()
           if r["status"] != "ok" and not k.startswith("torch bf16_compress_hook")}
    assert not bad, bad
    weights = _assert_same_weights(str(tmp_path / "one" / "weights.pt"),
                                   str(tmp_path / "several" / "weights.pt"), min_rows=35)
    # The comparison can fail: the rows are not all one trajectory (PowerSGD, fp16 and noop end
    # elsewhere than DDP's allreduce).
    base = weights["no hook (DDP default)"]
    for other in ("ddpx powerSGD_hook r=1 (native)", "ddpx fp16_compress_hook (native)",
                  "ddpx noop_hook (drop-in)"):
        assert not torch.equal(weights[other], base), other
    # Replicas agree at the end, except noop's and the hierarchical averager's (its global level
    # averages at the steps its period divides, which the last step need not be).
    for k, r in several.items():
        if r["status"] == "ok" and "noop" not in k and "Hierarchical" not in k:
            assert r["replica_spread"] == 0, (k, r["replica_spread"])


def test_cpp_job_across_two_machines(tmp_path):
    """The C++ program, launched by torchrun --no-python on two machines, ends bit-identical
    with the Python job's rows on one machine (the main job's C++ check, across machines)."""
    binary = os.environ.get("DDPX_CPP_TRAIN_DIGITS", os.path.join(
        REPO, "build", "benchmarks", "cpp", "train_digits"))
    if not os.path.exists(binary):
        pytest.skip(f"no C++ train_digits at {binary} (scripts/test.sh builds it with ctest's "
                    "tree and sets DDPX_CPP_TRAIN_DIGITS)")
    data, weights = tmp_path / "digits_cpp.pt", tmp_path / "py" / "weights.pt"
    subprocess.run([sys.executable, JOB, "--export-cpp-data", str(data), *SMALL], check=True,
                   env=_env(), capture_output=True, timeout=120)
    one_machine([JOB, "--out", str(tmp_path / "py"), "--save-final-weights", str(weights),
                 *SMALL], 2)
    # --require-identical: the program exits 1 if a row differs or none was compared.
    several_machines([binary, "--data", str(data), "--out", str(tmp_path / "cpp"),
                      "--threads", "1", "--compare", str(weights), "--require-identical"], 2,
                     no_python=True)
    report = (tmp_path / "cpp" / "results_cpp.md").read_text()
    assert " 0 differ" in report and report.count("| identical (") >= 10, report


def test_rpc_job_across_three_machines(tmp_path):
    """DistributedOptimizer over RPC with a trainer and two parameter owners, each on its own
    machine (TensorPipe bound to the node's interface), ends bit-identical with the same job
    on one machine, for ddpx's optimizer and torch's."""
    paths = {}
    for layout in ("one", "several"):
        out = tmp_path / layout
        paths[layout] = str(out / "weights.pt")
        script = [RPC_JOB, "--out", str(out), "--save-final-weights", paths[layout],
                  "--epochs", "1", "--hidden", "32", "--warmup-steps", "2"]
        if layout == "one":
            one_machine(script, 3)
        else:
            several_machines(script, 3)
    _assert_same_weights(paths["one"], paths["several"], min_rows=2)


# How many runs in a row: 20 by default; CI takes fewer (.ci/run), each run costing about as much
# as a test of its own, for a failure once in tens of runs.
EXIT_RUNS = int(os.environ.get("DDPX_MULTINODE_EXIT_RUNS", "20"))


def test_clean_exit_of_consecutive_runs(tmp_path):
    """A job that finishes exits 0 on every rank: EXIT_RUNS runs in a row of the main job's
    configurations (tiny: 5 steps each) across two machines. A rank that aborts at interpreter
    exit (`terminate called ...`) makes torchrun report the finished job as failed."""
    assert EXIT_RUNS >= 1, "DDPX_MULTINODE_EXIT_RUNS must be at least 1"
    script = [JOB, "--out", str(tmp_path / "out"), "--coverage", "--epochs", "1",
              "--batch-size", "128", "--hidden", "16", "--depth", "1", "--threads", "1",
              "--warmup-steps", "1", "--no-plot"]
    failures = []
    with multinode.Cluster(2, rate=RATE) as cluster:
        for run in range(EXIT_RUNS):
            results = cluster.torchrun(script, timeout=300, env=_env(), port=29400 + run,
                                       rdzv_id=f"exit{run}")
            if any(r.returncode != 0 for r in results):
                # Whole outputs kept: the stacks of every thread (DDPX_STACKS_ON_ABORT) are
                # longer than a tail.
                log = tmp_path / f"run{run}.log"
                log.write_text("\n".join(f"--- node {i} (exit {r.returncode}):\n{r.stdout}"
                                         for i, r in enumerate(results)))
                failures.append(f"run {run} (whole output in {log}):\n"
                                + _aborting_stacks(results) + _tail(results)[-3000:])
    assert not failures, f"{len(failures)} of {EXIT_RUNS} runs did not exit 0:\n" + "\n".join(
        failures)[-12000:]


def _aborting_stacks(results: Sequence[subprocess.CompletedProcess]) -> str:
    """The stack of each thread that called abort(), from torch's fatal-signal handler's dump:
    the one that destroyed a joinable std::thread, where an exit-time abort is that."""
    stacks = []
    for r in results:
        for block in re.split(r"\n(?=SIGABRT\(6\), PID)", r.stdout or ""):
            if block.startswith("SIGABRT") and re.search(r"\babort \+", block):
                stacks.append(block[:4000])
    return "\n".join(stacks) + "\n" if stacks else ""
