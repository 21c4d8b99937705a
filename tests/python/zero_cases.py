"""Shared pieces of the ZeroRedundancyOptimizer tests (test_zero.py): which implementation is
under test, a small MLP, rank-dependent data, the optimizer configurations, torch's sorted-greedy
partition, and the rank functions that run ddpx's (or torch's) ZeRO side by side with torch's.

    DDPX_ZERO_IMPL=ddpx   (default) ddpx.optim.ZeroRedundancyOptimizer is the implementation
    DDPX_ZERO_IMPL=torch  torch.distributed.optim.ZeroRedundancyOptimizer is: the suite then
                          checks itself (every test about torch's behaviour must pass with it)

Rank functions run inside the ranks started by dist_utils.run_ranks. Each differential check
builds one model, deep-copies it for the implementation under test and for the reference (torch's
ZeRO, or DDP with an unsharded optimizer), and runs both in the same rank process on the same
data, one after the other; the trajectories (all parameters, flattened, before the first and
after every step) travel back and are compared in the pytest process. `rank_cases` runs many
named checks in one launch; a check that raises returns {"error": traceback} instead, so that the
test reading it fails with that traceback while the others still pass.

ddpx is imported lazily (zero_cls), so that the torch run works without ddpx's class.
"""
import copy
import os
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import catch

IMPL = os.environ.get("DDPX_ZERO_IMPL", "ddpx")
assert IMPL in ("ddpx", "torch"), f"DDPX_ZERO_IMPL must be 'ddpx' or 'torch', not {IMPL!r}"


def torch_zero_cls():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer


def zero_cls(impl: Optional[str] = None):
    """The ZeroRedundancyOptimizer class under test: torch's with impl == "torch", else ddpx's
    (imported here, not at module import time)."""
    if (impl or IMPL) == "torch":
        return torch_zero_cls()
    from ddpx.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer


# ---- optimizers --------------------------------------------------------------------------------

# name -> (optimizer class, constructor keyword arguments)
OPTS: Dict[str, Tuple[type, Dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "sgd_wd": (torch.optim.SGD, dict(lr=0.05, momentum=0.5, dampening=0.1, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam_wd_amsgrad": (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2,
                                               amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=5e-2)),
    "adamw_amsgrad_maximize": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, maximize=True)),
    # elementwise: ddpx's C++ step from torch's state (Adagrad's from the first step)
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05)),
}

# The optimizers ddpx steps with its own fused C++ kernels: there its results may differ from
# torch's by rounding (bounded by FUSED_RTOL relative to the largest |value|); every other
# optimizer runs its own step() and must give torch's results bit for bit.
FUSED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
         torch.optim.RMSprop)
FUSED_RTOL = 1e-6
# Centered RMSprop divides by sqrt(square_avg - grad_avg**2), a difference of near-equal numbers
# that amplifies rounding. torch 2.x's CPU sqrt is not always correctly rounded (ddpx's is; with a
# correctly rounded sqrt torch's steps equal ddpx's bit for bit: test_functional_optim's bitwise
# tests), and its 1-ulp differences grow to 1.5e-6 within 4-5 steps of these cases.
CENTERED_RMSPROP_RTOL = 5e-6


def fused_rtol(opt: str) -> float:
    """The rel_err allowed between ddpx's fused step of optimizer `opt` and torch's."""
    return CENTERED_RMSPROP_RTOL if OPTS[opt][1].get("centered") else FUSED_RTOL


def tolerance(opt: str, impl: Optional[str] = None) -> float:
    """The largest rel_err allowed between the implementation and torch for optimizer `opt`: 0
    (bit for bit) unless ddpx runs it through its fused kernels."""
    cls = OPTS[opt][0]
    return fused_rtol(opt) if (impl or IMPL) != "torch" and cls in FUSED else 0.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 when equal; inf for a shape mismatch)."""
    if a.shape != b.shape:
        return float("inf")
    if torch.equal(a, b):
        return 0.0
    diff = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return diff / scale if scale > 0 else float("inf")


class ScaledSGD(torch.optim.Optimizer):
    """Plain SGD whose step() takes an extra keyword (scale): for step(**kwargs) forwarding. Not a
    subclass of SGD, so that any ZeRO runs its own step()."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None, scale=1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)
                    self.state[p]["last_scale"] = torch.tensor(float(scale))
        return loss


# ---- model and data ----------------------------------------------------------------------------

IN, OUT, BATCH = 12, 4, 8
STEPS = 5


