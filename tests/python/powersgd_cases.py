"""Shared pieces of the PowerSGD tests: a model with a Conv2d and several Linear layers (two of
them the same shape), rank-dependent data, DDP wrapping with several buckets, the ddpx and torch
PowerSGD configurations, and the rank functions that train with them.

Rank functions run inside the ranks started by dist_utils.run_ranks; what they return is compared
in the pytest process.
"""
import io
import logging
import math
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx
import torch_compat as tc
from dist_utils import catch

# DDP bucket cap: 8 KiB (2048 fp32), for the first bucket too (dist._DEFAULT_FIRST_BUCKET_BYTES).
# torch 1.13's DDP puts the whole model in one bucket, in registration order, for the first
# iteration; from the second on, its rebuilt buckets follow the gradients' ready order:
# [fc4, fc3, fc2] (both 32x32 weights in one bucket), [fc1], [conv]: 3 buckets per step.
BUCKET_BYTES = 8192
# torch's default first-bucket cap: with it, the rebuilt buckets are a single one too (in ready
# order, the reverse of the first iteration's).
TORCH_FIRST_BUCKET_BYTES = 1024 * 1024


class Net(nn.Module):
    """Conv2d(2, 8, 3) on 8x8 inputs, then Linear 288->32, 32->32, 32->32 (same shape), 32->10.
    Gradient matrices as PowerSGD views them: conv 8x18, fc1 32x288, fc2/fc3 32x32, fc4 10x32,
    biases n x 1."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3)
        self.fc1 = nn.Linear(288, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 32)
        self.fc4 = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        h = torch.tanh(self.fc1(h))
        h = torch.tanh(self.fc2(h))
        h = torch.tanh(self.fc3(h))
        return self.fc4(h)


def make_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The same weights on every rank and in every call (seed 0)."""
    torch.manual_seed(0)
    return Net().to(device=device, dtype=dtype)


_TEACHER = torch.randn(128, 10, generator=torch.Generator().manual_seed(4321),
                       dtype=torch.float64) / 128 ** 0.5


