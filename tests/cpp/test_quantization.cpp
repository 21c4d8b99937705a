// Tests of the uint8 min-max quantization: the kernels (src/kernels/quantize.h, through the ATen
// layer ops/quantize.h) against closed forms, and quantization_pertensor_hook /
// quantization_perchannel_hook on 1-4 Gloo ranks (threads over one HashStore) against torch's
// hooks ported line by line to ATen (`torch_hook_mean` below: the same ATen operations as
// quantization_hooks.py and its observers, so the same kernels and roundings), bit for bit.
//
// Closed forms: a channel's scale is max((max(max, 0) - min(min, 0)) / 255, eps) in fp32, its
// zero point in [0, 255], and every value dequantizes to within scale / 2 of itself (plus the
// fp32 rounding of the product, u * |x|); so the mean of W ranks is within
// (sum_r scale_r / 2) / W + (W + 2) * u * S of the exact mean.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ddpx/hooks.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "ops/quantize.h"
#include "test_utils.h"

namespace {

using ddpx::hooks::CommHookPtr;
using ddpx_test::bitwise_equal;
using ddpx_test::ProcessGroupPtr;
using ::testing::HasSubstr;

constexpr float kEps = 1.1920928955078125e-07f;  // torch.finfo(torch.float32).eps

// (channel, channels) as the hooks choose them: bucket_size 0 is per tensor.
std::pair<int64_t, int64_t> channels_of(int64_t n, int64_t bucket_size) {
  if (bucket_size == 0) return {std::max<int64_t>(n, 1), 1};
  return {bucket_size, n / bucket_size + 1};
}

struct Row {
  std::vector<float> scale, zero_point;
  std::vector<uint8_t> q;
};

Row quantize(const at::Tensor& x, int64_t bucket_size) {
  const auto cc = channels_of(x.numel(), bucket_size);
  at::Tensor row = at::empty({ddpx::ops::quantized_row_bytes(x.numel(), cc.second)}, at::kByte);
  ddpx::ops::quantize_row_into(x, cc.first, cc.second, row);
  Row r;
  const auto* f = reinterpret_cast<const float*>(row.data_ptr<uint8_t>());
  r.scale.assign(f, f + cc.second);
  r.zero_point.assign(f + cc.second, f + 2 * cc.second);
  const uint8_t* q = row.data_ptr<uint8_t>() + 8 * cc.second;
  r.q.assign(q, q + x.numel());
  return r;
}

// ---- torch's hooks, in ATen ------------------------------------------------------------------

// MinMaxObserver / PerChannelMinMaxObserver (quint8, affine): calculate_qparams.
std::pair<at::Tensor, at::Tensor> torch_qparams(const at::Tensor& x, bool per_channel) {
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor mn, mx;
  if (per_channel) {
    std::tie(mn, mx) = at::aminmax(xf, 1);
  } else {
    std::tie(mn, mx) = at::aminmax(xf);
  }
  const at::Tensor min_neg = at::min(mn, at::zeros_like(mn));
  const at::Tensor max_pos = at::max(mx, at::zeros_like(mx));
  at::Tensor scale = (max_pos - min_neg) / 255.0;
  scale = at::max(scale, at::full({1}, kEps, at::kFloat));
  at::Tensor zp = at::rsub(at::round(min_neg / scale).to(at::kInt), 0);
  zp = at::clamp(zp, 0, 255);
  return {scale.reshape({-1}), zp.reshape({-1})};
}

// quantization_pertensor_hook (bucket_size 0) / quantization_perchannel_hook: the mean it
// returns (fp32), from every rank's bucket.
at::Tensor torch_hook_mean(const std::vector<at::Tensor>& buckets, int64_t bucket_size) {
  const int64_t n = buckets[0].numel();
  at::Tensor acc;
  for (const auto& t : buckets) {
    at::Tensor deq;
    if (bucket_size == 0) {
      const auto sz = torch_qparams(t, false);
      const at::Tensor s_and_z = at::stack({sz.first[0], sz.second[0].to(at::kFloat)});
      const at::Tensor s = s_and_z[0], z = s_and_z[1];
      const at::Tensor q = at::clamp(at::round(t / s) + z, 0, 255).to(at::kByte);
      deq = s * (q.to(at::kFloat) - z);
    } else {
      const at::Tensor ch =
          at::constant_pad_nd(t, {0, bucket_size - n % bucket_size}, 0).view({-1, bucket_size});
      const auto sz = torch_qparams(ch, true);
      const at::Tensor s_and_z = at::stack({sz.first, sz.second.to(at::kFloat)});
      at::Tensor y = at::zeros(ch.sizes(), at::kFloat);
      for (int64_t i = 0; i < ch.size(0); ++i) {
        y[i].copy_(at::round(ch[i] / s_and_z[0][i]) + s_and_z[1][i]);
      }
      const at::Tensor q = at::clamp(y, 0, 255).to(at::kByte).to(at::kFloat);
      deq = at::zeros_like(q);
      for (int64_t i = 0; i < q.size(0); ++i) {
        deq[i].copy_(s_and_z[0][i] * (q[i] - s_and_z[1][i]));
      }
      deq = deq.flatten().narrow(0, 0, n);
    }
    acc = acc.defined() ? acc + deq : at::zeros({n}, at::kFloat) + deq;
  }
  return acc / static_cast<int64_t>(buckets.size());
}

at::Tensor rank_input(uint64_t seed, int rank, int64_t n, at::ScalarType dtype) {
  return ddpx_test::make_tensor(ddpx_test::random_values(ddpx_test::rank_seed(seed, rank), n),
                                dtype);
}

// ---- kernels: closed forms ---------------------------------------------------------------------

using KernelCase = std::tuple<at::ScalarType, int64_t /*n*/, int64_t /*bucket_size*/>;
class QuantizeKernel : public ::testing::TestWithParam<KernelCase> {};

TEST_P(QuantizeKernel, ParametersAndRoundTripErrorAreTorchs) {
  const auto [dtype, n, bucket_size] = GetParam();
  const at::Tensor x = rank_input(ddpx_test::mix_seed(n * 31 + bucket_size), 0, n, dtype);
  const Row r = quantize(x, bucket_size);
  const auto cc = channels_of(n, bucket_size);
  ASSERT_EQ(static_cast<int64_t>(r.scale.size()), cc.second);
  const at::Tensor xd = x.to(at::kDouble);
  const double* v = xd.data_ptr<double>();
  for (int64_t c = 0; c < cc.second; ++c) {
    const int64_t begin = std::min(n, c * cc.first), end = std::min(n, begin + cc.first);
    float mn = 0.0f, mx = 0.0f;
    for (int64_t i = begin; i < end; ++i) {
      mn = std::min(mn, static_cast<float>(v[i]));
      mx = std::max(mx, static_cast<float>(v[i]));
    }
    const float scale = std::max((mx - mn) / 255.0f, kEps);
    ASSERT_EQ(r.scale[c], scale) << "channel " << c;
    const float zp = std::min(255.0f, std::max(0.0f, -std::nearbyint(mn / scale)));
    ASSERT_EQ(r.zero_point[c], zp) << "channel " << c;
    for (int64_t i = begin; i < end; ++i) {
      const double deq = static_cast<double>(scale) * (r.q[i] - static_cast<double>(zp));
      // Half a step, plus the quotient's rounding to a 16-bit x's dtype (at most half its ulp
      // of a value <= 255 in magnitude, times the scale), plus the fp32 roundings of the scale
      // and of x / scale (a few ulps of 255: under 1e-4 steps) and of the product.
      const double slack = dtype == at::kBFloat16 ? 0.5 : dtype == at::kHalf ? 0.125 : 0.0;
      ASSERT_LE(std::abs(deq - v[i]), scale * (0.5 + slack + 1e-4) + 0x1p-23 * std::abs(v[i]))
          << "element " << i << " channel " << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, QuantizeKernel,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kHalf,
                                                              at::kBFloat16),
                                            ::testing::Values<int64_t>(1, 100, 512, 1000, 4096),
                                            ::testing::Values<int64_t>(0, 16, 512)));

TEST(QuantizeKernelEdges, ZeroBucketIsScaleEpsAndQuantizesToZero) {
  const Row r = quantize(at::zeros({40}, at::kFloat), 16);
  ASSERT_EQ(r.scale.size(), 3u);
  for (size_t c = 0; c < 3; ++c) {
    EXPECT_EQ(r.scale[c], kEps);
    EXPECT_EQ(r.zero_point[c], 0.0f);
  }
  for (uint8_t q : r.q) EXPECT_EQ(q, 0);
}

TEST(QuantizeKernelEdges, ConstantBucketsMapToTheEndsOfTheRange) {
  // Positive: min(min, 0) = 0, so zero point 0 and every value the top code 255.
  Row r = quantize(at::full({33}, 3.0f), 0);
  EXPECT_EQ(r.scale[0], 3.0f / 255.0f);
  EXPECT_EQ(r.zero_point[0], 0.0f);
  for (uint8_t q : r.q) EXPECT_EQ(q, 255);
  // Negative: max(max, 0) = 0, zero point 255 and every value code 0.
  r = quantize(at::full({33}, -3.0f), 0);
  EXPECT_EQ(r.scale[0], 3.0f / 255.0f);
  EXPECT_EQ(r.zero_point[0], 255.0f);
  for (uint8_t q : r.q) EXPECT_EQ(q, 0);
}

TEST(QuantizeKernelEdges, LengthAMultipleOfTheChannelGetsAnExtraChannelOfPadding) {
  // torch pads bucket_size - n % bucket_size zeros: 32 values in channels of 16 are 3 channels,
  // the last one all padding (scale eps, zero point 0).
  const at::Tensor x = at::arange(1, 33, at::kFloat);
  const Row r = quantize(x, 16);
  ASSERT_EQ(r.scale.size(), 3u);
  EXPECT_EQ(r.scale[0], 16.0f / 255.0f);
  EXPECT_EQ(r.scale[1], 32.0f / 255.0f);
  EXPECT_EQ(r.scale[2], kEps);
  EXPECT_EQ(r.zero_point[2], 0.0f);
  EXPECT_EQ(ddpx::ops::quantized_row_bytes(32, 3), 64);  // 24 + 32 bytes, padded to 16
  // 31 values: the last channel holds 15 values and one zero of padding.
  EXPECT_EQ(quantize(at::arange(1, 32, at::kFloat), 16).scale.size(), 2u);
}

TEST(QuantizeKernelEdges, NonFiniteChannelGetsScaleNanAndOthersAreUntouched) {
  at::Tensor x = at::arange(1, 49, at::kFloat);
  x[20] = std::numeric_limits<float>::quiet_NaN();
  x[40] = std::numeric_limits<float>::infinity();
  const Row r = quantize(x, 16);
  EXPECT_EQ(r.scale[0], 16.0f / 255.0f);
  EXPECT_TRUE(std::isnan(r.scale[1]));
  EXPECT_TRUE(std::isnan(r.scale[2]));
  EXPECT_EQ(r.zero_point[1], 0.0f);
  // The mean of a NaN channel is NaN everywhere; the finite channel is exact as ever.
  at::Tensor out = at::empty({48}, at::kFloat);
  at::Tensor row = at::empty({ddpx::ops::quantized_row_bytes(48, 4)}, at::kByte);
  ddpx::ops::quantize_row_into(x, 16, 4, row);
  ddpx::ops::dequantize_mean_into(at::empty({0}, at::kByte), row, 0, 16, 4, out);
  EXPECT_TRUE(at::isnan(out.narrow(0, 16, 32)).all().item<bool>());
  EXPECT_TRUE(at::isfinite(out.narrow(0, 0, 16)).all().item<bool>());
}

TEST(QuantizeKernelEdges, BadArgumentsAreRefused) {
  at::Tensor x = at::ones({10});
  at::Tensor row = at::empty({ddpx::ops::quantized_row_bytes(10, 1)}, at::kByte);
  EXPECT_THAT(ddpx_test::error_message([&] { ddpx::ops::quantize_row_into(x, 4, 2, row); }),
              HasSubstr("cannot hold 10 values"));
  EXPECT_THAT(ddpx_test::error_message(
                  [&] { ddpx::ops::quantize_row_into(x, 10, 1, row.narrow(0, 0, 8)); }),
              HasSubstr("row must hold"));
  EXPECT_THAT(ddpx_test::error_message(
                  [&] { ddpx::ops::quantize_row_into(at::ones({10}, at::kInt), 10, 1, row); }),
              HasSubstr("floating-point"));
}

// ---- the hooks on Gloo ranks -------------------------------------------------------------------

using HookCase = std::tuple<int /*world*/, at::ScalarType, int64_t /*n*/, int64_t /*bucket_size*/>;
class QuantizationHookTest : public ::testing::TestWithParam<HookCase> {};

// Whether this torch's at::round runs on CPU tensors of `dtype`.
bool cpu_round_supports(at::ScalarType dtype) {
  try {
    at::round(at::ones({2}, at::TensorOptions().dtype(dtype)));
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

TEST_P(QuantizationHookTest, EqualsTorchsHookBitForBit) {
  // Not a structured binding: the rank lambda captures these (C++17 cannot capture bindings).
  const int world = std::get<0>(GetParam());
  const at::ScalarType dtype = std::get<1>(GetParam());
  const int64_t n = std::get<2>(GetParam());
  const int64_t bucket_size = std::get<3>(GetParam());
  const uint64_t seed = ddpx_test::mix_seed(
      static_cast<uint64_t>(world * 1000003 + n * 7 + bucket_size) + static_cast<uint64_t>(dtype));
  // torch's hook rounds the quotient in the bucket's dtype. A torch without a CPU round for fp16
  // (1.13) cannot run its hook on fp16 buckets, and its bf16 quotients differ by a step from
  // those of the torches whose results ddpx reproduces (2.x): 16-bit is compared there.
  if (dtype != at::kFloat && dtype != at::kDouble && !cpu_round_supports(at::kHalf)) {
    GTEST_SKIP() << "this torch's 16-bit arithmetic is not the one ddpx's hook reproduces";
  }
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(rank_input(seed, r, n, dtype));
  // What DDP ends with from torch's fp32 result: the gradients' dtype.
  const at::Tensor want = torch_hook_mean(inputs, bucket_size).to(dtype);
  // The closed-form bound on the distance to the exact mean.
  at::Tensor exact = at::zeros({n}, at::kDouble);
  for (const auto& t : inputs) exact += t.to(at::kDouble);
  exact /= world;
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    CommHookPtr hook = bucket_size == 0
                           ? ddpx::hooks::quantization_pertensor_hook(pg)
                           : ddpx::hooks::quantization_perchannel_hook(pg, bucket_size);
    EXPECT_EQ(hook->name(),
              bucket_size == 0 ? "quantization_pertensor_hook" : "quantization_perchannel_hook");
    at::Tensor buffer = inputs[rank].clone();
    auto bucket = ddpx_test::make_bucket(buffer);
    auto fut = hook->runHook(bucket->get());
    fut->wait();
    ASSERT_FALSE(fut->hasError()) << fut->tryRetrieveErrorMessage();
    const at::Tensor got = hook->parseHookResult(fut->value());
    EXPECT_TRUE(got.is_same(buffer));
    EXPECT_TRUE(bitwise_equal(got, want))
        << "rank " << rank << " max diff "
        << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    // Closed form: every rank's error is at most half its step (the 16-bit quotient's rounding
    // adds half a step in bf16, an eighth in fp16), plus the roundings of the sum and the store.
    const double steps = (dtype == at::kBFloat16 ? 1.0 : dtype == at::kHalf ? 0.625 : 0.5) + 1e-4;
    double bound_steps = 0;
    for (const auto& t : inputs) {
      const Row r = quantize(t, bucket_size);
      bound_steps += *std::max_element(r.scale.begin(), r.scale.end()) * steps;
    }
    const double u = ddpx_test::unit_roundoff(dtype == at::kDouble ? at::kFloat : dtype);
    const at::Tensor err = (got.to(at::kDouble) - exact).abs();
    const at::Tensor bound =
        bound_steps / world + (world + 2) * u * (exact.abs() + bound_steps / world) + 1e-30;
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << "rank " << rank << " worst excess " << (err - bound).max().item<double>();
  });
}

INSTANTIATE_TEST_SUITE_P(Gloo, QuantizationHookTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(at::kFloat, at::kDouble, at::kHalf,
                                                              at::kBFloat16),
                                            ::testing::Values<int64_t>(1, 1000, 1024),
                                            ::testing::Values<int64_t>(0, 16, 512)));