class Net(nn.Module):
    """12-32-32-16-4 tanh MLP (2116 parameters in 8 tensors of 7 distinct sizes). kind="frozen"
    adds fc2.bias.requires_grad = False and an `unused` Linear(8, 8) that forward() never calls (so
    its parameters keep grad None; its weight ties fc4.weight at 64 elements)."""

    def __init__(self, kind: str = "plain"):
        super().__init__()
        self.fc1 = nn.Linear(IN, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 16)
        self.fc4 = nn.Linear(16, OUT)
        if kind == "frozen":
            self.fc2.bias.requires_grad_(False)
            self.unused = nn.Linear(8, 8)
        else:
            assert kind == "plain", kind

    def forward(self, x):
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        x = torch.tanh(self.fc3(x))
        return self.fc4(x)


def make_model(kind: str = "plain", seed: int = 0) -> Net:
    """The same weights on every rank and in every call."""
    torch.manual_seed(seed)
    return Net(kind)


_TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(4242)) / IN ** 0.5


def make_batch(rank: int, step: int, world_size: int = 0):
    """Rank- and step-dependent inputs (scaled by (1 + rank) / 2), targets from a fixed teacher."""
    g = torch.Generator().manual_seed(7919 * rank + 101 * step + 13 * world_size)
    x = torch.randn(BATCH, IN, generator=g) * (1 + rank) / 2
    y = torch.tanh(x @ _TEACHER) + 0.1 * torch.randn(BATCH, OUT, generator=g)
    return x, y


def loss_of(model: nn.Module, rank: int, step: int, world_size: int = 0) -> torch.Tensor:
    x, y = make_batch(rank, step, world_size)
    return nn.functional.mse_loss(model(x), y)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def param_spans(model: nn.Module) -> List[Tuple[str, int, int]]:
    """(name, start, end) of each parameter in flat_params(model)."""
    spans, start = [], 0
    for name, p in model.named_parameters():
        spans.append((name, start, start + p.numel()))
        start += p.numel()
    return spans


def param_groups_of(model: Net, opt: str, groups: bool):
    """ZeRO's `params`: the parameter list, or two groups with their own lr (half and twice the
    default): fc1 + fc2, then the rest."""
    params = list(model.parameters())
    if not groups:
        return params
    lr = OPTS[opt][1]["lr"]
    first = list(model.fc1.parameters()) + list(model.fc2.parameters())
    ids = {id(p) for p in first}
    return [{"params": first, "lr": lr * 0.5},
            {"params": [p for p in params if id(p) not in ids], "lr": lr * 2}]


def local_partition(zero, model: nn.Module) -> List[List[int]]:
    """zero.optim.param_groups as lists of indices into list(model.parameters()) (by identity)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in g["params"]] for g in zero.optim.param_groups]


def greedy_partition(groups: Sequence[Sequence[Tuple[int, int]]], world_size: int
                     ) -> List[List[List[int]]]:
    """torch's sorted-greedy partition: for each group in turn, its parameters (index, numel)
    sorted by numel, largest first (a stable sort: equal sizes keep their order), each to the rank
    with the smallest running total (carried across groups; ties to the lowest rank).
    Returns [rank][group] -> parameter indices, one (possibly empty) group per group per rank."""
    sizes = [0] * world_size
    out = [[] for _ in range(world_size)]
    for group in groups:
        per_rank = [[] for _ in range(world_size)]
        for index, numel in sorted(group, key=lambda t: t[1], reverse=True):
            rank = min(range(world_size), key=lambda r: (sizes[r], r))
            per_rank[rank].append(index)
            sizes[rank] += numel
        for rank in range(world_size):
            out[rank].append(per_rank[rank])
    return out


def group_numels(zero, model: nn.Module) -> List[List[Tuple[int, int]]]:
    """zero.param_groups as lists of (index into model.parameters(), numel)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[(index[id(p)], p.numel()) for p in g["params"]] for g in zero.param_groups]


def make_zero(impl: str, params, opt: str, bucket: bool = False, **extra):
    cls, kwargs = OPTS[opt]
    return zero_cls(impl)(params, optimizer_class=cls, parameters_as_bucket_view=bucket,
                          **{**kwargs, **extra})


def state_dict_of(zero):
    """A deep copy of zero.state_dict() (a state_dict() holds the live state tensors: on the target
    rank, torch's consolidated one holds its own shard's, which later steps would change), or
    (type name, message) of what it raised, so that every rank goes on with the same collectives
    whatever happens."""
    try:
        return copy.deepcopy(zero.state_dict())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)