def make_batch(rank: int, step: int, batch: int = 16, device: str = "cpu",
               dtype: torch.dtype = torch.float32):
    """Rank- and step-dependent inputs (scaled by (1 + rank) / 2 so that the ranks' gradients
    differ in magnitude), targets from a fixed nonlinear teacher, so that training progresses."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(batch, 2, 8, 8, generator=g, dtype=torch.float64) * (1 + rank) / 2
    y = torch.tanh(x.flatten(1) @ _TEACHER) + 0.05 * torch.randn(batch, 10, generator=g,
                                                                  dtype=torch.float64)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]).cpu().clone()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().clone()


def param_shapes() -> List[Tuple[str, Tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in make_model().named_parameters()]


def wrap_ddp(model: nn.Module, first_bucket_bytes: int = BUCKET_BYTES,
             device_ids=None, process_group=None) -> DDP:
    """DDP with BUCKET_BYTES buckets; first_bucket_bytes: DDP's separate cap for the first
    bucket after DDP's rebuild (dist._DEFAULT_FIRST_BUCKET_BYTES in torch 1.13;
    bucket_cap_mb_list in 2.x, see torch_compat)."""
    return DDP(model, device_ids=device_ids, process_group=process_group,
               **tc.ddp_bucket_kwargs(BUCKET_BYTES, first_bucket_bytes))


# ---- configurations --------------------------------------------------------------------------
#
# A config is a dict: impl ("ddpx" | "torch" | "none": DDP's built-in allreduce),
# hook ("powerSGD" | "batched" | "fp16_powerSGD" | "bf16_powerSGD" | "allreduce"),
# mode ("dropin" | "native", ddpx only), opts (PowerSGDState keyword arguments).

def make_state(cfg: Dict[str, Any], process_group=None):
    opts = dict(cfg.get("opts", {}))
    if cfg["impl"] == "torch":
        return tp.PowerSGDState(process_group, **opts)
    return ddpx.hooks.PowerSGDState(process_group, **opts)


def ddpx_hook(name: str):
    h = ddpx.hooks
    return {
        "powerSGD": h.powerSGD_hook,
        "batched": h.batched_powerSGD_hook,
        "fp16_powerSGD": h.fp16_compress_wrapper(h.powerSGD_hook),
        "bf16_powerSGD": h.bf16_compress_wrapper(h.powerSGD_hook),
        "allreduce": h.allreduce_hook,
    }[name]


def register(ddp: DDP, cfg: Dict[str, Any], state: Any) -> None:
    if cfg["impl"] == "none":
        return
    if cfg["impl"] == "torch":
        hook = {"powerSGD": tp.powerSGD_hook, "batched": tp.batched_powerSGD_hook,
                "batched_fixed": torch_batched_fixed_hook}[cfg["hook"]]
        ddp.register_comm_hook(state, torch_synchronized(hook) if cfg.get("sync", True) else hook)
        return
    hook = ddpx_hook(cfg["hook"])
    if cfg.get("mode", "dropin") == "native":
        ddpx.register_comm_hook(ddp, state, hook)
    else:
        ddp.register_comm_hook(state, hook)


def torch_synchronized(hook):
    """torch's PowerSGD hook, waited for before the next bucket starts.

    torch's Python hook issues a bucket's second and third allreduce from future callbacks, which
    run on Gloo's threads while the autograd thread already issues the next bucket's first one:
    with several buckets the ranks can issue their collectives in different orders, and Gloo then
    aborts the process ("op.preamble.length <= op.nbytes") or hangs (5 of 5 runs of this model
    with 3 buckets). Waiting keeps its arithmetic and makes the order the same on every rank.
    """
    def synchronized_hook(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut

    return synchronized_hook


def torch_batched_fixed_hook(state, bucket):
    """torch 1.13's batched_powerSGD_hook with its crash fixed, as the reference for ddpx's.

    torch's hook hands the 2-D Q and P (side x rank) to _orthogonalize, which asserts a 3-D batch
    (AssertionError). This is the same algorithm, step for step and with torch's own functions
    (allreduce before start_powerSGD_iter; error feedback; Q drawn from
    torch.manual_seed(state.rng.randint(1_000_000_000)) and orthogonalised; P = M Q allreduced,
    orthogonalised; Q = M^T P allreduced and divided by the world size; M = P Q^T), with Q and P
    passed as 1 x side x rank batches, and on a padded copy instead of resize_() of DDP's bucket.
    Run synchronously (the next bucket starts after this one is done).
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = group.size()
    input_tensor = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        fut = dist.all_reduce(input_tensor, group=group, async_op=True).get_future()
        fut.wait()
        input_tensor.div_(world_size)
        out = torch.futures.Future()
        out.set_result(input_tensor)
        return out
    total_length = input_tensor.shape[0]
    side = math.ceil(math.sqrt(total_length))
    rank = state.matrix_approximation_rank
    state.total_numel_before_compression += total_length
    state.total_numel_after_compression += side * rank * 2
    padded = torch.zeros(side * side, dtype=input_tensor.dtype, device=input_tensor.device)
    padded[:total_length].copy_(input_tensor)
    index = bucket.index()
    if state.use_error_feedback:
        if index in state.error_dict:
            padded.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros_like(padded)
        compensated = padded.clone()
    matrix = padded.view(side, side)
    if not state.warm_start or index not in state.q_memory_dict:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            state.q_memory_dict[index] = torch.randn(side, rank, dtype=padded.dtype).to(
                padded.device)
    q = state.q_memory_dict[index]
    tp._orthogonalize(q.unsqueeze(0), state.orthogonalization_epsilon)
    p = torch.matmul(matrix, q)
    dist.all_reduce(p, group=group)
    tp._orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
    torch.matmul(matrix.t(), p, out=q)
    dist.all_reduce(q, group=group)
    q.div_(world_size)
    torch.matmul(p, q.t(), out=matrix)
    if state.use_error_feedback:
        state.error_dict[index] = compensated - padded
    if not state.warm_start:
        state.q_memory_dict.clear()
    input_tensor.copy_(padded[:total_length])
    state.maybe_increase_iter(bucket)
    out = torch.futures.Future()
    out.set_result(input_tensor)
    return out


