"""A training job that checkpoints every step and resumes from its last checkpoint, for the
multi-node fault tests (test_faults.py); launched by torchrun, one rank per node.

    torchrun ... fault_job.py --kind powersgd|zero|localsgd|diloco --ckpt DIR --out DIR
        [--fault kill|stall --fault-rank R --fault-step K] [--steps N] [--timeout S]

--kind picks what must survive a restart: ddpx's PowerSGD hook (its error-feedback memories,
Q factors and generator: state_dict()), ddpx's ZeroRedundancyOptimizer (its state consolidated
to rank 0 and saved there), post-local SGD (the hook's iter, PostLocalSGDOptimizer's averager
step), or DiLoCo (its global parameters, residuals and the fragment in flight, per rank). Each
rank saves its checkpoint after every step; on start the ranks agree on the newest step that
every rank has saved (an allreduce of MIN) and resume from it. The data of a step
depends on the step and the rank only, so a run that restarts ends where an uninterrupted one
does, bit for bit.

--fault (once per --ckpt folder): rank R at step K kills itself
(SIGKILL: a node lost) or sleeps 3 group timeouts (a node stalled). A link cut is the test's
doing (scripts/multinode.py's set_link); the job writes <ckpt>/progress.<rank> after each step
for it to watch.

Any error ends the rank with one line on stderr, "fault_job: rank R attempt A step K after T s:
<type>: <message>", and exit code 3: the tests check that every surviving rank says what failed
within the group timeout.
"""
import argparse
import datetime
import glob
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx

H = ddpx.hooks


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