TEST(QuantizationHookEdges, NanOnOneRankReachesEveryRankInItsChannelOnly) {
  const int world = 3;
  const int64_t n = 64;
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    CommHookPtr hook = ddpx::hooks::quantization_perchannel_hook(pg, 16);
    at::Tensor buffer = rank_input(77, rank, n, at::kFloat);
    if (rank == 1) buffer[37] = std::numeric_limits<float>::quiet_NaN();
    auto bucket = ddpx_test::make_bucket(buffer);
    auto fut = hook->runHook(bucket->get());
    fut->wait();
    ASSERT_FALSE(fut->hasError()) << fut->tryRetrieveErrorMessage();
    EXPECT_TRUE(at::isnan(buffer.narrow(0, 32, 16)).all().item<bool>()) << "rank " << rank;
    EXPECT_TRUE(at::isfinite(buffer.narrow(0, 0, 32)).all().item<bool>()) << "rank " << rank;
    EXPECT_TRUE(at::isfinite(buffer.narrow(0, 48, 16)).all().item<bool>()) << "rank " << rank;
  });
}

TEST(QuantizationHookEdges, BadArgumentsAreRefused) {
  const auto& pgs = ddpx_test::shared_gloo_world(1);
  EXPECT_THAT(ddpx_test::value_error([&] { ddpx::hooks::quantization_perchannel_hook(pgs[0], 0); }),
              HasSubstr("bucket_size must be >= 1, got 0"));
  EXPECT_THAT(ddpx_test::error_message(
                  [&] { ddpx::hooks::quantization_pertensor_hook(ddpx::ProcessGroupPtr()); }),
              HasSubstr("process_group"));
  CommHookPtr hook = ddpx::hooks::quantization_pertensor_hook(pgs[0]);
  at::Tensor ints = at::ones({8}, at::kInt);
  auto bucket = ddpx_test::make_bucket(ints);
  EXPECT_THAT(ddpx_test::error_message([&] { hook->runHook(bucket->get()); }),
              HasSubstr("floating-point"));
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  // Rank threads are the parallelism here; intra-op threads would only oversubscribe.
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
