"""Shared pieces of the post-local SGD tests (test_post_local_sgd.py): a small MLP, rank-dependent
data, the torch and ddpx configurations (post_localSGD_hook + model averager + optimizer), and
the rank functions that run them.

Rank functions run inside the ranks started by dist_utils.run_ranks; what they return is compared
in the pytest process. `rank_cases` runs several named checks in one launch; a check that raises
returns {"error": traceback} instead of failing the whole launch, so that the test reading it
fails with that traceback while the others still pass.

torch CPU quirks (torch_compat): torch 1.13's dist.new_subgroups() and
new_subgroups_by_enumeration() raise ValueError without CUDA; torch 2.x's work with an explicit
group_size, and only new_subgroups() with the default size needs CUDA (so torch's
post_localSGD_hook with subgroup=None fails on CPU on both). Subgroups are built here with
dist.new_group (`make_subgroups`) and handed to both torch's and ddpx's hook; torch's
HierarchicalModelAverager runs with its own new_subgroups on 2.x, and on 1.13 with
dist.new_subgroups temporarily replaced by the same construction (`cpu_new_subgroups`).
"""
import contextlib
import io
import pickle
import traceback
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as tpl
from torch.distributed.algorithms.model_averaging import averagers as tavg
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as thier
from torch.distributed.algorithms.model_averaging import utils as tutils
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx
import torch_compat as tc
from dist_utils import catch

# DDP bucket cap: 4 KiB (1024 fp32). The MLP below has 1344 + 4160 + 520 parameters: from the
# second iteration on, a backward pass has several buckets, so the hook's iteration counting
# (bucket 0 only) matters.
BUCKET_BYTES = 4096
LR = 0.05
MOMENTUM = 0.9
STEPS = 30
START = 6     # start_localSGD_iter == warmup_steps
PERIOD = 4    # averaging steps (0-based loop index): 6, 10, 14, 18, 22, 26
IN, HIDDEN, OUT = 20, 64, 8