def make_optimizer(model: nn.Module, lr: float, momentum: float):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


# ---- rank functions ------------------------------------------------------------------------------

def rank_train(rank: int, world_size: int, configs: Sequence[Dict[str, Any]], steps: int,
               lr: float = 0.05, momentum: float = 0.0, batch: int = 16,
               first_bucket_bytes: int = BUCKET_BYTES, local_grads: bool = False,
               device: str = "cpu") -> List[Dict[str, Any]]:
    """`steps` SGD steps per config from the same start. Per config: the loss and the averaged
    gradient of every step, the parameters after every step, state.iter after every step,
    compression_stats(), the keys of q_memory_dict / error_dict with the Q sizes (ddpx), and,
    with local_grads, each step's local (not averaged) gradient."""
    device_ids = [torch.device(device).index or 0] if device.startswith("cuda") else None
    if device.startswith("cuda"):
        # The runs are compared bit for bit (drop-in against native, ddpx against torch before
        # compression starts), and cuDNN's default algorithms for the conv's weight gradient may
        # accumulate in a different order from one run to the next.
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    out = []
    for cfg in configs:
        ddp = wrap_ddp(make_model(device), first_bucket_bytes, device_ids=device_ids)
        state = make_state(cfg) if cfg["impl"] != "none" else None
        register(ddp, cfg, state)
        opt = make_optimizer(ddp, lr, momentum)
        shadow = make_model(device) if local_grads else None
        losses, grads, params, iters, locals_ = [], [], [], [], []
        for step in range(steps):
            x, y = make_batch(rank, step, batch, device)
            if shadow is not None:
                shadow.load_state_dict(ddp.module.state_dict())
                shadow.zero_grad()
                loss_fn(shadow, x, y).backward()
                locals_.append(flat_grad(shadow))
            opt.zero_grad()
            loss = loss_fn(ddp, x, y)
            loss.backward()
            grads.append(flat_grad(ddp))
            opt.step()
            losses.append(loss.item())
            params.append(flat_params(ddp))
            if state is not None:
                iters.append(state.iter)
        res = {"losses": torch.tensor(losses, dtype=torch.float64), "grads": torch.stack(grads),
               "params": torch.stack(params), "iters": iters}
        if local_grads:
            res["local_grads"] = torch.stack(locals_)
        if state is not None:
            res["stats"] = tuple(state.compression_stats())
        if cfg["impl"] == "ddpx":
            res["q_sizes"] = {k: v.numel() for k, v in state.q_memory_dict.items()}
            res["error_keys"] = sorted(state.error_dict.keys())
        out.append(res)
    return out


def rank_key_order(rank: int, world_size: int, first_bucket_bytes: int = BUCKET_BYTES):
    """Parameter names in the order their gradients first reach a hook (the order ddpx assigns
    its per-parameter keys), seen through a drop-in wrapper around ddpx's native hook, and the
    bucket sizes of the first 3 iterations."""
    model = make_model()
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    ddp = wrap_ddp(model, first_bucket_bytes)
    state = ddpx.hooks.PowerSGDState(None, start_powerSGD_iter=2, min_compression_rate=0.5)
    native = ddpx.hooks.native_hook(ddpx.hooks.powerSGD_hook, state)
    order: List[str] = []
    sizes: List[List[int]] = [[], [], []]
    it = [0]

    def hook(st, bucket):
        for p in bucket.parameters():
            if names[p.data_ptr()] not in order:
                order.append(names[p.data_ptr()])
        if it[0] < 3:
            sizes[it[0]].append(bucket.buffer().numel())
        if bucket.is_last():
            it[0] += 1
        return native.run(bucket).then(lambda f: f.value())

    ddp.register_comm_hook(state, hook)
    for step in range(4):
        ddp.zero_grad()
        loss_fn(ddp, *make_batch(rank, step)).backward()
    return {"order": order, "sizes": sizes,
            "q_sizes": {k: v.numel() for k, v in state.q_memory_dict.items()},
            "p_sizes": {k: v.numel() for k, v in state.p_memory_dict.items()},
            "stats": tuple(state.compression_stats())}


