"""One backward pass through real DDP models: ddpx's gradients against torch's hooks and closed
forms, for drop-in (ddp.register_comm_hook) and native (ddpx.register_comm_hook) registration,
on 2, 3 and 4 Gloo ranks, with several buckets, and with gradient_as_bucket_view / static_graph.

Each scenario runs once (one launch of W ranks) and several tests read its results.
"""
import functools

import pytest
import torch

import ddp_cases as dc
import selection
import torch_compat as tc
from dist_utils import run_ranks

VARIANTS = {
    "default": {},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_ctor": {"static_graph": "ctor"},  # DistributedDataParallel(..., static_graph=True)
    "static_method": {"static_graph": "method"},  # ddp._set_static_graph()
    "bucket_view+static": {"gradient_as_bucket_view": True, "static_graph": "ctor"},
}
SCENARIOS = [
    (2, "default"), (3, "default"), (4, "default"),
    (2, "bucket_view"), (3, "bucket_view"),
    (2, "static_ctor"), (3, "static_method"), (3, "bucket_view+static"),
]
ITERATIONS = 3  # iteration 0: DDP's single initial bucket; 1 and 2: rebuilt, several buckets
SCENARIO_IDS = [f"W{w}-{v}" for w, v in SCENARIOS]


@functools.lru_cache(maxsize=None)
def grads(world_size: int, variant: str):
    """results[rank][config][iteration] -> flat gradient."""
    torch_names = tuple(dc.TORCH_HOOKS)
    if tc.TORCH_BF16_HOOKS_ON_GLOO:
        torch_names += tuple(dc.TORCH_HOOKS_NCCL)
    configs = selection.wanted(__name__, dc.all_configs(torch_names=torch_names))
    return run_ranks(dc.rank_grads, world_size, args=(configs, ITERATIONS),
                     kwargs=VARIANTS[variant])


def local_grads(res, it):
    return [res[r]["local"][it] for r in range(len(res))]


def assert_same_on_all_ranks(res, config):
    for it in range(ITERATIONS):
        for r in range(1, len(res)):
            assert torch.equal(res[r][config][it], res[0][config][it]), (
                f"{config}: rank {r} differs from rank 0 at iteration {it}")


def assert_matches_builtin(got, builtin, local):
    """allreduce_hook against DDP's built-in allreduce (no hook): bit-identical when 1/W is a
    power of two. Otherwise they differ in torch itself: the built-in path multiplies by 1/W
    (rounded to the gradient dtype) where allreduce_hook, torch's and ddpx's, divides by W;
    the results then differ by roundings of each x_r / W and of the W - 1 partial sums."""
    world_size = len(local)
    if world_size & (world_size - 1) == 0:
        assert torch.equal(got, builtin)
    else:
        eps = torch.finfo(got.dtype).eps
        bound = 2 * world_size * eps * dc.mean_abs(local)
        assert max_violation(got, builtin, bound) <= 0


def compressed_grads(res, kind, dtype16):
    """(config, iteration, local gradients, rank 0's result) of ddpx's ``kind`` compress hook,
    drop-in and native, each checked first: the same on every rank, fp32, equal bit for bit to
    the closed form (one ``dtype16`` rounding of x_r / W per rank, summed in fp32), and not the
    fp32 mean (the values did go through 16 bits)."""
    for mode in dc.MODES:
        config = f"ddpx_{kind}_{mode}"
        assert_same_on_all_ranks(res, config)
        for it in range(ITERATIONS):
            local = local_grads(res, it)
            got = res[0][config][it]
            assert got.dtype == torch.float32
            expected = dc.ref_compress_hook(local, dtype16)
            assert torch.equal(got, expected), (config, it, (got - expected).abs().max())
            assert not torch.equal(got, res[0]["torch_allreduce"][it])
            yield config, it, local, got


def max_violation(actual, expected, bound):
    """max(|actual - expected| - bound): <= 0 when every element is within its bound."""
    return ((actual.double() - expected.double()).abs() - bound).max().item()


