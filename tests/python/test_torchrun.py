"""ddpx in a job launched by torchrun, as users launch DDP: 2 Gloo ranks, hooks registered
natively and drop-in, gradients checked against the exact mean of the ranks' local gradients.
On torch 2.x torchrun runs plainly; torch 1.13 on Python 3.11 needs torch_compat's workaround."""
import os
import subprocess
import sys

import torch

import torch_compat as tc

HERE = os.path.dirname(os.path.abspath(__file__))


def test_torchrun_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *tc.TORCHRUN_WORKAROUND_ARGS, os.path.join(HERE, "torchrun_job.py"), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                         cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    outs = [torch.load(str(tmp_path / f"rank{r}.pt")) for r in range(2)]
    for r, out in enumerate(outs):
        assert out["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}
    mean = (outs[0]["local"].double() + outs[1]["local"].double()) / 2
    assert not torch.equal(outs[0]["local"], outs[1]["local"])
    for name in ("allreduce_native", "fp16_dropin", "powersgd_native"):
        for step in range(3):
            a, b = outs[0][name][step], outs[1][name][step]
            assert torch.equal(a, b), (name, step)  # replicas agree
        # allreduce: the mean up to fp32 rounding; fp16: within fp16 rounding of the mean
        # (|error| <= 2^-11 * mean |x_r| per element, plus fp32 sums); PowerSGD before its
        # start_powerSGD_iter (steps 0, 1): a plain allreduce.
        tol = {"allreduce_native": 1e-6, "fp16_dropin": 2.0 ** -10, "powersgd_native": 1e-6}[name]
        scale = (outs[0]["local"].abs() + outs[1]["local"].abs()).double() / 2
        for step in (range(3) if name != "powersgd_native" else range(2)):
            err = (outs[0][name][step].double() - mean).abs()
            assert (err <= tol * scale + 1e-12).all(), (name, step, err.max())
    # PowerSGD rank 1 compresses from step 2: no longer the exact mean, still a replica mean.
    assert not torch.allclose(outs[0]["powersgd_native"][2].double(), mean, rtol=1e-4, atol=0)