def rank_error_feedback(rank: int, world_size: int, steps: int, opts: Dict[str, Any]):
    """A drop-in Python hook around ddpx's native powerSGD_hook object. Per bucket call: the
    bucket's input before the hook, its output, the previous residual and the new one (from
    state.error_dict, keyed by parameter in the order parameters first reach the hook)."""
    model = make_model()
    ddp = wrap_ddp(model)
    state = ddpx.hooks.PowerSGDState(None, **opts)
    native = ddpx.hooks.native_hook(ddpx.hooks.powerSGD_hook, state)
    keys: Dict[int, int] = {}
    records: List[Dict[str, Any]] = []
    it = [0]

    def residual(bucket_keys, numel):
        err = state.error_dict
        if not all(k in err for k in bucket_keys):
            return torch.zeros(numel)
        return torch.cat([err[k].detach().reshape(-1).clone() for k in bucket_keys])

    def hook(st, bucket):
        bucket_keys = []
        for p in bucket.parameters():
            bucket_keys.append(keys.setdefault(p.data_ptr(), len(keys)))
        buf = bucket.buffer()
        rec = {"iter": it[0], "state_iter": state.iter, "index": bucket.index(),
               "stats_before": tuple(state.compression_stats()),
               "input": buf.detach().clone(), "old_residual": residual(bucket_keys, buf.numel())}
        if bucket.is_last():
            it[0] += 1

        def after(fut):
            out = fut.value()
            rec["output"] = out.detach().clone()
            rec["new_residual"] = residual(bucket_keys, out.numel())
            rec["stats_after"] = tuple(state.compression_stats())
            records.append(rec)
            return out

        return native.run(bucket).then(after)

    ddp.register_comm_hook(state, hook)
    opt = make_optimizer(ddp, 0.05, 0.0)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(ddp, *make_batch(rank, step)).backward()
        opt.step()
    records.sort(key=lambda r: (r["iter"], r["index"]))  # completion order may differ by rank
    return {"records": records, "iter": state.iter, "stats": tuple(state.compression_stats())}


