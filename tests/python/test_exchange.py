"""The exchange modes of the native hooks (ddpx._C.ExchangeMode), built with ddpx._C and
installed with ddpx._C.register_comm_hook, in real DDP models on Gloo.

AUTO resolves, for 16-bit values on Gloo, to ALLGATHER on 2 ranks and to REDUCE_SCATTER on 3 or
more (covered by test_grads through ddp_cases.ref_compress_hook); here the explicit modes:
ALLGATHER and REDUCE_SCATTER for fp32/fp64 allreduce, ALLREDUCE (Gloo's own fp16 sums) for the
fp16 hook and the fp16 wrapper, REDUCE_SCATTER for the fp16 hook on any world size.
"""
import functools

import pytest
import torch
import torch.distributed as dist

import ddp_cases as dc
import ddpx
from dist_utils import run_ranks

C = ddpx._C
MODE = C.ExchangeMode


def make_native(name: str):
    pg = dist.group.WORLD
    return {
        "allreduce_ALLREDUCE": lambda: C.allreduce_hook(pg, MODE.ALLREDUCE),
        "allreduce_ALLGATHER": lambda: C.allreduce_hook(pg, MODE.ALLGATHER),
        "fp16_ALLREDUCE": lambda: C.compress_hook(pg, torch.float16, MODE.ALLREDUCE),
        "fp16_ALLGATHER": lambda: C.compress_hook(pg, torch.float16, MODE.ALLGATHER),
        "fp16_wrap_allreduce_ALLREDUCE": lambda: C.compress_wrapper(
            C.allreduce_hook(pg, MODE.ALLREDUCE), torch.float16),
        "allreduce_REDUCE_SCATTER": lambda: C.allreduce_hook(pg, MODE.REDUCE_SCATTER),
        "fp16_REDUCE_SCATTER": lambda: C.compress_hook(pg, torch.float16, MODE.REDUCE_SCATTER),
        "bf16_REDUCE_SCATTER": lambda: C.compress_hook(pg, torch.bfloat16, MODE.REDUCE_SCATTER),
        "fp16_wrap_allreduce_REDUCE_SCATTER": lambda: C.compress_wrapper(
            C.allreduce_hook(pg, MODE.REDUCE_SCATTER), torch.float16),
        "fp16_wrap_allreduce_ALLGATHER": lambda: C.compress_wrapper(
            C.allreduce_hook(pg, MODE.ALLGATHER), torch.float16),
    }[name]()


NATIVE = ["allreduce_ALLREDUCE", "allreduce_ALLGATHER", "fp16_ALLREDUCE", "fp16_ALLGATHER",
          "fp16_wrap_allreduce_ALLREDUCE", "allreduce_REDUCE_SCATTER", "fp16_REDUCE_SCATTER",
          "bf16_REDUCE_SCATTER", "fp16_wrap_allreduce_REDUCE_SCATTER",
          "fp16_wrap_allreduce_ALLGATHER"]


def rank_exchange(rank: int, world_size: int, dtype: torch.dtype):
    out = dc.rank_grads(rank, world_size,
                        ["torch_allreduce", "torch_fp16", "torch_fp16_wrap", "ddpx_fp16_native"],
                        iterations=2, dtype=dtype)
    for name in NATIVE:
        ddp = dc.make_ddp(dc.make_model(dtype), "torch_none")
        C.register_comm_hook(ddp.reducer, make_native(name))
        out[name] = []
        for it in range(2):
            ddp.zero_grad()
            dc.loss_fn(ddp, *dc.make_batch(rank, it, dtype)).backward()
            out[name].append(dc.flat_grad(ddp))
    return out


@functools.lru_cache(maxsize=None)
def exchange(world_size: int, dtype: torch.dtype = torch.float32):
    return run_ranks(rank_exchange, world_size, args=(dtype,))


def local_grads(res, it):
    return [r["local"][it] for r in res]


def max_violation(actual, expected, bound):
    return ((actual.double() - expected.double()).abs() - bound).max().item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_modes(world_size):
    """ALLREDUCE is torch's allreduce_hook bit for bit. ALLGATHER sums the fp32 gradients in
    rank order and divides the sum once: its closed form exactly."""
    res = exchange(world_size)
    for it in range(2):
        local = local_grads(res, it)
        for r in range(world_size):
            assert torch.equal(res[r]["allreduce_ALLREDUCE"][it], res[r]["torch_allreduce"][it])
            got = res[r]["allreduce_ALLGATHER"][it]
            expected = dc._seq_sum(local, torch.float32) * (1.0 / world_size)
            assert torch.equal(got, expected), (r, it)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_modes(world_size):
    """fp16 ALLGATHER is what AUTO picks on 2 Gloo ranks. fp16 ALLREDUCE sums fp16 values in Gloo:
    with 2 ranks that is one fp16 rounding of fp16(x_0 / 2) + fp16(x_1 / 2), i.e. the closed form
    fp16(fp16(x_0 / 2) + fp16(x_1 / 2)); with more, W - 1 fp16 roundings of partial sums, within
    (W - 1) U S (+ subnormal terms) of the ALLGATHER result; and within the torch bound."""
    res = exchange(world_size)
    for it in range(2):
        local = local_grads(res, it)
        gathered = res[0]["fp16_ALLGATHER"][it]
        if world_size == 2:
            assert torch.equal(gathered, res[0]["ddpx_fp16_native"][it])
        got = res[0]["fp16_ALLREDUCE"][it]
        for r in range(1, world_size):
            assert torch.equal(res[r]["fp16_ALLREDUCE"][it], got)
        if world_size == 2:
            parts = [(x * 0.5).half() for x in local]
            assert torch.equal(got, (parts[0] + parts[1]).float())
        bound = ((world_size - 1) * dc.U_FP16 * dc.mean_abs(local)
                 + world_size * dc.FP16_SUBNORMAL_HALF_ULP)
        assert max_violation(got, gathered, bound) <= 0
        assert max_violation(got, res[0]["torch_fp16"][it], dc.fp16_vs_torch_bound(local)) <= 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_wrapper_over_allreduce_mode_equals_torch(world_size):
    """fp16_compress_wrapper(allreduce_hook in ALLREDUCE mode) performs torch's operations in
    torch's order (cast, divide in fp16, Gloo's fp16 allreduce, cast back): bit-identical to
    torch's fp16_compress_wrapper(allreduce_hook)."""
    res = exchange(world_size)
    for r in range(world_size):
        for it in range(2):
            assert torch.equal(res[r]["fp16_wrap_allreduce_ALLREDUCE"][it],
                               res[r]["torch_fp16_wrap"][it]), (r, it)