def make_model(seed: int = 0) -> nn.Module:
    """The same weights on every rank and in every call."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


_TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(2468),
                       dtype=torch.float64) / IN ** 0.5


def make_batch(rank: int, step: int, batch: int = 16):
    """Rank- and step-dependent inputs (scaled by (1 + rank) / 2), targets from a fixed teacher."""
    g = torch.Generator().manual_seed(1009 * rank + step)
    x = torch.randn(batch, IN, generator=g, dtype=torch.float64) * (1 + rank) / 2
    y = torch.tanh(x @ _TEACHER) + 0.05 * torch.randn(batch, OUT, generator=g, dtype=torch.float64)
    return x.float(), y.float()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def wrap_ddp(model: nn.Module) -> DDP:
    dist._DEFAULT_FIRST_BUCKET_BYTES = BUCKET_BYTES
    return DDP(model, bucket_cap_mb=BUCKET_BYTES / 2 ** 20)


# ---- subgroups on CPU torch --------------------------------------------------------------------

_SUBGROUPS: Dict[int, Any] = {}


def make_subgroups(group_size: int):
    """(the subgroup holding this rank, all subgroups) for consecutive blocks of `group_size`
    ranks, as dist.new_subgroups(group_size) builds them; cached per size (new_group is a
    collective over the world: every rank creates every block, in the same order)."""
    if group_size not in _SUBGROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        groups, mine = [], None
        for start in range(0, world, group_size):
            ranks = list(range(start, start + group_size))
            g = dist.new_group(ranks=ranks)
            groups.append(g)
            if rank in ranks:
                mine = g
        _SUBGROUPS[group_size] = (mine, groups)
    return _SUBGROUPS[group_size]


@contextlib.contextmanager
def cpu_new_subgroups():
    """dist.new_subgroups replaced by make_subgroups while torch's HierarchicalModelAverager is
    constructed, where torch's own raises ValueError without CUDA (1.13); torch's own otherwise."""
    if tc.NEW_SUBGROUPS_WITHOUT_CUDA:
        yield
        return
    original = dist.new_subgroups

    def new_subgroups(group_size=None, group=None, **kwargs):
        assert group_size is not None and group in (None, dist.group.WORLD)
        return make_subgroups(group_size)

    dist.new_subgroups = new_subgroups
    try:
        yield
    finally:
        dist.new_subgroups = original


# ---- configurations -----------------------------------------------------------------------------
#
# A config is a dict:
#   impl: "torch" | "ddpx" | "ddp" (plain DDP allreduce, plain optimizer, no averaging)
#   mode: "dropin" | "native" (ddpx hook registration)
#   driver: "optim" (PostLocalSGDOptimizer) | "averager" (averager.average_parameters(params))
#   averager: "periodic" | "hierarchical"; hier: {period: group size} for the latter
#   subgroup: size of the hook's subgroup; allreduce: post_local_gradient_allreduce
#   bucket_cap_mb: ddpx averager bucket cap; sched: (step_size, gamma) of a StepLR, or None

def cfg(impl: str, **kw) -> Dict[str, Any]:
    c = {"impl": impl, "mode": "dropin", "driver": "optim", "averager": "periodic",
         "subgroup": 2, "allreduce": True, "start": START, "period": PERIOD, "warmup": START,
         "hier": None, "bucket_cap_mb": None, "sched": None}
    c.update(kw)
    return c


def make_state(c: Dict[str, Any]):
    # subgroup None: ddpx creates the intra-node subgroups (by host name without CUDA)
    sub = None if c["subgroup"] is None else make_subgroups(c["subgroup"])[0]
    if c["impl"] == "torch":
        return tpl.PostLocalSGDState(process_group=None, subgroup=sub,
                                     start_localSGD_iter=c["start"],
                                     post_local_gradient_allreduce=c["allreduce"])
    return ddpx.hooks.PostLocalSGDState(process_group=None, subgroup=sub,
                                        start_localSGD_iter=c["start"],
                                        post_local_gradient_allreduce=c["allreduce"])


def register(ddp: DDP, c: Dict[str, Any], state: Any) -> None:
    if c["impl"] == "torch":
        ddp.register_comm_hook(state, tpl.post_localSGD_hook)
    elif c["mode"] == "native":
        ddpx.register_comm_hook(ddp, state, ddpx.hooks.post_localSGD_hook)
    else:
        ddp.register_comm_hook(state, ddpx.hooks.post_localSGD_hook)


def make_averager(c: Dict[str, Any]):
    extra = {} if c["bucket_cap_mb"] is None else {"bucket_cap_mb": c["bucket_cap_mb"]}
    if c["averager"] == "hierarchical":
        sizes = OrderedDict(c["hier"])
        if c["impl"] == "torch":
            with cpu_new_subgroups():
                return thier.HierarchicalModelAverager(sizes, warmup_steps=c["warmup"])
        return ddpx.model_averaging.HierarchicalModelAverager(sizes, warmup_steps=c["warmup"],
                                                              **extra)
    if c["impl"] == "torch":
        return tavg.PeriodicModelAverager(period=c["period"], warmup_steps=c["warmup"])
    return ddpx.model_averaging.PeriodicModelAverager(period=c["period"],
                                                      warmup_steps=c["warmup"], **extra)


class Run:
    """One training set-up: DDP model, hook state, local optimizer, averager, optimizer wrapper,
    optional StepLR."""

    def __init__(self, c: Dict[str, Any]):
        self.c = c
        self.ddp = wrap_ddp(make_model())
        self.state = None
        self.averager = None
        self.local = torch.optim.SGD(self.ddp.parameters(), lr=LR, momentum=MOMENTUM)
        self.opt = self.local
        if c["impl"] != "ddp":
            self.state = make_state(c)
            register(self.ddp, c, self.state)
            self.averager = make_averager(c)
            if c["driver"] == "optim":
                cls = (TorchPostLocalSGDOptimizer if c["impl"] == "torch"
                       else ddpx.optim.PostLocalSGDOptimizer)
                self.opt = cls(self.local, self.averager)
        self.sched = None
        if c["sched"] is not None:
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=c["sched"][0],
                                                         gamma=c["sched"][1])

    def step(self, rank: int, i: int) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = loss_fn(self.ddp, *make_batch(rank, i))
        loss.backward()
        self.opt.step()
        if self.c["driver"] == "averager" and self.averager is not None:
            self.averager.average_parameters(self.ddp.parameters())
        if self.sched is not None:
            self.sched.step()
        return loss.item()

    def steps(self, rank: int, start: int, stop: int) -> List[torch.Tensor]:
        """Steps start..stop-1; the flat parameters after each."""
        params = []
        for i in range(start, stop):
            self.step(rank, i)
            params.append(flat_params(self.ddp))
        return params

    def checkpoint(self) -> bytes:
        ck = {"model": self.ddp.module.state_dict(), "opt": self.opt.state_dict()}
        # torch's PostLocalSGDState has no state_dict(): its iter is what a resume needs
        ck["hook"] = (self.state.state_dict() if self.c["impl"] == "ddpx"
                      else {"iter": self.state.iter})
        if self.sched is not None:
            ck["sched"] = self.sched.state_dict()
        buf = io.BytesIO()
        torch.save(ck, buf)
        return buf.getvalue()

    def restore(self, blob: bytes, hook: bool = True, step: bool = True) -> None:
        """Loads checkpoint() into this (fresh) run; the model's state is loaded after DDP's
        construction (DDP broadcasts rank 0's parameters when it wraps a module, and the
        replicas may differ at a checkpoint taken during local SGD)."""
        ck = torch.load(io.BytesIO(blob))
        self.ddp.module.load_state_dict(ck["model"])
        if not step:
            del ck["opt"]["step"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.opt.load_state_dict(ck["opt"])
        if hook and self.c["impl"] == "ddpx":
            self.state.load_state_dict(ck["hook"])
        elif hook:
            self.state.iter = ck["hook"]["iter"]
        if self.sched is not None:
            self.sched.load_state_dict(ck["sched"])


def train(rank: int, c: Dict[str, Any], steps: int = STEPS) -> Dict[str, Any]:
    """Parameters after every step, hook iter and averager step after every step, losses, lrs."""
    run = Run(c)
    params, iters, avg_steps, losses, lrs = [], [], [], [], []
    for i in range(steps):
        losses.append(run.step(rank, i))
        params.append(flat_params(run.ddp))
        iters.append(run.state.iter if run.state is not None else None)
        avg_steps.append(run.averager.step if run.averager is not None else None)
        lrs.append(run.local.param_groups[0]["lr"])
    out = {"params": torch.stack(params), "iters": iters, "avg_steps": avg_steps,
           "losses": torch.tensor(losses, dtype=torch.float64), "lrs": lrs}
    if run.averager is not None and c["impl"] == "ddpx":
        out["last_stats"] = dict(run.averager.last_stats)
    return out


def resume(rank: int, c: Dict[str, Any], save_at: int, steps: int = STEPS,
           how: str = "state_dict") -> Dict[str, Any]:
    """Uninterrupted run against the same run checkpointed after `save_at` steps and resumed in
    a fresh DDP / optimizer / averager / hook state. how: "state_dict" (hook state through
    state_dict()/load_state_dict()), "pickle" (the hook state object pickled, its groups set
    again), and two controls that must NOT reproduce the trajectory: "no_hook_state" (fresh hook
    state, iter 0) and "no_step" (optimizer state without the averager's step)."""
    full = Run(c)
    full_params = full.steps(rank, 0, steps)

    first = Run(c)
    resumed = first.steps(rank, 0, save_at)
    blob = first.checkpoint()
    pickled = pickle.dumps(first.state) if how == "pickle" else None
    del first

    if how == "pickle":
        state = pickle.loads(pickled)
        state.process_group = None
        state.subgroup = make_subgroups(c["subgroup"])[0]
        second = Run(dict(c, impl="ddp"))  # a DDP model and SGD, no hook
        register(second.ddp, c, state)
        second.c, second.state = c, state
        second.averager = make_averager(c)
        second.opt = ddpx.optim.PostLocalSGDOptimizer(second.local, second.averager)
        second.restore(blob, hook=False)
    else:
        second = Run(c)
        second.restore(blob, hook=how != "no_hook_state", step=how != "no_step")
    restored = {"iter": second.state.iter, "avg_step": second.averager.step}
    resumed += second.steps(rank, save_at, steps)
    return {"full": torch.stack(full_params), "resumed": torch.stack(resumed),
            "restored": restored, "full_iter": full.state.iter, "full_avg_step": full.averager.step}


# ---- PostLocalSGDOptimizer behaviour ------------------------------------------------------------

def optimizer_behaviour(rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    model = make_model()
    ddp = wrap_ddp(model)
    state = ddpx.hooks.PostLocalSGDState(None, make_subgroups(2)[0], start_localSGD_iter=2)
    ddp.register_comm_hook(state, ddpx.hooks.post_localSGD_hook)
    local = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    averager = ddpx.model_averaging.PeriodicModelAverager(period=2, warmup_steps=2)
    opt = ddpx.optim.PostLocalSGDOptimizer(local, averager)
    out["isinstance_optimizer"] = isinstance(opt, torch.optim.Optimizer)
    out["param_groups_shared"] = opt.param_groups is local.param_groups
    out["state_shared"] = opt.state is local.state
    out["optim_attr"] = getattr(opt, "optim", None) is local
    out["averager_attr"] = getattr(opt, "averager", None) is averager
    for i in range(5):
        opt.zero_grad()
        loss_fn(ddp, *make_batch(rank, i)).backward()
        opt.step()
    out["avg_step"] = averager.step
    sd = opt.state_dict()
    out["sd_keys"] = sorted(sd.keys())
    out["sd_step"] = sd.get("step")
    out["sd_state_equal_local"] = _same_optim_state(sd, local.state_dict())

    # zero_grad
    loss_fn(ddp, *make_batch(rank, 9)).backward()
    opt.zero_grad(set_to_none=False)
    out["zero_grad_false"] = [None if p.grad is None else float(p.grad.abs().sum())
                              for p in ddp.parameters()]
    loss_fn(ddp, *make_batch(rank, 9)).backward()
    opt.zero_grad(set_to_none=True)
    out["zero_grad_true"] = [p.grad is None for p in ddp.parameters()]

    # load_state_dict: with step, without step (warns, sets 0)
    averager.step = 123
    opt.load_state_dict(sd)
    out["loaded_step"] = averager.step
    no_step = {k: v for k, v in sd.items() if k != "step"}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.load_state_dict(no_step)
    out["no_step_warnings"] = [str(x.message) for x in w]
    out["no_step_step"] = averager.step
    # torch's wrapper, for the same inputs
    t_avg = tavg.PeriodicModelAverager(period=2, warmup_steps=2)
    t_opt = TorchPostLocalSGDOptimizer(torch.optim.SGD(make_model().parameters(), lr=LR,
                                                       momentum=MOMENTUM), t_avg)
    t_avg.step = 5
    t_sd = t_opt.state_dict()
    out["torch_sd_keys"] = sorted(t_sd.keys())
    out["torch_sd_step"] = t_sd["step"]

    # After load_state_dict (which rebinds the wrapped optimizer's param_groups to new dicts),
    # the wrapper's param_groups must still be the wrapped optimizer's, so that an LR scheduler
    # on the wrapper still drives the wrapped optimizer. Also recorded for torch's wrapper.
    for name, wrapper, inner in (("ddpx", opt, local), ("torch", t_opt, t_opt.optim)):
        wrapper.load_state_dict(wrapper.state_dict())
        shared = wrapper.param_groups is inner.param_groups
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
            sched = torch.optim.lr_scheduler.StepLR(wrapper, step_size=1, gamma=0.1)
            sched.step()
        out[f"after_load/{name}"] = (shared, inner.param_groups[0]["lr"])

    # add_param_group reaches the wrapped optimizer
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    out["add_param_group"] = (len(local.param_groups), local.param_groups[-1]["lr"],
                              local.param_groups[-1]["params"][0] is extra)
    return out


def _same_optim_state(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k in a["state"]:
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v, w):
                    return False
            elif v != w:
                return False
    return True


def averager_param_groups(rank: int) -> Dict[str, Any]:
    """The averagers take optimizer param_groups (dicts) as well as parameters: same result as
    torch's from the same rank-dependent values; parameters without a gradient are skipped."""
    out = {}
    for impl in ("torch", "ddpx"):
        for kind in ("groups", "params"):
            torch.manual_seed(100 + rank)  # rank-dependent parameters
            a = nn.Parameter(torch.randn(7, 5))
            b = nn.Parameter(torch.randn(11))
            frozen = nn.Parameter(torch.randn(4))   # no gradient: skipped
            for p in (a, b):
                p.grad = torch.zeros_like(p)
            opt = torch.optim.SGD([{"params": [a]}, {"params": [b, frozen], "lr": 0.1}], lr=0.01)
            if impl == "torch":
                av = tavg.PeriodicModelAverager(period=2, warmup_steps=0)
            else:
                av = ddpx.model_averaging.PeriodicModelAverager(period=2, warmup_steps=0)
            arg = opt.param_groups if kind == "groups" else [a, b, frozen]
            ptrs = [a.data_ptr(), b.data_ptr()]
            av.average_parameters(arg)   # step 0: averages
            snap = [a.detach().clone(), b.detach().clone(), frozen.detach().clone()]
            with torch.no_grad():
                a.add_(rank)
            av.average_parameters(arg)   # step 1: does not average
            out[f"{impl}/{kind}"] = {"after0": snap, "a_after1": a.detach().clone(),
                                     "step": av.step,
                                     "inplace": [a.data_ptr(), b.data_ptr()] == ptrs}
    return out


# ---- average_parameters directly ---------------------------------------------------------------

def _mixed_params(rank: int, seed: int = 0) -> List[torch.Tensor]:
    """fp32 and fp64 tensors of assorted sizes, rank-dependent values."""
    g = torch.Generator().manual_seed(31 * rank + seed)
    shapes = [((33,), torch.float32), ((64, 16), torch.float64), ((5, 7), torch.float32),
              ((700,), torch.float32), ((3,), torch.float64), ((128, 8), torch.float32),
              ((1,), torch.float32), ((300,), torch.float64)]
    return [(torch.randn(s, generator=g, dtype=torch.float64) * (1 + rank)).to(dt)
            for s, dt in shapes]


def _fp32_params(rank: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(17 * rank + 3)
    return [torch.randn(s, generator=g) * (1 + rank) for s in [(40,), (16, 16), (900,), (2,)]]


def average_direct(rank: int, world_size: int) -> Dict[str, Any]:
    """ddpx.model_averaging.average_parameters against torch's utils.average_parameters on the
    same rank-dependent inputs: mixed fp32/fp64, all fp32, default and tiny bucket caps, a
    non-contiguous parameter; in-place (storage kept); last_stats of an averager; a group this
    rank is not a member of (4 ranks)."""
    out: Dict[str, Any] = {}
    tiny_mb = 1024 / 2 ** 20  # 1 KiB buckets: forces packing and chunking
    for name, make in (("mixed", _mixed_params), ("fp32", _fp32_params)):
        ref = [t.clone() for t in make(rank)]
        tutils.average_parameters(iter(ref), None)
        out[f"{name}/torch"] = ref
        for cap_name, cap in (("default", None), ("tiny", tiny_mb)):
            mine = make(rank)
            ptrs = [t.data_ptr() for t in mine]
            kw = {} if cap is None else {"bucket_cap_mb": cap}
            ddpx.model_averaging.average_parameters(mine, None, **kw)
            out[f"{name}/{cap_name}"] = mine
            out[f"{name}/{cap_name}/inplace"] = [t.data_ptr() for t in mine] == ptrs
            out[f"{name}/{cap_name}/dtypes"] = [t.dtype for t in mine]
    # A non-contiguous tensor (a transposed view) bigger than a tiny bucket.
    base = torch.randn(40, 30, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    ref = base.t().clone()
    tutils.average_parameters(iter([ref]), None)
    view = base.t()
    ddpx.model_averaging.average_parameters([view], None, bucket_cap_mb=tiny_mb)
    out["noncontig"] = (view.clone(), ref, base.data_ptr() == view.data_ptr())

    # A 2M-element parameter listed twice (dividing it while the other copy's allreduce is in
    # flight puts values far off the mean). Torch's averager averages it correctly: so must
    # ddpx's, through the averager and average_parameters.
    big = torch.randn(2_000_000, generator=torch.Generator().manual_seed(100 + rank))
    ref = nn.Parameter(big.clone())
    ref.grad = torch.zeros_like(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tavg.PeriodicModelAverager(period=2, warmup_steps=0).average_parameters([ref, ref])
    twice = nn.Parameter(big.clone())
    twice.grad = torch.zeros_like(twice)
    ddpx.model_averaging.PeriodicModelAverager(period=2, warmup_steps=0).average_parameters(
        [twice, twice])
    view = big.clone()
    ddpx.model_averaging.average_parameters([view, view[10:1010], view], None)
    out["duplicate"] = {"torch": ref.detach().clone(), "averager": twice.detach().clone(),
                        "views": view}
    # period / warmup_steps changed mid-run: the same schedule as torch's averager.
    schedule = {}
    for impl, make in (("torch", tavg.PeriodicModelAverager),
                       ("ddpx", ddpx.model_averaging.PeriodicModelAverager)):
        av = make(period=2, warmup_steps=0)
        p = nn.Parameter(torch.zeros(3))
        p.grad = torch.zeros(3)
        steps = []
        for step in range(12):
            if step == 4:
                av.period = 3
            if step == 9:
                av.warmup_steps = 10
            with torch.no_grad():
                p.fill_(float(rank + step))
            av.average_parameters([p])
            if p[0].item() != float(rank + step):
                steps.append(step)
        schedule[impl] = steps
    out["schedule"] = schedule

    # Ranks passing different parameters (Gloo would abort the process if they reached it): a
    # ValueError on every rank, and the group stays usable (the calls below still run).
    out["mismatch"] = catch(
        lambda: ddpx.model_averaging.average_parameters([torch.ones(10 + rank)], None))

    # last_stats through an averager, with a tiny and the default cap.
    for cap_name, cap in (("tiny", tiny_mb), ("default", None)):
        kw = {} if cap is None else {"bucket_cap_mb": cap}
        av = ddpx.model_averaging.PeriodicModelAverager(period=2, warmup_steps=0, **kw)
        params = [nn.Parameter(t) for t in _mixed_params(rank, seed=5)]
        for p in params:
            p.grad = torch.zeros_like(p)
        av.average_parameters(params)
        out[f"stats/{cap_name}"] = dict(av.last_stats)
        av.average_parameters(params)   # step 1: no averaging
        out[f"stats/{cap_name}/idle"] = dict(av.last_stats)
    out["mixed_bytes"] = [t.numel() * t.element_size() for t in _mixed_params(rank, seed=5)]

    # get_params_to_average / average_parameters_or_parameter_groups
    ps = [nn.Parameter(torch.full((3,), float(rank))) for _ in range(3)]
    ps[0].grad = torch.zeros(3)
    ps[2].grad = torch.zeros(3)
    sel = ddpx.model_averaging.get_params_to_average(ps)
    out["get_params_to_average"] = [any(s is p for s in sel) for p in ps]
    ddpx.model_averaging.average_parameters_or_parameter_groups(ps, None)
    out["or_groups"] = [p.detach().clone() for p in ps]

    if world_size == 4:
        # Group {0, 1}: ranks 2 and 3 are not members (torch: NON_GROUP_MEMBER), nothing happens.
        pair = dist.new_group(ranks=[0, 1])
        mine = _fp32_params(rank)
        before = [t.clone() for t in mine]
        ddpx.model_averaging.average_parameters(mine, pair)
        ref = [t.clone() for t in before]
        tutils.average_parameters(iter(ref), pair)
        out["pair"] = {"before": before, "ddpx": mine, "torch": ref}
    return out


# ---- errors and warnings ------------------------------------------------------------------------

def _outcome(fn) -> Tuple[Optional[str], Optional[str], List[str]]:
    """(exception type name or None, message, warning categories+messages)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        exc = catch(fn) or (None, None)
    return exc[0], exc[1], [f"{x.category.__name__}: {x.message}" for x in w]


def errors(rank: int, world_size: int) -> Dict[str, Any]:
    M = ddpx.model_averaging
    od = OrderedDict
    cases = {
        "period0": (lambda: tavg.PeriodicModelAverager(0), lambda: M.PeriodicModelAverager(0)),
        "period-1": (lambda: tavg.PeriodicModelAverager(-1), lambda: M.PeriodicModelAverager(-1)),
        "warmup-1": (lambda: tavg.PeriodicModelAverager(2, warmup_steps=-1),
                     lambda: M.PeriodicModelAverager(2, warmup_steps=-1)),
        "period1": (lambda: tavg.PeriodicModelAverager(1), lambda: M.PeriodicModelAverager(1)),
        "period2": (lambda: tavg.PeriodicModelAverager(2), lambda: M.PeriodicModelAverager(2)),
        "hier_empty": (lambda: thier.HierarchicalModelAverager(od()),
                       lambda: M.HierarchicalModelAverager(od())),
        "hier_none": (lambda: thier.HierarchicalModelAverager(None),
                      lambda: M.HierarchicalModelAverager(None)),
        "hier_period0": (lambda: thier.HierarchicalModelAverager(od({0: world_size})),
                         lambda: M.HierarchicalModelAverager(od({0: world_size}))),
        "hier_last_size": (lambda: thier.HierarchicalModelAverager(od({2: 1, 4: 1})),
                           lambda: M.HierarchicalModelAverager(od({2: 1, 4: 1}))),
        "hier_warmup-1": (lambda: thier.HierarchicalModelAverager(od({2: world_size}), -1),
                          lambda: M.HierarchicalModelAverager(od({2: world_size}), -1)),
        "hier_max_period1": (lambda: thier.HierarchicalModelAverager(od({1: world_size})),
                             lambda: M.HierarchicalModelAverager(od({1: world_size}))),
        "hier_ok": (lambda: thier.HierarchicalModelAverager(od({4: world_size})),
                    lambda: M.HierarchicalModelAverager(od({4: world_size}))),
    }
    out = {}
    for name, (t, d) in cases.items():
        out[name] = {"torch": _outcome(t), "ddpx": _outcome(d)}
    out["state_start-1"] = _outcome(
        lambda: ddpx.hooks.PostLocalSGDState(None, make_subgroups(1)[0], start_localSGD_iter=-1))

    # Warm-up mismatch: hook start 6, averager warmup 4 -> ValueError at the first averaging call
    # (the averager directly, and through the optimizer). Matching values: no error.
    for name, warmup, driver in (("mismatch_averager", 4, "averager"),
                                 ("mismatch_optim", 4, "optim"),
                                 ("match_optim", START, "optim")):
        c = cfg("ddpx", warmup=warmup, driver=driver, subgroup=1)
        run = Run(c)

        def go():
            for i in range(3):
                run.step(rank, i)
        out[name] = _outcome(go)
        out[name + "/avg_step"] = run.averager.step
    return out


# ---- PostLocalSGDState ---------------------------------------------------------------------------

def state_checks(rank: int) -> Dict[str, Any]:
    sub = make_subgroups(1)[0]
    s = ddpx.hooks.PostLocalSGDState(None, sub, start_localSGD_iter=5,
                                     post_local_gradient_allreduce=False)
    out: Dict[str, Any] = {
        "attrs": (s.process_group is None or s.process_group == dist.group.WORLD,
                  s.subgroup is sub, s.start_localSGD_iter, s.post_local_gradient_allreduce,
                  s.iter),
        "default_allreduce":
            ddpx.hooks.PostLocalSGDState(None, sub, 3).post_local_gradient_allreduce,
    }
    s.iter = 3
    out["iter_set"] = s.iter
    out["has_maybe_increase_iter"] = callable(getattr(s, "maybe_increase_iter", None))
    sd = s.state_dict()
    out["state_dict"] = dict(sd)
    t = ddpx.hooks.PostLocalSGDState(None, sub, start_localSGD_iter=9)
    t.load_state_dict(sd)
    out["loaded"] = (t.iter, t.start_localSGD_iter, t.post_local_gradient_allreduce)
    u = pickle.loads(pickle.dumps(s))
    out["unpickled"] = (u.iter, u.start_localSGD_iter, u.post_local_gradient_allreduce)
    out["bad_load"] = _outcome(lambda: t.load_state_dict({"iter": 1}))

    # iter counted by maybe_increase_iter(bucket) in a Python hook, against torch's state in the
    # same run (both fed the same buckets; 6 passes, below start_localSGD_iter).
    ts = tpl.PostLocalSGDState(None, sub, start_localSGD_iter=10)
    ds = ddpx.hooks.PostLocalSGDState(None, sub, start_localSGD_iter=10)
    seen = []

    def hook(state, bucket):
        ts.maybe_increase_iter(bucket)
        ds.maybe_increase_iter(bucket)
        seen.append((ts.iter, ds.iter))
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))

    ddp = wrap_ddp(make_model())
    ddp.register_comm_hook(None, hook)
    for i in range(6):
        ddp.zero_grad()
        loss_fn(ddp, *make_batch(rank, i)).backward()
    out["maybe_increase_iter"] = seen
    return out


# ---- one launch, several checks ----------------------------------------------------------------

def rank_cases(rank: int, world_size: int, cases: Sequence[Tuple[str, str, Dict[str, Any]]]
               ) -> Dict[str, Any]:
    """Runs each (name, function name, kwargs) in turn; a case that raises yields
    {"error": traceback} (the ranks are then likely out of step: later cases may fail too)."""
    fns = {"train": train, "resume": resume, "optimizer_behaviour": optimizer_behaviour,
           "averager_param_groups": averager_param_groups, "state_checks": state_checks}
    out = {}
    for name, fn, kwargs in cases:
        try:
            if fn in ("average_direct", "errors"):
                out[name] = globals()[fn](rank, world_size, **kwargs)
            else:
                out[name] = fns[fn](rank, **kwargs)
        except Exception:  # noqa: BLE001 - reported to the test that reads this case
            out[name] = {"error": traceback.format_exc()}
    return out