def _save_load(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def rank_resume_cases(rank: int, world_size: int, cases: Sequence[Tuple[Dict[str, Any], str, int]],
                      **kwargs) -> List[Dict[str, Any]]:
    """rank_resume for each (config, how, first_bucket_bytes) in turn."""
    return [rank_resume(rank, world_size, cfg, how, first_bucket_bytes=fb, **kwargs)
            for cfg, how, fb in cases]


def rank_resume(rank: int, world_size: int, cfg: Dict[str, Any], how: str, steps: int = 10,
                save_at: int = 5, lr: float = 0.05, momentum: float = 0.9,
                first_bucket_bytes: int = BUCKET_BYTES) -> Dict[str, Any]:
    """Uninterrupted training for `steps` steps, against the same run checkpointed after
    `save_at` steps (model, optimizer and PowerSGD state) and resumed in a NEW DDP model with a
    new optimizer and the restored state. how: "pickle" (pickle of the state object) or
    "state_dict" (state.state_dict() into a fresh PowerSGDState's load_state_dict(), ddpx only).
    Returns the parameters after every step of both runs (or the exception the resumed run
    raised) and the states' iter."""
    def fresh(state=None):
        ddp = wrap_ddp(make_model(), first_bucket_bytes)
        state = state if state is not None else make_state(cfg)
        register(ddp, cfg, state)
        return ddp, state, make_optimizer(ddp, lr, momentum)

    def step(ddp, opt, i):
        opt.zero_grad()
        loss_fn(ddp, *make_batch(rank, i)).backward()
        opt.step()
        return flat_params(ddp)

    ddp, state, opt = fresh()
    full = [step(ddp, opt, i) for i in range(steps)]
    full_iter = state.iter

    ddp, state, opt = fresh()
    resumed = [step(ddp, opt, i) for i in range(save_at)]
    checkpoint = {"model": ddp.module.state_dict(), "opt": opt.state_dict()}
    if how == "pickle":
        checkpoint["psgd"] = pickle.dumps(state)
    else:
        checkpoint["psgd"] = state.state_dict()
    checkpoint = _save_load(checkpoint)  # through bytes, as to disk
    del ddp, state, opt

    if how == "pickle":
        new_state = pickle.loads(checkpoint["psgd"])
    else:
        new_state = make_state(cfg)
        new_state.load_state_dict(checkpoint["psgd"])
    restored_iter = new_state.iter
    ddp, _, opt = fresh(new_state)
    ddp.module.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    error = None
    try:
        for i in range(save_at, steps):
            resumed.append(step(ddp, opt, i))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    return {"full": torch.stack(full), "resumed": resumed, "error": error,
            "full_iter": full_iter, "resumed_iter": new_state.iter,
            "restored_iter": restored_iter}


# ---- a small classification task (sklearn's digits, offline) ---------------------------------

def rank_checkpoint_of_another_rank(rank: int, world_size: int) -> Dict[str, Any]:
    """A checkpoint whose error-feedback memories another rank saved: refused with an error that
    says to load each rank's own file, unless allow_reshard; this rank's own, one without error
    memories and one that records no rank (an older ddpx's) load as they are."""
    P = ddpx.hooks.PowerSGDState
    out: Dict[str, Any] = {}
    for feedback in (True, False):
        state = P(None, start_powerSGD_iter=2, use_error_feedback=feedback, warm_start=True)
        ddp = wrap_ddp(make_model())
        register(ddp, {"impl": "ddpx", "hook": "powerSGD", "mode": "native"}, state)
        for step in range(3):  # past start_powerSGD_iter: memories exist
            ddp.zero_grad()
            loss_fn(ddp, *make_batch(rank, step)).backward()
        own = _save_load(state.state_dict())
        out[f"recorded_{feedback}"] = (own["rank"], own["world_size"], len(own["error"]))
        other = dict(own, rank=(rank + 1) % world_size)
        older = {k: v for k, v in own.items() if k not in ("rank", "world_size")}
        for name, ckpt, kwargs in (("own", own, {}), ("other", other, {}),
                                   ("other_allowed", other, {"allow_reshard": True}),
                                   ("other_world", dict(own, world_size=world_size + 1), {}),
                                   ("older", older, {})):
            out[f"{name}_{feedback}"] = catch(lambda: P(None).load_state_dict(ckpt, **kwargs))
    return out


def load_digits_tensors() -> Tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 8x8 digits (1797 images, 10 classes), features scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    d = load_digits()
    return (torch.tensor(d.data, dtype=torch.float32) / 16.0,
            torch.tensor(d.target, dtype=torch.long))


def make_digits_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 10))


