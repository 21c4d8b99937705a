#!/usr/bin/env python3
"""ctest ddp_python_vs_cpp: the same training by torch's Python DDP and by ddpx's C++ DDP ends
with bit-identical weights, for DDP's default allreduce, torch's built-in C++ hooks and every
ddpx hook and optimizer the C++ job runs.

Both jobs are the main jobs (benchmarks/train_digits.py and benchmarks/cpp/train_digits.cpp), each
launched by torchrun on 2 Gloo processes, on a smaller MLP for 2 epochs (PowerSGD and post-local
SGD both reach their compressed / local phases): the Python job saves every row's final weights
(rank 0), the C++ job trains on the data and initial weights the Python job exported and, with
--require-identical, exits non-zero unless each of its rows equals its Python counterpart bit for
bit. The two jobs share the Reducer, the hooks and the optimizer maths, so any difference is a bug
in the C++ DDP (bucket order, the per-iteration set-up, a hook's state), not rounding.

    python tests/cpp/python_vs_cpp.py --cpp build/benchmarks/cpp/train_digits --work build/pvc
(with the ddpx under test importable, e.g. PYTHONPATH=build/python)
"""
import argparse
import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A small model and two epochs: 44 steps, PowerSGD from step 7, local SGD from step 11.
SETTINGS = ["--hidden", "64", "--depth", "2", "--epochs", "2"]


def torchrun(extra, program):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if torch.__version__ < "2":
        # torch 1.13's torchrun crashes on Python 3.11 without these, and spells --no_python.
        cmd += ["--redirects", "1", "--tee", "1"]
    return cmd + extra + program


def run(cmd, log):
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(log) as f:
        text = f.read()
    return rc, text


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cpp", required=True, help="the built benchmarks/cpp/train_digits")
    p.add_argument("--work", required=True, help="a folder for the files and logs")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    script = os.path.join(ROOT, "benchmarks", "train_digits.py")
    data = os.path.join(args.work, "digits_cpp.pt")
    weights = os.path.join(args.work, "final_weights.pt")
    for f in (data, weights):
        if os.path.exists(f):
            os.remove(f)

    subprocess.check_call([sys.executable, script, "--export-cpp-data", data] + SETTINGS)
    rc, text = run(torchrun([], [script, "--out", args.work + "/", "--save-final-weights",
                                 weights] + SETTINGS), os.path.join(args.work, "python.log"))
    if rc != 0 or not os.path.exists(weights):
        print(text[-4000:])
        print(f"FAIL: the Python job failed (exit status {rc})")
        return 1
    saved = torch.load(weights)
    print(f"Python job: {len(saved)} rows saved")

    no_python = ["--no-python"] if torch.__version__ >= "2" else ["--no_python"]
    rc, text = run(torchrun(no_python, [args.cpp, "--data", data, "--out", args.work,
                                        "--compare", weights, "--require-identical"]),
                   os.path.join(args.work, "cpp.log"))
    table_path = os.path.join(args.work, "results_cpp.md")
    table = open(table_path).read() if os.path.exists(table_path) else ""
    print(table)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    identical = [r for r in rows if "| identical (" in r]
    # Every row of the C++ job has a Python counterpart: all must be compared and identical.
    if rc != 0 or not rows or len(identical) != len(rows):
        print(text[-4000:])
        print(f"FAIL: {len(identical)} of {len(rows)} C++ rows bit-identical to the Python job "
              f"(exit status {rc})")
        return 1
    names = [re.match(r"\| ([^|]+) \|", r).group(1).strip() for r in rows]
    print(f"PASS: {len(rows)} C++ DDP rows bit-identical to Python DDP: " + ", ".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
