"""CUDA: the kernels on CUDA tensors, and the DDP differential tests on a CUDA model, with NCCL
(world size 1: NCCL refuses two ranks on one GPU) and with Gloo on CUDA tensors (2 ranks on the
one GPU). Skipped without a GPU, or when ddpx was built without its CUDA kernels.
"""
import functools

import pytest
import torch

import ddp_cases as dc
import ddpx
from dist_utils import run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ddpx._C.with_cuda, reason="ddpx was built without CUDA kernels"),
]
C = ddpx._C
HALF_TYPES = [torch.float16, torch.bfloat16]


def bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(got, expected):
    got, expected = got.cpu(), expected.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got)[~nan], bits(expected)[~nan])


# ---- kernels ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 4096, 100003])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_cuda_scaled_cast(dtype, scale, n):
    g = torch.Generator().manual_seed(n)
    x = torch.pow(10.0, torch.empty(n).uniform_(-9, 6, generator=g)) * (
        torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    x_cuda = x.cuda()
    got = C.scaled_cast(x_cuda, dtype, scale)
    assert got.is_cuda
    assert_same_bits(got, (x_cuda * scale).to(dtype))  # torch's CUDA conversion
    assert_same_bits(got, C.scaled_cast(x, dtype, scale))  # the CPU kernel
    assert_same_bits(C.scaled_cast(got, torch.float32, 1.0), got.float())


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("src", HALF_TYPES, ids=str)
def test_cuda_sum_rows(src, rows):
    x = (torch.randn(rows, 100003, generator=torch.Generator().manual_seed(rows)) * 100).to(src)
    for out in (torch.float32, src):
        for scale in (1.0, 1 / 3):
            got = C.sum_rows(x.cuda(), out, scale)
            assert got.is_cuda
            assert_same_bits(got, C.sum_rows(x, out, scale))  # same arithmetic as the CPU


# ---- DDP on CUDA ---------------------------------------------------------------------------------

NCCL_CONFIGS = dc.all_configs(
    torch_names=("torch_none", "torch_allreduce", "torch_fp16", "torch_fp16_wrap",
                 "torch_bf16", "torch_bf16_wrap"))
GLOO_CONFIGS = dc.all_configs(
    torch_names=("torch_none", "torch_allreduce", "torch_fp16", "torch_fp16_wrap"))


@functools.lru_cache(maxsize=None)
def cuda_grads(backend: str):
    if backend == "nccl":
        return run_ranks(dc.rank_grads, 1, args=(NCCL_CONFIGS, 3), backend="nccl",
                         kwargs={"device": "cuda:0"}, timeout=300)
    return run_ranks(dc.rank_grads, 2, args=(GLOO_CONFIGS, 3), backend="gloo",
                     kwargs={"device": "cuda:0"}, timeout=300)


def check_against_closed_forms(res):
    world_size = len(res)
    for it in range(3):
        local = [r["local"][it] for r in res]
        for mode in dc.MODES:
            for r in range(world_size):
                assert torch.equal(res[r][f"ddpx_allreduce_{mode}"][it],
                                   res[r]["torch_allreduce"][it]), (mode, r, it)
                assert torch.equal(res[r][f"ddpx_noop_{mode}"][it], local[r])
            for name, dtype16 in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
                got = res[0][f"ddpx_{name}_{mode}"][it]
                assert torch.equal(got, dc.ref_compress_hook(local, dtype16)), (name, mode, it)
                got = res[0][f"ddpx_{name}_wrap_{mode}"][it]
                assert torch.equal(got, dc.ref_compress_wrapper_allreduce(local, dtype16))
            bound = dc.fp16_vs_torch_bound(local)
            diff = (res[0][f"ddpx_fp16_{mode}"][it].double()
                    - res[0]["torch_fp16"][it].double()).abs()
            assert (diff <= bound).all(), (mode, it)


def test_nccl_world_size_1():
    """One rank: every hook is its compression round trip; torch's hooks (bf16 included, which
    torch accepts on NCCL) do the same operations, so ddpx equals them bit for bit."""
    res = cuda_grads("nccl")
    check_against_closed_forms(res)
    r = res[0]
    for it in range(3):
        for mode in dc.MODES:
            for name in ("fp16", "bf16"):
                assert torch.equal(r[f"ddpx_{name}_{mode}"][it], r[f"torch_{name}"][it])
                assert torch.equal(r[f"ddpx_{name}_wrap_{mode}"][it], r[f"torch_{name}_wrap"][it])
            assert torch.equal(r[f"ddpx_allreduce_{mode}"][it], r["torch_none"][it])
            assert torch.equal(r[f"ddpx_allreduce_{mode}"][it], r["local"][it])


def test_gloo_on_cuda_tensors():
    """Two Gloo ranks sharing the GPU: the 16-bit values are allgathered from CUDA memory and
    summed by the CUDA kernel, with the CPU closed forms' results."""
    res = cuda_grads("gloo")
    check_against_closed_forms(res)
    for it in range(3):
        assert torch.equal(res[0]["ddpx_allreduce_native"][it], res[0]["torch_none"][it])
        assert not torch.equal(res[0]["ddpx_noop_native"][it], res[1]["ddpx_noop_native"][it])


# ---- the chunked gather on CUDA ---------------------------------------------------------------

def rank_big_bucket(rank: int, world_size: int):
    """One DDP bucket of 2.4M fp32 gradients (above the 2^21-element chunking threshold) on CUDA
    tensors over Gloo: ddpx's fp16/bf16 hooks split it into chunks whose sums run on other
    streams. The gradients are read right after backward(), with only DDP's own wait between,
    while a side stream keeps the GPU busy: they must be the closed form, every step. The side
    stream spins (torch.cuda._sleep) rather than multiplying matrices: cuBLAS promises the same
    bits only while one stream is active, and the expected values come from a run without the
    side work."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {}
    side = torch.cuda.Stream()
    for name in ("fp16", "bf16"):
        torch.manual_seed(0)
        local_model = nn.Sequential(nn.Linear(1200, 2000), nn.Linear(2000, 8)).cuda()
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(1200, 2000), nn.Linear(2000, 8)).cuda(),
                  device_ids=[0], bucket_cap_mb=64)
        ddpx.register_comm_hook(ddp, None, getattr(ddpx.hooks, f"{name}_compress_hook"))
        res = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(16, 1200, generator=g).cuda()
            local_model.zero_grad()
            local_model(x).square().sum().backward()
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)  # tens of ms of another stream's work
            ddp.zero_grad()
            ddp(x).square().sum().backward()
            got = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]).clone()
            res.append((dc.flat_grad(local_model), got.cpu()))
        out[name] = res
    torch.cuda.synchronize()
    return out


def test_gloo_on_cuda_chunked_gather_is_waited_for():
    res = run_ranks(rank_big_bucket, 2, timeout=300)
    for name, dtype16 in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for step in range(3):
            local = [res[r][name][step][0] for r in range(2)]
            assert local[0].numel() > 2 ** 21
            expected = dc.ref_compress_hook(local, dtype16)
            for r in range(2):
                assert torch.equal(res[r][name][step][1], expected), (name, step, r)


# ---- PowerSGD's Gram-Schmidt on CUDA at ranks up to 32 (no GoogleTest needed) -----------------

@pytest.mark.parametrize("tall", [False, True], ids=["short", "tall"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cuda_orthogonalize_matches_cpu_up_to_rank_32(dtype, tall):
    """The CUDA kernel against the CPU kernel (same algorithm, other summation order) and
    orthonormal, at ranks 1 to 32 in one launch, with a cudaMemcpyAsync-free check: the result
    is read back through torch on the current stream. Tall: a few matrices of 1025-4096 rows,
    which the CUDA kernel spreads over several blocks each."""
    import test_kernels as tk
    shapes = tk.GS_TALL_SHAPES if tall else tk.GS_SHAPES
    _, flat = tk.gs_inputs(dtype, seed=3, shapes=shapes)
    rows, cols = [n for n, _ in shapes], [r for _, r in shapes]
    cpu = flat.clone()
    C.orthogonalize_(cpu, rows, cols, 0.0)
    gpu = flat.cuda()
    C.orthogonalize_(gpu, rows, cols, 0.0)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    if tall:  # the one-block-per-matrix kernel on the same tall matrices agrees too
        one_block = flat.cuda()
        C.orthogonalize_(one_block, rows, cols, 0.0, spread=False)
        assert (one_block - gpu).abs().max().item() <= tol * 32
    for (n, r), a, b in zip(shapes, tk.split_gs(gpu.cpu(), shapes), tk.split_gs(cpu, shapes)):
        assert (a - b).abs().max() <= tol * r, (n, r)
        assert (a.T @ a - torch.eye(r, dtype=torch.float64)).abs().max() <= tol * r, (n, r)


def test_cuda_orthogonalize_refused_cooperative_launch_falls_back():
    """A cooperative launch the CUDA runtime refuses (forced here: a grid of no blocks; on a real
    machine, e.g. a GPU shared through MPS) falls back to one block per matrix, with a warning:
    the one-block kernel's results, bit for bit, and no error left for the next launch."""
    import warnings

    import test_kernels as tk
    shapes = tk.GS_TALL_SHAPES
    _, flat = tk.gs_inputs(torch.float32, seed=5, shapes=shapes)
    rows, cols = [n for n, _ in shapes], [r for _, r in shapes]
    one_block = flat.cuda()
    C.orthogonalize_(one_block, rows, cols, 0.0, spread=False)
    refused = flat.cuda()
    C._refuse_cooperative_launches_for_testing(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warned once per process: maybe not here
            C.orthogonalize_(refused, rows, cols, 0.0)
    finally:
        C._refuse_cooperative_launches_for_testing(False)
    assert torch.equal(refused.cpu(), one_block.cpu())
    assert not torch.equal(refused.cpu(), flat)
    again = flat.cuda()  # the cooperative launch works again
    C.orthogonalize_(again, rows, cols, 0.0)
    assert (again - one_block).abs().max().item() <= 2e-5 * 32


def test_cuda_orthogonalize_prepared_equals_orthogonalize():
    import test_kernels as tk
    tk.check_prepared_orthogonalize("cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_orthogonalize_16bit_touches_only_the_matrices(dtype):
    """PowerSGD on CUDA computes in the bucket's dtype: a 16-bit P region (behind the uncompressed
    values) goes through fp32 alone, and rounds to what the fp32 kernel gives."""
    import test_kernels as tk
    tk.check_orthogonalize_16bit_region(dtype, "cuda")


# ---- functional optimizers ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_cuda_functional_optim(name, dtype):
    # CUDA steps equal the CPU kernels' bit for bit (one element function), and stay within
    # 1e-6 relative of torch.optim on CUDA after 100 steps.
    g = torch.Generator().manual_seed(0)
    shapes = [(7,), (64, 33), (100003,)]
    cpu = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    cuda = [p.cuda() for p in cpu]
    ref = [p.clone().requires_grad_(True) for p in cuda]
    if name == "SGD":
        kw = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-2)
        ours_cpu, ours_cuda = C.FunctionalSGD(cpu, **kw), C.FunctionalSGD(cuda, **kw)
    else:
        kw = dict(lr=0.01, weight_decay=0.1, amsgrad=True)
        dec = name == "AdamW"
        ours_cpu = C.FunctionalAdam(cpu, decoupled_weight_decay=dec, **kw)
        ours_cuda = C.FunctionalAdam(cuda, decoupled_weight_decay=dec, **kw)
    opt = getattr(torch.optim, name)(ref, foreach=False, **kw)
    for _ in range(100):
        grads = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
        ours_cpu.step(grads)
        ours_cuda.step([x.cuda() for x in grads])
        for p, x in zip(ref, grads):
            p.grad = x.cuda()
        opt.step()
    for a, b, r in zip(cuda, cpu, ref):
        assert_same_bits(a, b)
        r = r.detach()
        assert ((a - r).abs().max() / r.abs().max()).item() <= 1e-6


# ---- quantized_hook on CUDA buckets -----------------------------------------------------------

def rank_quantized_cuda(rank: int, world_size: int, bits: int, exchange: str, ef: bool):
    """quantized_hook on a CUDA model over Gloo (2 ranks sharing the GPU): the CUDA kernels and
    the device block tables, by either exchange (the all-gather is "auto" on 2 ranks); without
    error feedback at 2 bits, the fitted codes. The exact mean of the local gradients is the
    reference."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    local_model = nn.Sequential(nn.Linear(300, 500), nn.Tanh(), nn.Linear(500, 10)).cuda()
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(300, 500), nn.Tanh(), nn.Linear(500, 10)).cuda(),
              device_ids=[0])
    state = ddpx.hooks.QuantizedState(bits=bits, block_size=64, start_iter=0,
                                      use_error_feedback=ef, exchange=exchange)
    ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(16, 300, generator=g).cuda()
        local_model.zero_grad()
        local_model(x).square().sum().backward()
        ddp.zero_grad()
        ddp(x).square().sum().backward()
        got = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        out.append((dc.flat_grad(local_model), got.cpu()))
    residuals = {k: v.device.type for k, v in state.worker_residuals().items()}
    return out, residuals


@pytest.mark.parametrize("bits,exchange,ef", [(8, "auto", True), (1, "auto", True),
                                               (8, "reduce_scatter", True),
                                               (2, "auto", False)])
def test_quantized_hook_on_cuda(bits, exchange, ef):
    res = run_ranks(rank_quantized_cuda, 2, args=(bits, exchange, ef), timeout=300)
    for step in range(3):
        exact = (res[0][0][step][0] + res[1][0][step][0]) / 2
        got = [res[r][0][step][1] for r in range(2)]
        assert torch.equal(got[0], got[1]), step  # every rank the same bits
        if step == 0:  # the first step: within the two quantizations' error
            rel = ((got[0] - exact).norm() / exact.norm()).item()
            assert 0 < rel <= {8: 0.05, 2: 1.0, 1: 2.0}[bits], rel
    if ef:
        assert set(res[0][1].values()) == {"cpu"}  # worker_residuals() returns CPU copies