def rank_train_digits(rank: int, world_size: int, configs: Sequence[Dict[str, Any]],
                      x: torch.Tensor, y: torch.Tensor, steps: int = 120, batch: int = 32,
                      lr: float = 0.1, momentum: float = 0.9) -> List[Dict[str, Any]]:
    """Cross-entropy training on the digits: each rank draws its own batches (seeded by rank and
    step) from the first 1500 images; per config the training losses, the loss and accuracy on
    the last 297 images after training, and the final parameters."""
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    out = []
    for cfg in configs:
        ddp = wrap_ddp(make_digits_model())
        state = make_state(cfg) if cfg["impl"] != "none" else None
        register(ddp, cfg, state)
        opt = make_optimizer(ddp, lr, momentum)
        losses = []
        for step in range(steps):
            idx = torch.randint(0, 1500, (batch,),
                                generator=torch.Generator().manual_seed(7919 * rank + step))
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(train_x[idx]), train_y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            logits = ddp.module(test_x)
            test_loss = nn.functional.cross_entropy(logits, test_y).item()
            acc = (logits.argmax(1) == test_y).double().mean().item()
        out.append({"losses": torch.tensor(losses, dtype=torch.float64), "test_loss": test_loss,
                    "test_acc": acc, "params": flat_params(ddp),
                    "stats": tuple(state.compression_stats()) if state is not None else None,
                    "iter": state.iter if state is not None else None})
    return out


def rank_torch_batched(rank: int, world_size: int) -> Optional[Dict[str, str]]:
    """torch's own batched_powerSGD_hook, as installed, on the rank_train set-up: what its first
    compressed step raises (None if it does not)."""
    import traceback
    ddp = wrap_ddp(make_model(), TORCH_FIRST_BUCKET_BYTES)  # one bucket: no ordering race
    state = tp.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, tp.batched_powerSGD_hook)
    for step in range(3):
        ddp.zero_grad()
        try:
            loss_fn(ddp, *make_batch(rank, step)).backward()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"step": step, "iter": state.iter, "type": type(exc).__name__,
                    "message": str(exc), "traceback": traceback.format_exc()}
    return None


