"""Shared pieces of the DDP differential tests: the model, the rank-dependent data, the hooks
under test and their torch references, rank functions that run them, and the closed forms the
ddpx results must equal.

Rank functions here run inside the ranks started by dist_utils.run_ranks; the closed forms and
tolerances run in the pytest process on what the ranks returned.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx

# Bucket size for every DDP model here (first bucket included, see `make_ddp`). DDP closes a
# bucket once it reaches the limit, and a layer's bias gets ready just before its weight: one
# bucket per layer of the model below, so a backward pass has 4 buckets in flight.
BUCKET_BYTES = 1024

# Unit roundoff of the 16-bit formats (round to nearest: half an ulp at 1.0).
U_FP16 = 2.0 ** -11
U_BF16 = 2.0 ** -8
# Half the spacing of fp16 subnormals: the largest absolute rounding error of an fp16 result.
FP16_SUBNORMAL_HALF_ULP = 2.0 ** -25


def make_model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """The same weights on every rank and in every call (seed 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.Tanh(),
        nn.Linear(32, 10))
    return model.to(device=device, dtype=dtype)


_TEACHER = torch.randn(32, 10, generator=torch.Generator().manual_seed(12345),
                       dtype=torch.float64) / 32 ** 0.5


def make_batch(rank: int, step: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Rank- and step-dependent inputs, and targets from a fixed linear teacher (so that training
    makes progress); rank r's inputs are scaled by (1 + r) / 2 so that the ranks' gradients
    differ in magnitude too."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 32, generator=g, dtype=torch.float64) * (1 + rank) / 2
    y = torch.tanh(x @ _TEACHER) + 0.1 * torch.randn(16, 10, generator=g, dtype=torch.float64)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0):
    return nn.functional.mse_loss(model(x), y) * scale


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]).cpu().clone()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().clone()


# ---- the hooks ---------------------------------------------------------------------------------

DDPX_HOOKS: Dict[str, Callable[[], Callable]] = {
    "allreduce": lambda: ddpx.hooks.allreduce_hook,
    "fp16": lambda: ddpx.hooks.fp16_compress_hook,
    "bf16": lambda: ddpx.hooks.bf16_compress_hook,
    "fp16_wrap": lambda: ddpx.hooks.fp16_compress_wrapper(ddpx.hooks.allreduce_hook),
    "bf16_wrap": lambda: ddpx.hooks.bf16_compress_wrapper(ddpx.hooks.allreduce_hook),
    "noop": lambda: ddpx.hooks.noop_hook,
    "bf16_wrap_noop": lambda: ddpx.hooks.bf16_compress_wrapper(ddpx.hooks.noop_hook),
}

# torch's own hooks (torch_none: DDP's built-in allreduce, no hook). torch 1.13 refuses its
# bf16 hooks on Gloo, so ddpx's bf16 results are checked against closed forms instead.
TORCH_HOOKS: Dict[str, Optional[Callable[[], Callable]]] = {
    "torch_none": None,
    "torch_allreduce": lambda: torch_hooks.allreduce_hook,
    "torch_fp16": lambda: torch_hooks.fp16_compress_hook,
    "torch_fp16_wrap": lambda: torch_hooks.fp16_compress_wrapper(torch_hooks.allreduce_hook),
}

# torch's bf16 hooks: only where torch accepts them (a CUDA build of torch with NCCL >= 2.10;
# on Gloo also a torch 2.x Gloo: see torch_compat.TORCH_BF16_HOOKS_ON_GLOO).
TORCH_HOOKS_NCCL: Dict[str, Callable[[], Callable]] = {
    "torch_bf16": lambda: torch_hooks.bf16_compress_hook,
    "torch_bf16_wrap": lambda: torch_hooks.bf16_compress_wrapper(torch_hooks.allreduce_hook),
}

MODES = ("dropin", "native")


def all_configs(ddpx_names: Sequence[str] = tuple(DDPX_HOOKS),
                torch_names: Sequence[str] = tuple(TORCH_HOOKS)) -> List[str]:
    """Config names: "torch_*" and "ddpx_<hook>_<mode>"."""
    return list(torch_names) + [f"ddpx_{h}_{m}" for h in ddpx_names for m in MODES]