def test_several_buckets():
    """The set-up the other tests rely on: one bucket in the first backward pass, then DDP's
    rebuilt buckets of BUCKET_BYTES: several per pass, covering every parameter."""
    numel = sum(p.numel() for p in dc.make_model().parameters())
    for rank_sizes in run_ranks(dc.rank_bucket_sizes, 2):
        assert rank_sizes[0] == [numel]
        for sizes in rank_sizes[1:]:
            assert len(sizes) >= 4, sizes
            assert sum(sizes) == numel


@pytest.mark.cases("ddpx_allreduce_*", "torch_allreduce", "torch_none")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_allreduce_bit_identical_to_torch(world_size, variant):
    res = grads(world_size, variant)
    for mode in dc.MODES:
        config = f"ddpx_allreduce_{mode}"
        assert_same_on_all_ranks(res, config)
        for r in range(world_size):
            for it in range(ITERATIONS):
                got = res[r][config][it]
                assert torch.equal(got, res[r]["torch_allreduce"][it]), (config, r, it)
                assert_matches_builtin(got, res[r]["torch_none"][it], local_grads(res, it))
        # Not trivially equal: it is the mean of the ranks' local gradients, and not rank 0's.
        for it in range(ITERATIONS):
            local = local_grads(res, it)
            torch.testing.assert_close(res[0][config][it].double(), dc.exact_mean(local),
                                       rtol=1e-5, atol=1e-7)
            assert not torch.equal(res[0][config][it], local[0])


@pytest.mark.cases("ddpx_fp16_*", "torch_fp16", "torch_allreduce")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_fp16_compress_hook(world_size, variant):
    """ddpx fp16: equal, bit for bit, to its closed form (one fp16 rounding of x_r / W per rank,
    summed in fp32; on 3 or more ranks one more of the sum, ddp_cases.ref_compress_hook);
    within fp16 rounding of torch's fp16_compress_hook (bound in ddp_cases.fp16_vs_torch_bound).
    On 2 ranks, closer to the exact mean than torch's overall. On 3 or more both results end with
    one fp16 rounding of the mean, so neither is closer everywhere: ddpx's is within its own
    bound, U S for the ranks' roundings plus U |mean| for the last one (and a subnormal half-ulp
    per rounding)."""
    res = grads(world_size, variant)
    for config, it, local, got in compressed_grads(res, "fp16", torch.float16):
        ref = res[0]["torch_fp16"][it]
        bound = dc.fp16_vs_torch_bound(local)
        assert max_violation(got, ref, bound) <= 0, (config, it)
        mean = dc.exact_mean(local)
        if world_size == 2:
            err_ddpx = (got.double() - mean).norm()
            err_torch = (ref.double() - mean).norm()
            assert err_ddpx <= err_torch, (config, it, err_ddpx, err_torch)
        else:
            own = (dc.U_FP16 * (dc.mean_abs(local) * (1 + dc.U_FP16) + mean.abs())
                   + world_size * 2.0 ** -24 * dc.mean_abs(local)
                   + (world_size + 1) * dc.FP16_SUBNORMAL_HALF_ULP)
            assert max_violation(got, mean, own) <= 0, (config, it)


@pytest.mark.cases("ddpx_bf16_*", "torch_allreduce")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_bf16_compress_hook(world_size, variant):
    """ddpx bf16 on Gloo (torch 1.13's own refuses Gloo; 2.x's CUDA builds accept it, see
    test_bf16_against_torchs_own): equal to the closed form (mean of
    bf16(x_r / W), summed in fp32), and within bf16 rounding of the exact mean: one rounding
    of each x_r / W, |error| <= U_BF16 * mean_r |x_r|, plus fp32 summation (W 2^-24 S), plus on
    3 or more ranks the rounding of the sum to bf16 (U_BF16 |mean|, the reduce-scatter)."""
    res = grads(world_size, variant)
    for config, it, local, got in compressed_grads(res, "bf16", torch.bfloat16):
        bound = (dc.U_BF16 + world_size * 2.0 ** -24) * dc.mean_abs(local)
        if world_size >= 3:
            bound = bound * (1 + dc.U_BF16) + dc.U_BF16 * dc.exact_mean(local).abs()
        assert max_violation(got, dc.exact_mean(local), bound) <= 0, (config, it)