def _train(model, zero, rank, world_size, steps, forward=None, on_step=None):
    """`steps` steps of zero_grad / backward / step; the trajectory [steps + 1, numel]."""
    forward = forward or model
    traj = [flat_params(model)]
    for s in range(steps):
        zero.zero_grad()
        loss_of(forward, rank, s, world_size).backward()
        zero.step()
        traj.append(flat_params(model))
        if on_step is not None:
            on_step(s)
    return torch.stack(traj)


# ---- rank functions ----------------------------------------------------------------------------

def diff(rank, world_size, impl, opt, bucket, kind, groups):
    """The implementation and torch's ZeRO over the same model and data (local gradients, no
    DDP: each rank's shard is updated with that rank's own gradients, so a wrong partition or a
    wrong broadcast source shows), STEPS steps."""
    base = make_model(kind)
    out = {"spans": param_spans(base)}
    for who, which in (("impl", impl), ("ref", "torch")):
        model = copy.deepcopy(base)
        zero = make_zero(which, param_groups_of(model, opt, groups), opt, bucket)
        out[f"{who}_partition"] = local_partition(zero, model)
        out[f"{who}_numels"] = group_numels(zero, model)
        out[f"{who}_lrs"] = [g["lr"] for g in zero.optim.param_groups]
        out[who] = _train(model, zero, rank, world_size, STEPS)
    return out


def ddp_diff(rank, world_size, impl, opt, bucket):
    """DDP + the implementation's ZeRO over ddp.parameters() against DDP + the unsharded
    optimizer, STEPS steps."""
    base = make_model("plain")
    out = {}
    for who in ("impl", "ref"):
        model = copy.deepcopy(base)
        ddp = DDP(model)
        cls, kwargs = OPTS[opt]
        if who == "impl":
            optim = make_zero(impl, ddp.parameters(), opt, bucket)
        else:
            optim = cls(ddp.parameters(), **kwargs)
        out[who] = _train(model, optim, rank, world_size, STEPS, forward=ddp)
    return out


def partition(rank, world_size, impl, sizes):
    """Parameters of the given sizes (a list of groups of sizes); only the partition is read."""
    out = {}
    for who, which in (("impl", impl), ("ref", "torch")):
        torch.manual_seed(0)
        tensors = [[nn.Parameter(torch.randn(n)) for n in group] for group in sizes]
        flat = [p for group in tensors for p in group]
        index = {id(p): i for i, p in enumerate(flat)}
        params = [{"params": g, "lr": 0.01 * (i + 1)} for i, g in enumerate(tensors)]
        zero = zero_cls(which)(params, optimizer_class=torch.optim.SGD, lr=0.1)
        out[who] = [[index[id(p)] for p in g["params"]] for g in zero.optim.param_groups]
        out[f"{who}_lrs"] = [g["lr"] for g in zero.optim.param_groups]
    return out


def sched(rank, world_size, impl, opt, bucket, steps=6):
    """StepLR(step_size=2, gamma=0.5) on the ZeRO optimizer, two groups; the lrs of the local
    optimizer's groups right after each step (the lrs that step used) and of ZeRO's own groups
    after each scheduler.step()."""
    base = make_model("plain")
    out = {}
    for who, which, use_sched in (("impl", impl, True), ("ref", "torch", True),
                                  ("nosched", impl, False)):
        model = copy.deepcopy(base)
        zero = make_zero(which, param_groups_of(model, opt, True), opt, bucket)
        scheduler = (torch.optim.lr_scheduler.StepLR(zero, step_size=2, gamma=0.5)
                     if use_sched else None)
        local, exposed = [], []

        def on_step(s):
            local.append([g["lr"] for g in zero.optim.param_groups])
            if scheduler is not None:
                scheduler.step()
            exposed.append([g["lr"] for g in zero.param_groups])

        out[who] = _train(model, zero, rank, world_size, steps, on_step=on_step)
        out[f"{who}_local_lrs"], out[f"{who}_lrs"] = local, exposed
    return out