def rank_errors(rank: int, world_size: int) -> Dict[str, Any]:
    """Bad arguments and misuse, each caught with its exception type and message."""
    P = ddpx.hooks.PowerSGDState
    out: Dict[str, Any] = {}

    def backward(ddp, step=0):
        loss_fn(ddp, *make_batch(rank, step)).backward()

    out["rank_0"] = catch(lambda: P(None, matrix_approximation_rank=0))
    out["rank_neg"] = catch(lambda: P(None, matrix_approximation_rank=-3))
    out["min_rate_neg"] = catch(lambda: P(None, min_compression_rate=-1))
    out["min_rate_neg_small"] = catch(lambda: P(None, min_compression_rate=-1e-9))
    for ef, ws in ((True, True), (True, False), (False, True)):
        out[f"start1_ef{ef}_ws{ws}"] = catch(
            lambda: P(None, start_powerSGD_iter=1, use_error_feedback=ef, warm_start=ws))
        out[f"start1_ef{ef}_ws{ws}_torch"] = catch(
            lambda: tp.PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=ef,
                                     warm_start=ws))
    out["start1_no_memories"] = catch(
        lambda: P(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False))
    out["start0_no_memories"] = catch(
        lambda: P(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False))

    # torch's PowerSGDState handed to ddpx's hooks: natively at registration, drop-in at the
    # first backward (DDP runs Python hooks only then).
    torch_state = tp.PowerSGDState(None, start_powerSGD_iter=2)
    for name in ("powerSGD_hook", "batched_powerSGD_hook"):
        hook = getattr(ddpx.hooks, name)
        ddp = wrap_ddp(make_model())
        out[f"torch_state_native_{name}"] = catch(
            lambda: ddpx.register_comm_hook(ddp, torch_state, hook))
        ddp = wrap_ddp(make_model())
        ddp.register_comm_hook(torch_state, hook)
        out[f"torch_state_dropin_{name}"] = catch(lambda: backward(ddp))
        # state=None (accepted by the default hooks, meaning the default group)
        ddp = wrap_ddp(make_model())
        out[f"none_native_{name}"] = catch(lambda: ddpx.register_comm_hook(ddp, None, hook))
        ddp = wrap_ddp(make_model())
        ddp.register_comm_hook(None, hook)
        out[f"none_dropin_{name}"] = catch(lambda: backward(ddp))
    out["none_fp16_wrapper_native"] = catch(lambda: ddpx.register_comm_hook(
        wrap_ddp(make_model()), None, ddpx.hooks.fp16_compress_wrapper(ddpx.hooks.powerSGD_hook)))

    # One state, two DDP models: the second model's first backward fails; the first model
    # keeps training with it.
    for mode in ("dropin", "native"):
        state = P(None, start_powerSGD_iter=2)
        cfg = {"impl": "ddpx", "hook": "powerSGD", "mode": mode}
        a, b = wrap_ddp(make_model()), wrap_ddp(make_model())
        register(a, cfg, state)
        register(b, cfg, state)
        for step in range(3):  # past start_powerSGD_iter: compressing
            a.zero_grad()
            backward(a, step)
        out[f"reuse_{mode}"] = catch(lambda: backward(b, 3))
        a.zero_grad()
        out[f"reuse_{mode}_first_model_after"] = catch(lambda: backward(a, 3))
        out[f"reuse_{mode}_iter"] = state.iter

    # Checkpoints. A value of the wrong type: a TypeError naming the key, not
    # an internal assert that blames PyTorch.
    good = P(None, start_powerSGD_iter=2).state_dict()
    for key, value in (("iter", "5"), ("matrix_approximation_rank", 1.5), ("rng", 0),
                       ("error", 0)):
        out[f"load_type_{key}"] = catch(lambda: P(None).load_state_dict({**good, key: value}))
    # A checkpoint of a model with other shapes: its error memories do not fit. Strict (the
    # default): the first compressed backward fails naming the parameter; strict=False drops them.
    def trained(state):
        """A native DDP model whose powerSGD_hook has compressed (3 steps) with `state`."""
        ddp = wrap_ddp(make_model())
        register(ddp, {"impl": "ddpx", "hook": "powerSGD", "mode": "native"}, state)
        for step in range(3):
            ddp.zero_grad()
            backward(ddp, step)
        return ddp

    saved = P(None, start_powerSGD_iter=2)
    trained(saved)
    checkpoint = saved.state_dict()
    checkpoint["error"] = {k: torch.zeros(v.numel() + 1) for k, v in checkpoint["error"].items()}
    for strict in (True, False):
        st = P(None, start_powerSGD_iter=2)
        st.load_state_dict(checkpoint, strict=strict)
        ddp = wrap_ddp(make_model())
        register(ddp, {"impl": "ddpx", "hook": "powerSGD", "mode": "native"}, st)
        out[f"load_shapes_strict_{strict}"] = catch(lambda: backward(ddp, 3))
    # clear_memories() after training: residuals zeroed, and training goes on.
    st = P(None, start_powerSGD_iter=2)
    ddp = trained(st)
    st.clear_memories()
    out["cleared"] = (len(st.error_dict), len(st.q_memory_dict))
    out["after_clear"] = catch(lambda: backward(ddp, 3))
    out["after_clear_errors"] = [bool(torch.isfinite(t).all()) for t in st.error_dict.values()]

    # torch's log records: the config line at __init__ with the values as given
    # (booleans True/False, 2.0 as 2.0), the NOTE lines of a pickle round trip, and no second
    # config line on unpickling; the unpickled state's process_group is the default group.
    def records(logger_name, make):
        lg = logging.getLogger(logger_name)
        got = []

        class Keep(logging.Handler):
            def emit(self, record):
                got.append((record.levelname, record.getMessage()))

        handler, level = Keep(), lg.level
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        try:
            st = pickle.loads(pickle.dumps(make()))
            return got, st.process_group is dist.group.WORLD
        finally:
            lg.removeHandler(handler)
            lg.setLevel(level)

    kw = dict(matrix_approximation_rank=2, start_powerSGD_iter=5, min_compression_rate=2.0,
              orthogonalization_epsilon=1e-8, compression_stats_logging_frequency=0)
    out["log_torch"] = records(tp.__name__, lambda: tp.PowerSGDState(None, **kw))
    out["log_ddpx"] = records("ddpx.hooks.powerSGD_hook", lambda: P(None, **kw))
    return out
