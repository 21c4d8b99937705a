"""The compression kernels through ddpx._C.scaled_cast / sum_rows, against torch's own
conversions: bit for bit (16-bit results compared as int16 bit patterns).

Sizes cover the CPU kernels' paths: F16C's 8-wide loop and its scalar tail (n % 8 != 0), and
the 2048-element blocking (n > 2048).
"""
import pytest
import torch

import ddpx

C = ddpx._C
SIZES = [1, 7, 8, 2048, 5003]
SCALES = [1.0, 0.5, 1 / 3, 1 / 7]
HALF_TYPES = [torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, for exact comparison (-0.0 vs 0.0 included); NaNs must be compared apart."""
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    mismatch = (bits(got) != bits(expected)) & ~nan
    if mismatch.any():
        i = mismatch.nonzero()[0].item()
        raise AssertionError(f"{mismatch.sum().item()} of {got.numel()} differ, first at {i}: "
                             f"got {got[i].item()!r}, expected {expected[i].item()!r}")


def wide_range(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Values from 1e-9 to 1e6 in magnitude (fp16 subnormals, normals and overflow), both signs,
    with exact zeros, infinities, and fp16's rounding boundaries at the front."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(-9, 6, generator=g))
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    x = (mag * sign).to(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65519.99, 65520.0,
                             -65520.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14,
                             1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8,
                             3.0e38], dtype=dtype)
    k = min(n, specials.numel())
    x[:k] = specials[:k]
    return x


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"scale{s:.3g}")
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_scaled_cast_fp32_to_16bit(dtype, scale, n):
    x = wide_range(n, seed=n)
    expected = (x * scale if scale != 1.0 else x).to(dtype)  # fp32 multiply, one rounding
    assert_same_bits(C.scaled_cast(x, dtype, scale), expected)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_16bit_to_fp32_every_bit_pattern(dtype):
    """Decompression of all 65536 bit patterns (subnormals, infinities, NaNs) is exact, and the
    round trip back to 16 bits is the identity (NaNs stay NaN)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    wide = C.scaled_cast(x, torch.float32, 1.0)
    assert_same_bits(wide, x.float())
    assert_same_bits(C.scaled_cast(wide, dtype, 1.0), x)
    assert_same_bits(C.scaled_cast(x, torch.float64, 1.0), x.double())


def test_nan_stays_nan():
    x = torch.tensor([float("nan"), -float("nan"), 1.0] * 5)
    for dtype in HALF_TYPES + [torch.float32, torch.float64]:
        y = C.scaled_cast(x, dtype, 0.5)
        assert torch.isnan(y[0::3]).all() and torch.isnan(y[1::3]).all(), dtype
        assert (y[2::3] == 0.5).all(), dtype


@pytest.mark.parametrize("src,dst", [(torch.float16, torch.bfloat16),
                                     (torch.bfloat16, torch.float16)], ids=str)
def test_scaled_cast_16bit_to_16bit(src, dst):
    x = wide_range(5003, seed=1).to(src)
    assert_same_bits(C.scaled_cast(x, dst, 1.0), x.float().to(dst))
    assert_same_bits(C.scaled_cast(x, dst, 0.25), (x.float() * 0.25).to(dst))


@pytest.mark.parametrize("dtype", HALF_TYPES + [torch.float32], ids=str)
def test_scaled_cast_from_fp64(dtype):
    """fp64 buckets: the cast is one conversion, through fp32 like torch's own."""
    x = wide_range(5003, seed=2, dtype=torch.float64)
    assert_same_bits(C.scaled_cast(x, dtype, 1.0), x.to(dtype))
    assert_same_bits(C.scaled_cast(x, dtype, 0.5), (x * 0.5).to(dtype))


def test_scaled_cast_fp32_to_fp32_and_fp64():
    x = wide_range(5003, seed=3)
    assert_same_bits(C.scaled_cast(x, torch.float32, 1 / 3), x * (1 / 3))
    assert_same_bits(C.scaled_cast(x, torch.float64, 1.0), x.double())


def test_scaled_cast_fp64_keeps_fp64_scale():
    x = torch.randn(1000, dtype=torch.float64)
    assert_same_bits(C.scaled_cast(x, torch.float64, 1 / 3), x * (1 / 3))


def test_sum_rows_fp64_keeps_fp64_scale():
    x = torch.randn(3, 1000, dtype=torch.float64)
    assert_same_bits(C.sum_rows(x, torch.float64, 1 / 3), (x[0] + x[1] + x[2]) * (1 / 3))


def seq_sum(rows: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    out = rows[0].to(acc)
    for r in rows[1:]:
        out = out + r.to(acc)
    return out


@pytest.mark.parametrize("n", [1, 7, 2048, 5003])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("src", HALF_TYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("out", HALF_TYPES + [torch.float32], ids=str)
def test_sum_rows(out, src, rows, n):
    """out = cast(scale * (rows[0] + rows[1] + ...)), accumulated in fp32 in row order."""
    g = torch.Generator().manual_seed(rows * 10000 + n)
    x = (torch.randn(rows, n, generator=g) * 100).to(src)
    acc = seq_sum(x, torch.float32)
    assert_same_bits(C.sum_rows(x, out, 1.0), acc.to(out))
    assert_same_bits(C.sum_rows(x, out, 1 / 3), (acc * (1 / 3)).to(out))


def test_sum_rows_no_16bit_partial_rounding():
    """fp16 rows whose fp16 running sum would round (2048 + 1 + 1 in fp16 is 2048): summed in
    fp32 they give 2050, and partial sums beyond 65504 do not overflow."""
    x = torch.tensor([[2048.0, 60000.0], [1.0, 60000.0], [1.0, -60000.0]], dtype=torch.float16)
    got = C.sum_rows(x, torch.float32, 1.0)
    assert got.tolist() == [2050.0, 60000.0]
    assert C.sum_rows(x, torch.float16, 1.0).tolist() == [2050.0, 60000.0]


def test_sum_rows_fp64():
    x = torch.randn(4, 3001, dtype=torch.float64)
    assert_same_bits(C.sum_rows(x, torch.float64, 1.0), seq_sum(x, torch.float64))
    h = x.half()
    assert_same_bits(C.sum_rows(h, torch.float64, 1.0), seq_sum(h, torch.float64))


def test_non_contiguous_input_is_read_in_logical_order():
    x = wide_range(64 * 33, seed=4).reshape(64, 33).t()
    assert not x.is_contiguous()
    assert_same_bits(C.scaled_cast(x, torch.float16, 1.0), x.reshape(-1).half())
    assert_same_bits(C.sum_rows(x, torch.float32, 1.0), seq_sum(x.contiguous(), torch.float32))


def test_empty():
    assert C.scaled_cast(torch.empty(0), torch.float16, 0.5).numel() == 0
    assert C.sum_rows(torch.empty(3, 0), torch.float16, 1.0).numel() == 0


def test_kernel_argument_errors():
    with pytest.raises(RuntimeError, match="2-D"):
        C.sum_rows(torch.ones(4), torch.float32, 1.0)
    with pytest.raises(RuntimeError, match="at least one row"):
        C.sum_rows(torch.ones(0, 4), torch.float32, 1.0)
    with pytest.raises(RuntimeError, match="floating-point"):
        C.scaled_cast(torch.ones(4), torch.int32, 1.0)
    with pytest.raises(RuntimeError, match="floating-point"):
        C.scaled_cast(torch.ones(4, dtype=torch.int64), torch.float16, 1.0)
    with pytest.raises(TypeError, match="torch.dtype"):
        C.scaled_cast(torch.ones(4), "float16", 1.0)
    with pytest.raises(RuntimeError, match="sparse"):
        C.scaled_cast(torch.ones(4).to_sparse(), torch.float16, 1.0)


# ---- PowerSGD's batched Gram-Schmidt (orthogonalize_) ----------------------------------------

GS_SHAPES = [(40, 1), (300, 1), (40, 2), (300, 2), (40, 4), (300, 4), (64, 32), (300, 32)]
# A few tall matrices (PowerSGD's P of a 4096-row layer): on CUDA, each spread over several
# blocks (kernels/orthogonalize_cuda.h: at least 1024 rows, at most 32 columns).
GS_TALL_SHAPES = [(4096, 32), (1500, 4), (1025, 1), (2000, 2), (64, 32)]


def gs_inputs(dtype, seed=0, shapes=GS_SHAPES):
    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(n, r, generator=g, dtype=torch.float64) for n, r in shapes]
    flat = torch.cat([m.reshape(-1) for m in mats]).to(dtype)
    return mats, flat


def split_gs(flat, shapes=GS_SHAPES):
    out, pos = [], 0
    for n, r in shapes:
        out.append(flat[pos:pos + n * r].double().view(n, r))
        pos += n * r
    return out


def qr_positive(m):
    """The Q of m's QR with a positive diagonal in R: what Gram-Schmidt computes."""
    q, r = torch.linalg.qr(m)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


@pytest.mark.parametrize("shapes", [GS_SHAPES, GS_TALL_SHAPES], ids=["short", "tall"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_orthogonalize_matches_qr_up_to_rank_32(dtype, shapes):
    """Ranks 1 to 32 (one launch for all the matrices): orthonormal columns, equal to the Q of a
    fp64 QR (sign-normalised) within a few units of rounding times the (small) condition number
    of Gaussian matrices; ranks above 2 take the second Gram-Schmidt pass."""
    mats, flat = gs_inputs(dtype, shapes=shapes)
    C.orthogonalize_(flat, [n for n, _ in shapes], [r for _, r in shapes], 0.0)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    for (n, r), m, q in zip(shapes, mats, split_gs(flat, shapes)):
        eye = torch.eye(r, dtype=torch.float64)
        assert (q.T @ q - eye).abs().max() <= tol * r, (n, r)
        cond = torch.linalg.cond(m).item()
        assert (q - qr_positive(m)).abs().max() <= tol * cond * r, (n, r)


def check_orthogonalize_16bit_region(dtype, device):
    """16-bit buffers are orthogonalised in fp32, converting only the matrices' region (PowerSGD
    keeps its uncompressed values in front of its Ps): the values before and after it stay bit
    for bit, and the matrices equal the fp32 kernel's result on the same values, rounded."""
    _, matrices = gs_inputs(torch.float32)
    head, tail = 37, 5
    flat = torch.cat([torch.randn(head), matrices, torch.randn(tail)]).to(dtype).to(device)
    before = flat.clone()
    wide = flat[head:head + matrices.numel()].float()
    rows, cols = [n for n, _ in GS_SHAPES], [r for _, r in GS_SHAPES]
    C.orthogonalize_(wide, rows, cols, 0.0)
    C.orthogonalize_(flat, rows, cols, 0.0, first=head)
    bits = lambda t: t.cpu().view(torch.int16)  # noqa: E731
    assert torch.equal(bits(flat[:head]), bits(before[:head]))
    assert torch.equal(bits(flat[-tail:]), bits(before[-tail:]))
    assert torch.equal(bits(flat[head:-tail]), bits(wide.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_orthogonalize_16bit_touches_only_the_matrices(dtype):
    check_orthogonalize_16bit_region(dtype, "cpu")


def check_prepared_orthogonalize(device):
    """prepare_orthogonalize_ (the benchmarks' form: descriptors uploaded once) computes what
    orthogonalize_ does, bit for bit, call after call, in every dtype, from `first` on."""
    rows, cols = [n for n, _ in GS_TALL_SHAPES], [r for _, r in GS_TALL_SHAPES]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        _, matrices = gs_inputs(torch.float32, seed=11, shapes=GS_TALL_SHAPES)
        flat = torch.cat([torch.randn(9), matrices]).to(dtype).to(device)
        prepared = C.prepare_orthogonalize_(flat, rows, cols, 0.0, first=9)
        for _ in range(2):
            want, got = flat.clone(), flat.clone()
            C.orthogonalize_(want, rows, cols, 0.0, first=9)
            prepared(got)
            assert torch.equal(got.cpu(), want.cpu()), dtype
            flat = want


def test_prepared_orthogonalize_equals_orthogonalize():
    check_prepared_orthogonalize("cpu")


def test_orthogonalize_argument_errors():
    """Checked before any kernel runs (on a GPU an out-of-bounds write would poison the context);
    the buffer is left as it was."""
    with pytest.raises(RuntimeError, match="same length"):
        C.orthogonalize_(torch.ones(8), [4, 4], [2], 0.0)
    with pytest.raises(RuntimeError, match="more columns"):
        C.orthogonalize_(torch.ones(8), [2], [4], 0.0)
    short = torch.ones(7)
    with pytest.raises(RuntimeError, match="extend to element 8 but the buffer has 7"):
        C.orthogonalize_(short, [4], [2], 0.0)
    assert torch.equal(short, torch.ones(7))