def add_group(rank, world_size, impl, opt, bucket, before=2, after=3):
    """ZeRO over fc1 + fc2, `before` steps, add_param_group(fc3 + fc4, own lr), `after` steps."""
    base = make_model("plain")
    out = {"spans": param_spans(base)}
    lr = OPTS[opt][1]["lr"]
    for who, which in (("impl", impl), ("ref", "torch")):
        model = copy.deepcopy(base)
        first = list(model.fc1.parameters()) + list(model.fc2.parameters())
        rest = list(model.fc3.parameters()) + list(model.fc4.parameters())
        zero = make_zero(which, first, opt, bucket)
        out[f"{who}_partition_before"] = local_partition(zero, model)
        traj = _train(model, zero, rank, world_size, before)
        zero.add_param_group({"params": rest, "lr": lr / 4})
        out[f"{who}_partition"] = local_partition(zero, model)
        out[f"{who}_numels"] = group_numels(zero, model)
        out[f"{who}_ngroups"] = (len(zero.param_groups), len(zero.optim.param_groups))
        out[f"{who}_lrs"] = [g["lr"] for g in zero.optim.param_groups]
        # continue with the data of steps before .. before + after - 1
        traj2 = [flat_params(model)]
        for s in range(before, before + after):
            zero.zero_grad()
            loss_of(model, rank, s, world_size).backward()
            zero.step()
            traj2.append(flat_params(model))
        out[who] = torch.cat([traj, torch.stack(traj2)[1:]])
    return out


def join(rank, world_size, impl, opt, bucket):
    """Join([ddp, zero]) with uneven inputs: rank r runs 3 + r iterations."""
    from torch.distributed.algorithms.join import Join
    base = make_model("plain")
    out = {"init": flat_params(base)}
    for who, which in (("impl", impl), ("ref", "torch")):
        model = copy.deepcopy(base)
        ddp = DDP(model)
        zero = make_zero(which, ddp.parameters(), opt, bucket)
        with Join([ddp, zero]):
            for s in range(3 + rank):
                zero.zero_grad()
                loss_of(ddp, rank, s, world_size).backward()
                zero.step()
        out[who] = flat_params(model)
    return out


def closure_kwargs(rank, world_size, impl, bucket):
    """step(closure) returns the closure's loss; step(scale=...) reaches the local optimizer."""
    base = make_model("plain")
    out = {}
    for who, which in (("impl", impl), ("ref", "torch")):
        # closure, SGD with momentum
        model = copy.deepcopy(base)
        zero = make_zero(which, list(model.parameters()), "sgd_momentum", bucket)
        returned, computed, traj = [], [], [flat_params(model)]
        for s in range(3):
            def closure(s=s):
                zero.zero_grad()
                loss = loss_of(model, rank, s, world_size)
                loss.backward()
                computed.append(loss.detach().clone())
                return loss
            ret = zero.step(closure)
            returned.append(None if ret is None else torch.as_tensor(ret).detach().clone())
            traj.append(flat_params(model))
        out[f"{who}_closure"] = {"returned": returned, "computed": computed,
                                 "traj": torch.stack(traj)}
        # extra keyword arguments, a custom optimizer (no fused path)
        model = copy.deepcopy(base)
        zero = zero_cls(which)(list(model.parameters()), optimizer_class=ScaledSGD,
                               parameters_as_bucket_view=bucket, lr=0.1)
        traj, expected = [flat_params(model)], []
        for s, scale in enumerate((0.5, 2.0)):
            zero.zero_grad()
            loss_of(model, rank, s, world_size).backward()
            before = [p.detach().clone() for p in model.parameters()]
            mine = [p.grad.clone() for p in model.parameters()]
            zero.step(scale=scale)
            expected.append((before, mine))
            traj.append(flat_params(model))
        owned = {id(p) for g in zero.optim.param_groups for p in g["params"]}
        scales = [zero.optim.state[p]["last_scale"].item() for g in zero.optim.param_groups
                  for p in g["params"] if "last_scale" in zero.optim.state[p]]
        # my shard after the last step: p == before - lr * scale * my gradient, exactly
        before, mine = expected[-1]
        own_ok = [torch.equal(p.detach(), b.add(m, alpha=-0.1 * 2.0))
                  for p, b, m in zip(model.parameters(), before, mine) if id(p) in owned]
        out[f"{who}_kwargs"] = {"traj": torch.stack(traj), "scales": scales, "own_ok": own_ok,
                                "owned": len(owned)}
    return out