def make_ddp(model: nn.Module, config: str, gradient_as_bucket_view: bool = False,
             static_graph: Optional[str] = None, state: Any = None,
             device_ids: Optional[List[int]] = None, process_group: Any = None) -> DDP:
    """Wraps `model` in DDP with small buckets and registers the hook named by `config`.

    static_graph: None, "ctor" (the constructor argument) or "method" (ddp._set_static_graph()).
    """
    # DDP sizes the first bucket separately (1 MiB by default); DDP's own comment invites users
    # to tune it through this attribute. Without it the whole model would fit one bucket.
    dist._DEFAULT_FIRST_BUCKET_BYTES = BUCKET_BYTES
    kwargs = dict(bucket_cap_mb=BUCKET_BYTES / 2 ** 20,
                  gradient_as_bucket_view=gradient_as_bucket_view, device_ids=device_ids,
                  process_group=process_group)
    if static_graph == "ctor":
        kwargs["static_graph"] = True
    ddp = DDP(model, **kwargs)
    if static_graph == "method":
        ddp._set_static_graph()
    if config in TORCH_HOOKS or config in TORCH_HOOKS_NCCL:
        factory = TORCH_HOOKS[config] if config in TORCH_HOOKS else TORCH_HOOKS_NCCL[config]
        if factory is not None:
            ddp.register_comm_hook(state, factory())
        return ddp
    assert config.startswith("ddpx_"), config
    hook_name, mode = config[len("ddpx_"):].rsplit("_", 1)
    hook = DDPX_HOOKS[hook_name]()
    if mode == "dropin":
        ddp.register_comm_hook(state, hook)
    elif mode == "native":
        ddpx.register_comm_hook(ddp, state, hook)
    else:
        raise ValueError(config)
    return ddp


# ---- rank functions ------------------------------------------------------------------------------

def rank_grads(rank: int, world_size: int, configs: Sequence[str], iterations: int = 2,
               dtype: torch.dtype = torch.float32, loss_scale: float = 1.0,
               gradient_as_bucket_view: bool = False, static_graph: Optional[str] = None,
               device: str = "cpu") -> Dict[str, List[torch.Tensor]]:
    """Gradients after each of `iterations` backward passes (grads zeroed in between, no
    optimizer step), per config, plus "local": the same passes on a plain, non-DDP model.

    DDP buckets everything together in the first pass and rebuilds buckets of BUCKET_BYTES
    after it: iteration 0 has one bucket, the later ones several.
    """
    device_ids = [torch.device(device).index or 0] if device.startswith("cuda") else None
    out: Dict[str, List[torch.Tensor]] = {}
    local = make_model(dtype, device)
    out["local"] = []
    for it in range(iterations):
        local.zero_grad()
        loss_fn(local, *make_batch(rank, it, dtype, device), loss_scale).backward()
        out["local"].append(flat_grad(local))
    for config in configs:
        ddp = make_ddp(make_model(dtype, device), config, gradient_as_bucket_view, static_graph,
                       device_ids=device_ids)
        grads = []
        for it in range(iterations):
            ddp.zero_grad()
            loss_fn(ddp, *make_batch(rank, it, dtype, device), loss_scale).backward()
            grads.append(flat_grad(ddp))
        out[config] = grads
    return out


def rank_bucket_sizes(rank: int, world_size: int, iterations: int = 3) -> List[List[int]]:
    """Bucket sizes (elements) the hooks see in each iteration of the rank_grads set-up, seen
    through a Python hook that forwards to ddpx's native allreduce_hook."""
    ddp = make_ddp(make_model(), "torch_none")
    seen: List[int] = []

    def counting_hook(state, bucket):
        seen.append(bucket.buffer().numel())
        return ddpx.hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    sizes = []
    for it in range(iterations):
        ddp.zero_grad()
        loss_fn(ddp, *make_batch(rank, it)).backward()
        sizes.append(list(seen))
        seen.clear()
    return sizes


