"""benchmarks/train_charlm.py, the main job's harder task: its data (windows of the standard
library's source, train and test text disjoint) and a tiny 2-rank run of its job that must learn
(test loss well below the uniform guess) and report every row it was asked for."""
import json
import math
import os
import subprocess
import sys

import torch

import torch_compat as tc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import train_charlm as clm  # noqa: E402


def test_windows_are_the_text_and_train_and_test_do_not_overlap():
    chars, context = 200_000, 16
    text, files = clm.stdlib_text(chars)
    assert len(text) == chars and files >= 2
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long().clamp(max=clm.OTHER)
    x_tr, y_tr, x_te, y_te = clm.charlm_split(text, 3, context, 500, 100)
    assert x_tr.shape == (500, context) and x_te.shape == (100, context)
    assert int(torch.cat([x_tr.flatten(), x_te.flatten()]).max()) < clm.VOCAB
    cut = int(0.9 * chars)
    windows = tokens.unfold(0, context + 1, 1)  # every (context + 1)-byte window of the text
    # Each sample is a window of the text and the byte after it, from its own side of the cut.
    for x, y, lo, hi in ((x_tr, y_tr, 0, cut), (x_te, y_te, cut, chars)):
        sample = torch.cat([x, y[:, None]], dim=1)
        side = windows[lo:hi - context]
        for row in sample[:50]:
            assert (side == row).all(dim=1).any()
    again = clm.charlm_split(text, 3, context, 500, 100)
    assert all(torch.equal(a, b) for a, b in zip(again, (x_tr, y_tr, x_te, y_te)))
    other = clm.charlm_split(text, 4, context, 500, 100)
    assert not torch.equal(other[0], x_tr) and torch.equal(other[2], x_te)


def test_tiny_job_learns_and_reports_its_rows(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *tc.TORCHRUN_WORKAROUND_ARGS, os.path.join(REPO, "benchmarks", "train_charlm.py"),
           "--out", str(tmp_path), "--chars", "300000", "--train-samples", "8192",
           "--test-samples", "2048", "--epochs", "1", "--hidden", "64", "--depth", "1",
           "--threads", "1", "--warmup-steps", "2", "--only", "quantized_hook 8 bits",
           "--no-plot"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
        os.path.abspath(clm.td.ddpx.__file__))), env.get("PYTHONPATH")) if p)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env,
                         cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    blob = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["hook"], r["registration"]): r for r in blob["rows"]}
    assert blob["meta"]["task"] == "char-level LM"
    assert set(rows) == {("no hook", "DDP default"),
                         ("ddpx quantized_hook 8 bits", "native"),
                         ("ddpx quantized_hook 8 bits", "drop-in"),
                         ("ddpx quantized_hook 8 bits, no error feedback", "native")}
    base = rows[("no hook", "DDP default")]
    uniform = math.log(clm.VOCAB)
    for r in rows.values():
        assert r["status"] == "ok" and r["replica_spread"] == 0.0, r
        # 64 steps learn the byte frequencies at least: well below the uniform guess.
        assert r["test_loss"] < 0.8 * uniform, r["test_loss"]
        assert abs(r["test_loss"] - base["test_loss"]) < 0.02 * base["test_loss"], (
            r["hook"], r["test_loss"], base["test_loss"])