@pytest.mark.skipif(not tc.TORCH_BF16_HOOKS_ON_GLOO,
                    reason="this torch's bf16 hooks refuse Gloo (torch 1.13, or a CPU-only build)")
@pytest.mark.cases("ddpx_bf16_*", "torch_bf16*", "torch_allreduce")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_bf16_against_torchs_own(world_size, variant):
    """Where torch's own bf16 hooks run on Gloo (torch 2.x CUDA builds): ddpx's bf16 hook and
    wrapper against them, within the rounding bound of the two orders of operations (torch:
    cast, divide in bf16, sum along Gloo's ring in bf16; ddpx: x_r / W rounded once, summed
    in fp32), and ddpx's hook no further from the exact mean than torch's."""
    res = grads(world_size, variant)
    assert_same_on_all_ranks(res, "torch_bf16")
    for mode in dc.MODES:
        for it in range(ITERATIONS):
            local = local_grads(res, it)
            bound = dc.bf16_vs_torch_bound(local)
            got = res[0][f"ddpx_bf16_{mode}"][it]
            ref = res[0]["torch_bf16"][it]
            assert not torch.equal(ref, res[0]["torch_allreduce"][it])  # torch's went via bf16
            assert max_violation(got, ref, bound) <= 0, (mode, it)
            mean = dc.exact_mean(local)
            assert (got.double() - mean).norm() <= (ref.double() - mean).norm(), (mode, it)
            wrap = res[0][f"ddpx_bf16_wrap_{mode}"][it]
            wrap_ref = res[0]["torch_bf16_wrap"][it]
            assert max_violation(wrap, wrap_ref, bound + dc.U_BF16 * dc.mean_abs(local)) <= 0


@pytest.mark.cases("ddpx_fp16_*", "ddpx_bf16_*", "torch_fp16_wrap")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_compress_wrappers(world_size, variant):
    """fp16/bf16_compress_wrapper(allreduce_hook): equal to their closed form (cast x_r, sum in
    fp32, times 1/W, round the mean to 16 bits); close to the compress hook of the same dtype
    and, for fp16, to torch's fp16_compress_wrapper(allreduce_hook).

    The wrapper rounds x_r (not x_r / W) and then the mean once more, so against the hook it
    may differ by one more rounding: bound (W + 4) U S for fp16 against torch, 3 U S + subnormal
    terms for wrapper against hook, U_BF16-based for bf16."""
    res = grads(world_size, variant)
    for mode in dc.MODES:
        for name, dtype16, u in (("fp16", torch.float16, dc.U_FP16),
                                 ("bf16", torch.bfloat16, dc.U_BF16)):
            config = f"ddpx_{name}_wrap_{mode}"
            assert_same_on_all_ranks(res, config)
            for it in range(ITERATIONS):
                local = local_grads(res, it)
                s = dc.mean_abs(local)
                got = res[0][config][it]
                expected = dc.ref_compress_wrapper_allreduce(local, dtype16)
                assert torch.equal(got, expected), (config, it, (got - expected).abs().max())
                hook = res[0][f"ddpx_{name}_{mode}"][it]
                tiny = 4 * world_size * dc.FP16_SUBNORMAL_HALF_ULP if name == "fp16" else 0.0
                assert max_violation(got, hook, 3 * u * s + tiny) <= 0, (config, it)
                if name == "fp16":
                    ref = res[0]["torch_fp16_wrap"][it]
                    bound = dc.fp16_vs_torch_bound(local) + dc.U_FP16 * s
                    assert max_violation(got, ref, bound) <= 0, (config, it)


@pytest.mark.cases("ddpx_noop_*")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_noop_keeps_local_gradients(world_size, variant):
    res = grads(world_size, variant)
    for mode in dc.MODES:
        config = f"ddpx_noop_{mode}"
        for it in range(ITERATIONS):
            for r in range(world_size):
                assert torch.equal(res[r][config][it], res[r]["local"][it]), (config, r, it)
            for r in range(1, world_size):
                assert not torch.equal(res[r][config][it], res[0][config][it])