def rank_train(rank: int, world_size: int, configs: Sequence[str], steps: int = 20,
               lr: float = 0.1, gradient_as_bucket_view: bool = False,
               static_graph: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """`steps` plain SGD steps per config (4 batches per rank, cycled). Returns, per config, the
    parameters after every step and the losses; and under "local_grads" the local (not yet
    averaged) gradient of every step of the first config, for error bounds."""
    out: Dict[str, Any] = {}
    for i, config in enumerate(configs):
        ddp = make_ddp(make_model(), config, gradient_as_bucket_view, static_graph)
        shadow = make_model() if i == 0 else None
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        params, losses, local_grads = [], [], []
        for step in range(steps):
            batch = make_batch(rank, step % 4)
            if shadow is not None:
                shadow.load_state_dict(ddp.module.state_dict())
                shadow.zero_grad()
                loss_fn(shadow, *batch).backward()
                local_grads.append(flat_grad(shadow))
            opt.zero_grad()
            loss = loss_fn(ddp, *batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            params.append(flat_params(ddp))
        out[config] = {"params": torch.stack(params), "losses": torch.tensor(losses)}
        if shadow is not None:
            out["local_grads"] = torch.stack(local_grads)
    return out


# ---- closed forms (pytest process) -------------------------------------------------------------

def _scale_of(world_size: int) -> float:
    """1/W as the kernels apply it: rounded to fp32."""
    return torch.tensor(1.0 / world_size, dtype=torch.float32).item()


def _seq_sum(rows: Sequence[torch.Tensor], acc_dtype: torch.dtype) -> torch.Tensor:
    """rows[0] + rows[1] + ... in rank order, in acc_dtype (what the ranks compute after the
    allgather)."""
    acc = rows[0].to(acc_dtype)
    for r in rows[1:]:
        acc = acc + r.to(acc_dtype)
    return acc


def ref_compress_hook(local: Sequence[torch.Tensor], dtype16: torch.dtype) -> torch.Tensor:
    """ddpx fp16/bf16_compress_hook on Gloo: each rank casts x_r / W to 16 bits in one rounding;
    on 1 or 2 ranks the 16-bit values are gathered and summed in fp32 (fp64 for fp64 buckets),
    the result in the bucket's dtype; on 3 or more (the reduce-scatter exchange) each chunk's
    owner sums them in fp32 and rounds the sum to 16 bits once, which every rank receives."""
    w = len(local)
    out_dtype = local[0].dtype
    # The kernels scale in fp64 for fp64 buckets (then round to fp32 and 16 bits, as torch's
    # .to() does), in fp32 otherwise.
    rows = [(x * (1.0 / w if x.dtype == torch.float64 else _scale_of(w))).float().to(dtype16)
            if w != 1 else x.float().to(dtype16) for x in local]
    if w >= 3:
        return _seq_sum(rows, torch.float32).to(dtype16).to(out_dtype)
    acc_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    return _seq_sum(rows, acc_dtype).to(out_dtype)


def ref_compress_wrapper_allreduce(local: Sequence[torch.Tensor], dtype16: torch.dtype):
    """ddpx <dtype>_compress_wrapper(allreduce_hook) on Gloo: cast x_r to 16 bits, gather, sum in
    fp32, multiply by 1/W in fp32, round the mean to 16 bits, then into the bucket's dtype."""
    w = len(local)
    rows = [x.float().to(dtype16) for x in local]
    acc = _seq_sum(rows, torch.float32)
    if w != 1:
        acc = acc * _scale_of(w)
    return acc.to(dtype16).to(local[0].dtype)


def exact_mean(local: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in local]).mean(0)


def mean_abs(local: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double().abs() for x in local]).mean(0)


def bf16_vs_torch_bound(local: Sequence[torch.Tensor]) -> torch.Tensor:
    """Element-wise bound on |ddpx bf16_compress_hook - torch bf16_compress_hook| (Gloo): the
    argument of fp16_vs_torch_bound with bf16's unit roundoff, (W + 3) U S. bf16 has fp32's
    exponent range, so no subnormal term arises at gradient magnitudes."""
    return (len(local) + 3) * U_BF16 * mean_abs(local)


def fp16_vs_torch_bound(local: Sequence[torch.Tensor]) -> torch.Tensor:
    """Element-wise bound on |ddpx fp16_compress_hook - torch fp16_compress_hook| (Gloo).

    torch rounds x_r to fp16, divides in fp16 and sums W values along Gloo's ring in fp16:
    1 + 1 + (W - 1) roundings, each within U_FP16 of |partial| <= S = mean_r |x_r|, so
    |torch - mean| <= (W + 1) U S. ddpx rounds x_r / W once and sums in fp32:
    |ddpx - mean| <= U S (+ fp32 roundings, < W 2^-24 S). Together, with a margin of one more
    U S: (W + 3) U S. Each of the at most 3W roundings can also land in fp16's subnormal range
    (|v| < 2^-14), where the error is absolute, up to 2^-25: hence the 3W 2^-25 term.
    """
    w = len(local)
    return (w + 3) * U_FP16 * mean_abs(local) + 3 * w * FP16_SUBNORMAL_HALF_ULP