def ref_reduce_scatter(local, dtype16):
    """The reduce-scatter exchange of the compress hooks: x_r / W rounded to 16 bits, summed in
    fp32 in rank order by the chunk's owner, the sum rounded to 16 bits once."""
    scale = torch.tensor(1.0 / len(local), dtype=torch.float32).item()
    rows = [(x * scale).to(dtype16) for x in local]
    return dc._seq_sum(rows, torch.float32).to(dtype16).to(local[0].dtype)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_modes(world_size):
    """REDUCE_SCATTER, on any world size and over DDP's several buckets (each bucket's second
    all-to-all goes out from the next bucket's hook): the same bits on every rank; the compress
    hooks equal their closed form (one 16-bit rounding of each x_r / W, and one of the sum), and
    AUTO's result on 3 or more ranks; allreduce_hook on fp32 equals ALLGATHER's closed form; the
    fp16 wrapper over it equals the wrapper over ALLGATHER (the mean is rounded to 16 bits
    either way)."""
    res = exchange(world_size)
    for it in range(2):
        local = local_grads(res, it)
        for name in ("allreduce_REDUCE_SCATTER", "fp16_REDUCE_SCATTER", "bf16_REDUCE_SCATTER",
                     "fp16_wrap_allreduce_REDUCE_SCATTER"):
            for r in range(1, world_size):
                assert torch.equal(res[r][name][it], res[0][name][it]), (name, r, it)
        for name, dtype16 in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            got = res[0][f"{name}_REDUCE_SCATTER"][it]
            assert got.dtype == torch.float32
            assert torch.equal(got, ref_reduce_scatter(local, dtype16)), (name, it)
        if world_size >= 3:
            assert torch.equal(res[0]["fp16_REDUCE_SCATTER"][it], res[0]["ddpx_fp16_native"][it])
        expected = dc._seq_sum(local, torch.float32) * (1.0 / world_size)
        assert torch.equal(res[0]["allreduce_REDUCE_SCATTER"][it], expected), it
        assert torch.equal(res[0]["fp16_wrap_allreduce_REDUCE_SCATTER"][it],
                           res[0]["fp16_wrap_allreduce_ALLGATHER"][it]), it
        assert torch.equal(res[0]["fp16_wrap_allreduce_ALLGATHER"][it],
                           dc.ref_compress_wrapper_allreduce(local, torch.float16)), it


def test_allreduce_allgather_float64_precision():
    world_size = 3
    res = exchange(world_size, torch.float64)
    for it in range(2):
        local = local_grads(res, it)
        got = res[0]["allreduce_ALLGATHER"][it]
        assert got.dtype == torch.float64
        bound = 4 * world_size * 2.0 ** -53 * dc.mean_abs(local)
        assert max_violation(got, dc.exact_mean(local), bound) <= 0


def rank_large_bucket(rank: int, world_size: int, dtype16: torch.dtype):
    """A bucket of 3 x 2^20 + 5 elements: the compress hooks split it into 3 chunks whose
    exchanges overlap; the result must be the closed form, element for element. The bucket is
    DDP's only one, so the last: the reduce-scatter's second round goes out at once."""
    n = 3 * (1 << 20) + 5
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(1000 + r))
             for r in range(world_size)]
    hook = ddpx._C.compress_hook(dist.group.WORLD, dtype16)
    model = torch.nn.Linear(1, 1)  # only to get a GradBucket object from DDP
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    captured = {}

    def grab(state, bucket):
        bucket.set_buffer(x)
        fut = hook.run(bucket)
        captured["out"] = fut.wait()
        fut2 = torch.futures.Future()
        fut2.set_result(bucket.buffer()[:2].clone())
        return fut2

    ddp.register_comm_hook(None, grab)
    ddp(torch.ones(1, 1)).sum().backward()
    want = dc.ref_compress_hook(grads, dtype16)
    return {"exact": torch.equal(captured["out"], want), "same_storage":
            captured["out"].data_ptr() == x.data_ptr()}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype16", [torch.float16, torch.bfloat16])
def test_chunked_exchange_is_exact(dtype16, world_size):
    """2 ranks: the gather path; 3: the reduce-scatter path, whose 3 x 3 chunks (a short last
    one) each have their own two all-to-alls."""
    res = run_ranks(rank_large_bucket, world_size, args=(dtype16,))
    for r in res:
        assert r["exact"] and r["same_storage"], r