def ckpt(rank, world_size, impl, to, bucket, opt="adam_wd_amsgrad", steps=3):
    """DDP + ZeRO and DDP + torch's ZeRO and DDP + the unsharded optimizer, `steps` steps;
    consolidate_state_dict(to) and state_dict() on every rank (a RuntimeError off `to`)."""
    base = make_model("plain")
    out = {}
    cls, kwargs = OPTS[opt]
    for who, which in (("impl", impl), ("ref", "torch"), ("plain", None)):
        model = copy.deepcopy(base)
        ddp = DDP(model)
        optim = (cls(ddp.parameters(), **kwargs) if which is None
                 else make_zero(which, ddp.parameters(), opt, bucket))
        _train(model, optim, rank, world_size, steps, forward=ddp)
        if which is None:
            out[who] = state_dict_of(optim)
            continue
        optim.consolidate_state_dict(to=to)
        out[who] = state_dict_of(optim)
        # a second consolidation onto another rank works too
        optim.consolidate_state_dict(to=(to + 1) % world_size)
        out[f"{who}_other"] = state_dict_of(optim)
    return out


def save(rank, world_size, impl, path, opt="adam_wd_amsgrad", steps=3, bucket=False):
    """DDP + ZeRO `steps` steps, consolidated onto rank 0, saved to `path` with the model."""
    model = make_model("plain")
    ddp = DDP(model)
    zero = make_zero(impl, ddp.parameters(), opt, bucket)
    _train(model, zero, rank, world_size, steps, forward=ddp)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": zero.state_dict(),
                    "world_size": world_size}, path)
    return flat_params(model)


def deep_equal(a, b) -> bool:
    """Structural equality: same types, same keys in the same order, tensors equal (with dtype and
    shape)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b))
    return a == b


def load(rank, world_size, impl, path, opt="adam_wd_amsgrad", steps=3, bucket=False):
    """Loads a checkpoint from `save` (any world size) into DDP + ZeRO on this world size (built
    with a wrong lr, which the checkpoint overrides) and, as the reference, into DDP + the
    unsharded optimizer; `steps` more steps each. Also: the caller's dict after load_state_dict,
    the local optimizer's state, and a consolidation right after loading."""
    cls, kwargs = OPTS[opt]
    out = {}
    for who in ("impl", "plain"):
        ckpt_ = torch.load(path)
        model = make_model("plain")
        model.load_state_dict(ckpt_["model"])
        ddp = DDP(model)
        sd = ckpt_["optim"]
        if who == "plain":
            optim = cls(ddp.parameters(), **{**kwargs, "lr": 0.5})
            optim.load_state_dict(sd)
        else:
            optim = make_zero(impl, ddp.parameters(), opt, bucket, lr=0.5)
            snapshot = copy.deepcopy(sd)
            optim.load_state_dict(sd)
            out["unchanged"] = deep_equal(sd, snapshot)
            out["local_lrs"] = [g["lr"] for g in optim.optim.param_groups]
            index = {id(p): i for i, p in enumerate(model.parameters())}
            out["local_state"] = {index[id(p)]: {k: v.clone() if torch.is_tensor(v) else v
                                                 for k, v in optim.optim.state[p].items()}
                                  for g in optim.optim.param_groups for p in g["params"]
                                  if p in optim.optim.state}
            optim.consolidate_state_dict(to=0)
            out["reconsolidated"] = state_dict_of(optim)
        out[who] = _train(model, optim, rank, world_size, steps, forward=ddp)
    return out


def errors(rank, world_size, impl):
    """Bad constructor arguments: (type name, message) of what each implementation raised."""
    from torch.distributed.optim.utils import functional_optim_map
    functional_sgd = functional_optim_map[torch.optim.SGD]

    def p(*shape, dtype=torch.float32):
        return nn.Parameter(torch.randn(*shape, dtype=dtype))

    sparse = torch.eye(2).to_sparse().requires_grad_()
    cases = {
        "single_tensor": lambda: ([p(3, 3)][0], torch.optim.SGD, {}),
        "empty": lambda: ([], torch.optim.SGD, {}),
        "empty_generator": lambda: ((q for q in []), torch.optim.SGD, {}),
        "not_iterable": lambda: (42, torch.optim.SGD, {}),
        "mixed": lambda: ([p(3), {"params": [p(2)]}], torch.optim.SGD, {}),
        "no_params_key": lambda: ([{"params": [p(3)]}, {"lr": 0.1}], torch.optim.SGD, {}),
        "sparse_first": lambda: ([sparse, p(2, 2)], torch.optim.SGD, {}),
        "sparse_second": lambda: ([p(2, 2), sparse], torch.optim.SGD, {}),
        "mixed_dtypes": lambda: ([p(3), p(3, dtype=torch.float64)], torch.optim.SGD, {}),
        "mixed_dtypes_groups": lambda: ([{"params": [p(3)]},
                                         {"params": [p(3, dtype=torch.float64)]}],
                                        torch.optim.SGD, {}),
        "functional": lambda: ([p(3)], functional_sgd, {}),
        # ddpx-only (torch fails late, with unrelated messages)
        "class_is_str": lambda: ([p(3)], "SGD", {}),
        "class_is_instance": lambda: ([p(3)], torch.optim.SGD([p(1)], lr=0.1), {}),
        "class_not_optimizer": lambda: ([p(3)], dict, {}),
    }
    out = {}
    for name, make in cases.items():
        out[name] = {}
        for who, which in (("impl", impl), ("ref", "torch")):
            params, cls, extra = make()
            out[name][who] = catch(lambda: zero_cls(which)(params, optimizer_class=cls, lr=0.1,
                                                            **extra))
    return out