@pytest.mark.cases("ddpx_bf16_wrap_noop_*")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_wrapper_over_noop_rounds_local_gradients(world_size, variant):
    """bf16_compress_wrapper(noop_hook): no communication, each rank's own gradient rounded to
    bf16 and back."""
    res = grads(world_size, variant)
    for mode in dc.MODES:
        for r in range(world_size):
            for it in range(ITERATIONS):
                local = res[r]["local"][it]
                got = res[r][f"ddpx_bf16_wrap_noop_{mode}"][it]
                assert torch.equal(got, local.to(torch.bfloat16).float()), (mode, r, it)
                assert not torch.equal(got, local)


@pytest.mark.cases("ddpx_*")
@pytest.mark.parametrize("world_size,variant", SCENARIOS, ids=SCENARIO_IDS)
def test_dropin_equals_native(world_size, variant):
    """Both registrations run the same C++ hook: bit-identical gradients on every rank."""
    res = grads(world_size, variant)
    for hook in dc.DDPX_HOOKS:
        for r in range(world_size):
            for it in range(ITERATIONS):
                assert torch.equal(res[r][f"ddpx_{hook}_dropin"][it],
                                   res[r][f"ddpx_{hook}_native"][it]), (hook, r, it)


def test_fp16_divides_before_cast():
    """Gradients beyond fp16's range (65504) but whose mean is within it: torch casts before
    dividing and overflows to inf; ddpx divides first and stays finite and exact (closed form)."""
    world_size = 2
    # Scale the loss so that the largest local gradient of any rank is 1e5 (> 65504, and
    # 1e5 / W < 65504).
    largest = 0.0
    for rank in range(world_size):
        probe = dc.make_model()
        dc.loss_fn(probe, *dc.make_batch(rank, 0)).backward()
        largest = max(largest, dc.flat_grad(probe).abs().max().item())
    loss_scale = 1e5 / largest
    res = run_ranks(dc.rank_grads, world_size,
                    args=(["torch_fp16", "ddpx_fp16_dropin", "ddpx_fp16_native"], 1),
                    kwargs={"loss_scale": loss_scale})
    local = local_grads(res, 0)
    assert max(x.abs().max().item() for x in local) > 65504
    assert not torch.isfinite(res[0]["torch_fp16"][0]).all()
    for mode in dc.MODES:
        got = res[0][f"ddpx_fp16_{mode}"][0]
        assert torch.isfinite(got).all(), mode
        assert torch.equal(got, dc.ref_compress_hook(local, torch.float16)), mode
        bound = dc.U_FP16 * dc.mean_abs(local) * 1.01 + 2 * dc.FP16_SUBNORMAL_HALF_ULP
        assert max_violation(got, dc.exact_mean(local), bound) <= 0, mode


def test_float64_model():
    """A float64 model: allreduce bit-identical to torch's; 16-bit hooks equal to their closed
    forms (summed in fp64) and results stay float64. W = 3 so that 1/W is not exact."""
    world_size = 3
    configs = dc.all_configs(torch_names=("torch_none", "torch_allreduce", "torch_fp16"))
    res = run_ranks(dc.rank_grads, world_size, args=(configs, 2),
                    kwargs={"dtype": torch.float64})
    for it in range(2):
        local = local_grads(res, it)
        assert all(x.dtype == torch.float64 for x in local)
        for mode in dc.MODES:
            for r in range(world_size):
                got = res[r][f"ddpx_allreduce_{mode}"][it]
                assert got.dtype == torch.float64
                assert torch.equal(got, res[r]["torch_allreduce"][it])
                assert_matches_builtin(got, res[r]["torch_none"][it], local)
            for name, dtype16 in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
                got = res[0][f"ddpx_{name}_{mode}"][it]
                assert got.dtype == torch.float64
                assert torch.equal(got, dc.ref_compress_hook(local, dtype16)), (name, mode)
                assert torch.equal(res[0][f"ddpx_{name}_wrap_{mode}"][it],
                                   dc.ref_compress_wrapper_allreduce(local, dtype16))
            got = res[0][f"ddpx_fp16_{mode}"][it]
            bound = dc.fp16_vs_torch_bound(local)
            assert max_violation(got, res[0]["torch_fp16"][it], bound) <= 0
            for r in range(world_size):
                assert torch.equal(res[r][f"ddpx_noop_{mode}"][it], local[r])