class Job:
    def __init__(self, kind: str, rank: int):
        self.kind, self.rank = kind, rank
        self.model = make_model()
        self.ddp = DDP(self.model)
        self.state = None
        sgd = dict(lr=0.05, momentum=0.9)
        if kind == "powersgd":
            self.state = H.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                         start_powerSGD_iter=3, random_seed=0)
            ddpx.register_comm_hook(self.ddp, self.state, H.powerSGD_hook)
            self.opt = torch.optim.SGD(self.ddp.parameters(), **sgd)
        elif kind == "zero":
            self.opt = ddpx.optim.ZeroRedundancyOptimizer(
                self.ddp.parameters(), optimizer_class=torch.optim.SGD, partition="balanced",
                **sgd)
        elif kind == "diloco":
            # No DDP: a plain replica per rank; streaming with a fragment's 4-bit exchange in
            # flight through the next step (fragment 0 at steps 2, 6, 10; fragment 1 at 4, 8).
            self.ddp = self.model
            self.opt = ddpx.optim.DiLoCo(torch.optim.SGD(self.model.parameters(), **sgd),
                                         sync_every=4, fragments=2, fragment_sync_delay=1,
                                         fragment_update_alpha=0.25, bits=4, block_size=64)
        elif kind == "localsgd":
            self.state = H.PostLocalSGDState(process_group=None, subgroup=None,
                                             start_localSGD_iter=3)
            ddpx.register_comm_hook(self.ddp, self.state, H.post_localSGD_hook)
            averager = ddpx.model_averaging.PeriodicModelAverager(period=2, warmup_steps=3)
            self.opt = ddpx.optim.PostLocalSGDOptimizer(
                torch.optim.SGD(self.ddp.parameters(), **sgd), averager)
        else:
            raise SystemExit(f"fault_job: unknown --kind {kind}")

    # ---- checkpoints: <dir>/step<k>.rank<r>.pt (+ <dir>/step<k>.zero.pt from rank 0)
    def save(self, ckpt: str, step: int) -> None:
        """After `step` (0-based) is done. Written to a temporary name and renamed, so that a
        rank killed while writing leaves no half file."""
        blob = {"step": step, "model": self.model.state_dict()}
        if self.kind == "zero":
            self.opt.consolidate_state_dict(to=0)  # collective
            if self.rank == 0:
                _atomic_save({"step": step, "optim": self.opt.state_dict()},
                             os.path.join(ckpt, f"step{step}.zero.pt"))
        else:
            blob["optim"] = self.opt.state_dict()
            if self.state is not None:
                blob["hook"] = (self.state.state_dict() if self.kind == "powersgd"
                                else {"iter": self.state.iter})
        _atomic_save(blob, os.path.join(ckpt, f"step{step}.rank{self.rank}.pt"))

    def load(self, ckpt: str, step: int) -> None:
        blob = torch.load(os.path.join(ckpt, f"step{step}.rank{self.rank}.pt"))
        self.model.load_state_dict(blob["model"])
        if self.kind == "zero":
            self.opt.load_state_dict(
                torch.load(os.path.join(ckpt, f"step{step}.zero.pt"))["optim"])
        else:
            self.opt.load_state_dict(blob["optim"])
            if self.kind == "powersgd":
                self.state.load_state_dict(blob["hook"])
            elif self.kind == "localsgd":
                self.state.iter = blob["hook"]["iter"]

    def step(self, step: int) -> None:
        x, y = batch(step, self.rank)
        self.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.ddp(x), y).backward()
        self.opt.step()


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _first_time(marker: str) -> bool:
    """True for the first caller ever (of any attempt, on any node: the nodes share the file
    system). TORCHELASTIC_RESTART_COUNT would not do: an agent that restarts its workers because
    another node failed does not count a restart, and ranks may move between nodes."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def newest_saved(ckpt: str, rank: int, kind: str) -> int:
    """The newest step this rank has a complete checkpoint of (-1: none)."""
    steps = [int(os.path.basename(p)[4:].split(".")[0])
             for p in glob.glob(os.path.join(ckpt, f"step*.rank{rank}.pt"))]
    if kind == "zero":  # rank 0's consolidated file must be there too
        steps = [s for s in steps if os.path.exists(os.path.join(ckpt, f"step{s}.zero.pt"))]
    return max(steps, default=-1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", required=True, choices=["powersgd", "zero", "localsgd", "diloco"])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=10.0, help="the group's timeout, seconds")
    p.add_argument("--fault", choices=["none", "kill", "stall"], default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=6)
    p.add_argument("--step-pause", type=float, default=0.0,
                   help="seconds each rank sleeps after a step (gives a link cut a window)")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    os.makedirs(args.ckpt, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    job = Job(args.kind, rank)
    # Resume where every rank has a checkpoint (a rank may have died before saving its last).
    agreed = torch.tensor([newest_saved(args.ckpt, rank, args.kind)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    start = int(agreed) + 1
    if start > 0:
        job.load(args.ckpt, start - 1)
    print(f"fault_job: rank {rank} attempt {attempt} starts at step {start}", flush=True)
    step, t_fault = start, time.monotonic()
    try:
        for step in range(start, args.steps):
            if (args.fault != "none" and rank == args.fault_rank and step == args.fault_step
                    and _first_time(os.path.join(args.ckpt, "fault.done"))):
                if args.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif args.fault == "stall":
                    time.sleep(3 * args.timeout)
            t_fault = time.monotonic()
            job.step(step)
            job.save(args.ckpt, step)
            with open(os.path.join(args.ckpt, f"progress.{rank}"), "w") as f:
                f.write(str(step))
            time.sleep(args.step_pause)
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the message is the point
        msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:600]
        print(f"fault_job: rank {rank} attempt {attempt} step {step} after "
              f"{time.monotonic() - t_fault:.1f} s: {msg}", file=sys.stderr, flush=True)
        # Not a normal exit: the group is broken, and destroying it could wait on the dead peer.
        os._exit(3)
    os.makedirs(args.out, exist_ok=True)
    torch.save({"weights": torch.cat([p.detach().reshape(-1) for p in job.model.parameters()]),
                "start": start, "attempt": attempt},
               os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