def subgroup(rank, world_size, impl, opt, bucket, members=(1, 3)):
    """ZeRO over a process group of some ranks only (group rank i = global rank members[i]),
    STEPS steps (local gradients), then consolidate_state_dict(to=1) (a group rank)."""
    group = dist.new_group(list(members))
    if rank not in members:
        return None
    base = make_model("frozen")
    out = {}
    for who, which in (("impl", impl), ("ref", "torch")):
        model = copy.deepcopy(base)
        zero = make_zero(which, list(model.parameters()), opt, bucket, process_group=group)
        out[f"{who}_partition"] = local_partition(zero, model)
        out[who] = _train(model, zero, rank, world_size, STEPS)
        zero.consolidate_state_dict(to=1)
        out[f"{who}_sd"] = state_dict_of(zero)
        out[f"{who}_group_ok"] = zero.join_process_group is group
    return out


def api(rank, world_size, impl):
    """Observable facts of a ZeRO built as in torch's example: its classes, join_device,
    join_process_group, the local optimizer's class, the exposed param_groups' keys, zero_grad()
    (default and set_to_none=False) on all parameters, step()'s return value."""
    from torch.distributed.algorithms.join import Joinable
    base = make_model("plain")
    out = {}
    for who, which in (("impl", impl), ("ref", "torch")):
        model = copy.deepcopy(base)
        zero = make_zero(which, list(model.parameters()), "adam")
        r = {
            "is_optimizer": isinstance(zero, torch.optim.Optimizer),
            "is_joinable": isinstance(zero, Joinable),
            "optim_is_adam": isinstance(zero.optim, torch.optim.Adam),
            "join_device": str(zero.join_device),
            "join_group_is_world": zero.join_process_group is dist.group.WORLD,
            "groups": [len(g["params"]) for g in zero.param_groups],
            "group_keys": sorted(zero.param_groups[0].keys()),
            "local_group_keys": sorted(zero.optim.param_groups[0].keys()),
        }
        grads = lambda: ["none" if p.grad is None else p.grad.abs().sum().item()  # noqa: E731
                         for p in model.parameters()]
        loss_of(model, rank, 0, world_size).backward()
        r["grads_before"] = grads()
        zero.zero_grad()
        r["zero_grad"] = grads()
        loss_of(model, rank, 0, world_size).backward()
        zero.zero_grad(set_to_none=False)
        r["zero_grad_false"] = grads()
        loss_of(model, rank, 0, world_size).backward()
        r["step_returns"] = repr(zero.step())
        group = dist.new_group(list(range(world_size)))
        other = make_zero(which, list(copy.deepcopy(base).parameters()), "adam",
                          process_group=group)
        r["explicit_group_ok"] = other.join_process_group is group
        out[who] = r
    return out


FNS = {f.__name__: f for f in (diff, ddp_diff, partition, sched, add_group, join,
                               closure_kwargs, ckpt, save, load, errors, subgroup, api)}


def rank_cases(rank: int, world_size: int, impl: str,
               cases: Sequence[Tuple[str, str, Dict[str, Any]]]) -> Dict[str, Any]:
    """Runs each (name, function name, kwargs) in turn; a case that raises yields
    {"error": traceback} (the ranks may then be out of step: later cases may fail too)."""
    out = {}
    for name, fn, kwargs in cases:
        try:
            out[name] = FNS[fn](rank, world_size, impl, **kwargs)
        except Exception:  # noqa: BLE001 - reported to the test that reads this case
            out[name] = {"error": traceback.format_exc()}
    return out
