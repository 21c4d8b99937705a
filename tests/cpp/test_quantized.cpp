// Tests of the block quantization with error feedback: the kernels (src/kernels/quantize_ef.h,
// through the ATen layer ops/quantized.h) against closed forms, and quantized_hook on 1-4 Gloo
// ranks (threads over one HashStore) against the properties that define it.
//
// Closed forms (quantize_ef.h): for bits >= 2 a block's scale is max|v| / qmax and every value
// dequantizes within scale / 2 of itself; what is sent plus the new residual is the input plus
// the old residual, exactly; stochastic rounding is unbiased. The hook: every rank ends with the
// same bits; one step is within the two quantizations' error of the exact mean; with error
// feedback the errors do not accumulate, so the average of T steps of a constant gradient is
// within (bounded residuals) / T of the exact mean, for every bit width, 1 bit included.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ddpx/hooks/quantized_hook.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/quantize_ef.h"
#include "kernels/quantize_ef_inl.h"
#include "ops/quantized.h"
#include "test_utils.h"

namespace {

using ddpx::hooks::QuantizedOptions;
using ddpx::hooks::QuantizedState;
using ddpx_test::ProcessGroupPtr;
using ::testing::HasSubstr;

ddpx::kernels::QuantSpec spec(int bits, int64_t block, bool stochastic = false,
                              uint64_t stream = 0) {
  ddpx::kernels::QuantSpec s;
  s.bits = bits;
  s.block = block;
  s.stochastic = stochastic;
  s.seed = 1234;
  s.stream = stream;
  return s;
}

using ddpx::ops::BlockTable;

BlockTable table(int64_t n, int64_t block) { return BlockTable::contiguous(n, block); }

at::Tensor message_for(const at::Tensor& x, int bits, int64_t block) {
  return at::zeros(
      {ddpx::ops::quantized_message_bytes(table(x.numel(), block).size(), bits, block)},
      at::TensorOptions().dtype(at::kByte));
}

// Quantizes x (plus residual) as one message of contiguous blocks.
void quantize(const at::Tensor& x, const at::Tensor& residual, const ddpx::kernels::QuantSpec& s,
              const at::Tensor& msg) {
  ddpx::ops::quantize_ef_into(x, residual, table(x.numel(), s.block), s, msg);
}

at::Tensor decode(const at::Tensor& message, int64_t n, int bits, int64_t block) {
  at::Tensor out = at::empty({n}, at::kFloat);
  ddpx::ops::dequantize_into(message, table(n, block), bits, block, out);
  return out;
}

at::Tensor scales_of(const at::Tensor& message, int64_t n, int64_t block) {
  const int64_t blocks = (n + block - 1) / block;
  return message.narrow(0, 0, 4 * blocks).view(at::kFloat).clone();
}

at::Tensor random_input(uint64_t seed, int64_t n, at::ScalarType dtype = at::kFloat) {
  return ddpx_test::make_tensor(ddpx_test::random_values(seed, n), dtype);
}

// ---- kernels ---------------------------------------------------------------------------------

class QuantizeBits : public ::testing::TestWithParam<int> {};

TEST_P(QuantizeBits, ErrorWithinHalfAScaleAndErrorFeedbackExact) {
  const int bits = GetParam();
  const int64_t block = 64, n = 1000;  // a short last block
  const at::Tensor x = random_input(11, n);
  at::Tensor residual = random_input(12, n) * 0.01;
  const at::Tensor v = x + residual;  // fp32, as the kernel adds them
  at::Tensor msg = message_for(x, bits, block);
  quantize(x, residual, spec(bits, block), msg);
  const at::Tensor d = decode(msg, n, bits, block);
  // What was sent plus the new residual is the input plus the old residual: exact for bits >= 2,
  // within half an ulp of the residual for 1 bit.
  if (bits >= 2) {
    EXPECT_TRUE(at::equal(d + residual, v));
  } else {
    const at::Tensor ulp = at::abs(residual) * std::ldexp(1.0, -23) + 1e-38;
    EXPECT_TRUE(((d + residual - v).abs() <= ulp).all().item<bool>());
  }
  const at::Tensor scales = scales_of(msg, n, block);
  for (int64_t b = 0; b * block < n; ++b) {
    const int64_t len = std::min(block, n - b * block);
    const at::Tensor vb = v.narrow(0, b * block, len);
    const at::Tensor db = d.narrow(0, b * block, len);
    const float scale = scales[b].item<float>();
    if (bits >= 2) {
      const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
      EXPECT_EQ(scale, vb.abs().max().item<float>() / qmax) << "block " << b;
      EXPECT_LE((vb - db).abs().max().item<float>(), scale / 2 * (1 + 1e-6f)) << "block " << b;
    } else {
      EXPECT_NEAR(scale, vb.abs().mean().item<float>(), 1e-6 * scale) << "block " << b;
      EXPECT_TRUE(at::equal(db.abs(), at::full_like(db, scale)));
      EXPECT_TRUE(at::equal(db >= 0, vb >= 0)) << "block " << b;
    }
  }
}

TEST_P(QuantizeBits, EveryDtypeQuantizesItsValuesAsFloat) {
  const int bits = GetParam();
  const int64_t block = 32, n = 200;
  for (const auto dtype : {at::kDouble, at::kHalf, at::kBFloat16}) {
    const at::Tensor x = random_input(21, n, dtype);
    at::Tensor a = message_for(x, bits, block), b = message_for(x, bits, block);
    quantize(x, at::Tensor(), spec(bits, block), a);
    quantize(x.to(at::kFloat), at::Tensor(), spec(bits, block), b);
    EXPECT_TRUE(at::equal(a, b)) << dtype;
    // Decoding into the dtype rounds the fp32 value once.
    at::Tensor out = at::empty({n}, dtype);
    ddpx::ops::dequantize_into(a, table(n, block), bits, block, out);
    EXPECT_TRUE(at::equal(out, decode(a, n, bits, block).to(dtype))) << dtype;
  }
}

TEST_P(QuantizeBits, PackingRoundTripsEveryCode) {
  const int bits = GetParam();
  const int64_t block = 64;
  // Values on the grid of every code: q * scale for q in [-qmax, qmax] (bits >= 2), so decoding
  // gives them back exactly; 1 bit: +-1.
  const int qmax = bits == 1 ? 1 : (1 << (bits - 1)) - 1;
  std::vector<double> values;
  for (int64_t i = 0; i < block; ++i) {
    int q = static_cast<int>(i % (2 * qmax + 1)) - qmax;
    if (bits == 1) q = i % 3 == 0 ? -1 : 1;
    values.push_back(q * 0.25);
  }
  values[0] = -qmax * 0.25;  // max|v| = qmax * 0.25, so the scale is 0.25
  values[1] = qmax * 0.25;
  const at::Tensor x = ddpx_test::make_tensor(values, at::kFloat);
  at::Tensor msg = message_for(x, bits, block);
  quantize(x, at::Tensor(), spec(bits, block), msg);
  EXPECT_EQ(msg.numel(), (4 + block * bits / 8 + 15) / 16 * 16);
  EXPECT_TRUE(at::equal(decode(msg, block, bits, block), x));
}

TEST_P(QuantizeBits, StochasticRoundingIsUnbiasedAndWithinAScale) {
  const int bits = GetParam();
  const int64_t block = 16;
  const at::Tensor x = random_input(31, block);
  const int draws = 4000;
  at::Tensor sum = at::zeros({block}, at::kDouble);
  at::Tensor msg = message_for(x, bits, block);
  float scale = 0;
  for (int s = 0; s < draws; ++s) {
    quantize(x, at::Tensor(), spec(bits, block, true, s), msg);
    const at::Tensor d = decode(msg, block, bits, block);
    scale = scales_of(msg, block, block)[0].item<float>();
    EXPECT_LT((d - x).abs().max().item<float>(), bits == 1 ? 2 * scale * 1.000001f : scale);
    sum += d.to(at::kDouble);
  }
  // Each draw's error is within [-scale, scale] (2 scale for 1 bit), so its standard deviation is
  // at most scale (resp. 2 scale) / 2 ... bounded by the range: 5 standard errors of the mean.
  const double range = bits == 1 ? 2.0 * scale : scale;
  const double bound = 5.0 * range / std::sqrt(static_cast<double>(draws));
  EXPECT_LE((sum / draws - x.to(at::kDouble)).abs().max().item<double>(), bound);
  // And it is random: two streams differ somewhere.
  at::Tensor a = message_for(x, bits, block), b = message_for(x, bits, block);
  quantize(x, at::Tensor(), spec(bits, block, true, 1), a);
  quantize(x, at::Tensor(), spec(bits, block, true, 2), b);
  EXPECT_FALSE(at::equal(a, b));
}

TEST_P(QuantizeBits, ThreadsGiveTheBitsOfOneThread) {
  const int bits = GetParam();
  const int64_t block = 256, n = 1 << 18;  // enough blocks for several tasks
  const at::Tensor x = random_input(41, n);
  at::Tensor r1 = random_input(42, n) * 0.01, r2 = r1.clone();
  at::Tensor a = message_for(x, bits, block), b = message_for(x, bits, block);
  at::set_num_threads(1);
  quantize(x, r1, spec(bits, block), a);
  at::set_num_threads(2);
  quantize(x, r2, spec(bits, block), b);
  at::set_num_threads(1);
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_TRUE(at::equal(r1, r2));
}

TEST_P(QuantizeBits, WholeAndShortBlocksEncodeAlike) {
  // At 8, 4 and 2 bits a block of a multiple of 8 values is encoded eight at a time, a short one
  // value by value: the same values (61 of them, then 3 zeros, which leave max|v|, the scale,
  // unchanged) must give the same codes and residuals either way. (1 bit has one encode loop,
  // and its scale, mean |v|, would change with the zeros, as the fitted 2-bit scale would.)
  const int bits = GetParam();
  if (bits == 1) GTEST_SKIP() << "1 bit has one encode loop";
  const int64_t block = 64, len = 61;
  const ddpx::kernels::QuantSpec s = spec(bits, block);
  const at::Tensor x = random_input(90 + bits, len);
  const at::Tensor padded = at::cat({x, at::zeros({block - len}, at::kFloat)});
  const at::Tensor old_residual = random_input(95 + bits, len) * 0.01;
  at::Tensor short_res = old_residual.clone();
  at::Tensor whole_res = at::cat({old_residual, at::zeros({block - len}, at::kFloat)});
  at::Tensor short_msg = message_for(x, bits, block), whole_msg = message_for(padded, bits, block);
  quantize(x, short_res, s, short_msg);
  quantize(padded, whole_res, s, whole_msg);
  EXPECT_TRUE(at::equal(scales_of(short_msg, len, block), scales_of(whole_msg, block, block)));
  EXPECT_TRUE(at::equal(decode(short_msg, len, bits, block),
                        decode(whole_msg, block, bits, block).narrow(0, 0, len)));
  EXPECT_TRUE(at::equal(short_res, whole_res.narrow(0, 0, len)));
  // And the codes bit for bit: the short block's unused codes are zeros, the whole block's last
  // three are the zero level; the bytes before them agree.
  const int64_t code_bytes = len * bits / 8;
  EXPECT_TRUE(at::equal(short_msg.narrow(0, 4, code_bytes), whole_msg.narrow(0, 4, code_bytes)));
}

INSTANTIATE_TEST_SUITE_P(Bits, QuantizeBits, ::testing::Values(8, 4, 2, 1));

TEST(QuantizeEdges, ZeroDenormalAndNonFiniteBlocks) {
  const int64_t block = 8;
  std::vector<double> values(32, 0.0);
  for (int i = 8; i < 16; ++i) values[i] = std::ldexp(1.0, -140) * (i - 11);  // denormals
  for (int i = 16; i < 24; ++i) values[i] = i;
  values[19] = std::numeric_limits<double>::quiet_NaN();
  for (int i = 24; i < 32; ++i) values[i] = -i;
  values[30] = -std::numeric_limits<double>::infinity();
  const at::Tensor x = ddpx_test::make_tensor(values, at::kFloat);
  for (const int bits : {8, 4, 2, 1}) {
    at::Tensor residual = at::zeros({32}, at::kFloat);
    residual.narrow(0, 16, 16).fill_(0.5);
    at::Tensor msg = message_for(x, bits, block);
    quantize(x, residual, spec(bits, block), msg);
    const at::Tensor d = decode(msg, 32, bits, block);
    const at::Tensor scales = scales_of(msg, 32, block);
    // Zeros: scale 0, zeros out, zero residual.
    EXPECT_EQ(scales[0].item<float>(), 0.0f) << bits;
    EXPECT_TRUE(at::equal(d.narrow(0, 0, 8).abs(), at::zeros({8}))) << bits;
    EXPECT_TRUE(at::equal(residual.narrow(0, 0, 8), at::zeros({8}))) << bits;
    // Denormals: what is sent plus the residual is still the input.
    EXPECT_TRUE(at::equal(d.narrow(0, 8, 8) + residual.narrow(0, 8, 8), x.narrow(0, 8, 8))) << bits;
    // A NaN or an infinity: the whole block decodes to NaN, its residual restarts at 0.
    for (const int b : {2, 3}) {
      EXPECT_TRUE(std::isnan(scales[b].item<float>())) << bits;
      EXPECT_TRUE(at::isnan(d.narrow(0, 8 * b, 8)).all().item<bool>()) << bits;
      EXPECT_TRUE(at::equal(residual.narrow(0, 8 * b, 8), at::zeros({8}))) << bits;
    }
  }
}

TEST(QuantizeEdges, SumOfMessagesInOrder) {
  const int bits = 4;
  const int64_t block = 32, n = 100;
  std::vector<at::Tensor> messages;
  at::Tensor expected = at::zeros({n}, at::kFloat);
  for (int r = 0; r < 3; ++r) {
    const at::Tensor x = random_input(50 + r, n);
    at::Tensor msg = message_for(x, bits, block);
    quantize(x, at::Tensor(), spec(bits, block), msg);
    // Each term scaled before it is added (no overflow where the mean is finite).
    expected = expected + decode(msg, n, bits, block) * (1.0f / 3.0f);
    messages.push_back(msg);
  }
  at::Tensor out = at::empty({n}, at::kFloat);
  ddpx::ops::dequantize_sum_into(at::stack(messages), table(n, block), bits, block, 1.0f / 3.0f,
                                 out);
  EXPECT_TRUE(at::equal(out, expected));
}

TEST(QuantizeEdges, ExactTermAtItsRow) {
  // The owner's own values enter the sum as they are, at their row of the summation order, read
  // through a table of their own (here: the values at an offset of 7 in a longer fp16 tensor,
  // cast to float), and any row from 0 to the number of messages.
  const int bits = 8;
  const int64_t block = 32, n = 100;
  std::vector<at::Tensor> messages, decoded;
  for (int r = 0; r < 2; ++r) {
    const at::Tensor x = random_input(60 + r, n);
    at::Tensor msg = message_for(x, bits, block);
    quantize(x, at::Tensor(), spec(bits, block), msg);
    decoded.push_back(decode(msg, n, bits, block));
    messages.push_back(msg);
  }
  const at::Tensor own = random_input(62, n + 7).to(at::kHalf);
  std::vector<ddpx::kernels::BlockRef> refs;
  const ddpx::ops::BlockTable sum_table = table(n, block);
  for (const auto& r : sum_table.refs()) refs.push_back({r.begin + 7, r.len, r.draw});
  const ddpx::ops::BlockTable own_table(refs);
  const at::Tensor own_values = own.narrow(0, 7, n).to(at::kFloat);
  const at::Tensor stacked = at::stack(messages);
  for (int64_t row = 0; row <= 2; ++row) {
    std::vector<at::Tensor> terms = decoded;
    terms.insert(terms.begin() + row, own_values);
    at::Tensor expected = at::zeros({n}, at::kFloat);
    for (const auto& t : terms) expected = expected + t * (1.0f / 3.0f);
    at::Tensor out = at::empty({n}, at::kFloat);
    ddpx::ops::dequantize_sum_into(stacked, table(n, block), bits, block, 1.0f / 3.0f, out,
                                   {own, &own_table, row});
    EXPECT_TRUE(at::equal(out, expected)) << "row " << row;
  }
  // A float sum is not associative: the row matters (else this test could not tell).
  at::Tensor first = at::empty({n}, at::kFloat), last = at::empty({n}, at::kFloat);
  ddpx::ops::dequantize_sum_into(stacked, table(n, block), bits, block, 1.0f, first,
                                 {own, &own_table, 0});
  ddpx::ops::dequantize_sum_into(stacked, table(n, block), bits, block, 1.0f, last,
                                 {own, &own_table, 2});
  EXPECT_FALSE(at::equal(first, last));
  // No messages: the exact term alone.
  at::Tensor alone = at::empty({n}, at::kFloat);
  ddpx::ops::dequantize_sum_into(stacked.narrow(0, 0, 0), table(n, block), bits, block, 1.0f, alone,
                                 {own, &own_table, 0});
  EXPECT_TRUE(at::equal(alone, own_values));
  // Refused: a row past the messages, a table of other blocks, a table past the values.
  at::Tensor out = at::empty({n}, at::kFloat);
  EXPECT_THROW(ddpx::ops::dequantize_sum_into(stacked, table(n, block), bits, block, 1.0f, out,
                                              {own, &own_table, 3}),
               c10::Error);
  const ddpx::ops::BlockTable shorter = table(n - block, block);
  EXPECT_THROW(ddpx::ops::dequantize_sum_into(stacked, table(n, block), bits, block, 1.0f, out,
                                              {own, &shorter, 0}),
               c10::Error);
  EXPECT_THROW(ddpx::ops::dequantize_sum_into(stacked, table(n, block), bits, block, 1.0f, out,
                                              {own.narrow(0, 0, n), &own_table, 0}),
               c10::Error);
}

TEST(QuantizeEdges, BadFormatsAreRefused) {
  const at::Tensor x = at::ones({16});
  at::Tensor msg = at::zeros({64}, at::kByte);
  EXPECT_THAT(ddpx_test::error_message([&] { quantize(x, at::Tensor(), spec(3, 16), msg); }),
              HasSubstr("bits must be 1, 2, 4 or 8"));
  EXPECT_THAT(ddpx_test::error_message([&] { quantize(x, at::Tensor(), spec(4, 3), msg); }),
              HasSubstr("whole bytes"));
  at::Tensor small = at::zeros({4}, at::kByte);
  EXPECT_THAT(ddpx_test::error_message([&] { quantize(x, at::Tensor(), spec(8, 16), small); }),
              HasSubstr("must hold"));
}

// Gradient-like values: normal, so that a block's max|v| is far above its typical value.
at::Tensor normal_input(uint64_t seed, int64_t n) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(gen);
  return ddpx_test::make_tensor(v, at::kFloat);
}

ddpx::kernels::QuantSpec fitted(int bits, int64_t block, bool stochastic = false) {
  ddpx::kernels::QuantSpec s = spec(bits, block, stochastic);
  s.fitted_ternary = true;
  return s;
}

// The fitted 2-bit mode's two codes of a block, in closed form (quantize_ef.h), in double: the
// ternary scale t and the gains (sum v^2 minus the squared error) of the ternary code at t and of
// the midrise code at its least-squares half step h for the levels that h0 = 0.6267 mean gives.
struct FittedCodes {
  double t, h, gain_t, gain_m;
};

FittedCodes fitted_codes(const at::Tensor& v) {
  const at::Tensor a = v.abs().to(at::kDouble);
  const int64_t len = v.numel();
  const double mean = a.sum().item<double>() / static_cast<double>(len);
  const at::Tensor kept = a > mean;
  const int64_t above = kept.sum().item<int64_t>();
  FittedCodes c;
  c.t = above > 0 ? (a * kept).sum().item<double>() / static_cast<double>(above) : mean;
  c.t = std::min(c.t, a.max().item<double>());
  const at::Tensor nonzero = c.t > 0 ? (a / c.t > 0.5) : at::zeros_like(kept);
  c.gain_t = c.t * (2 * (a * nonzero).sum().item<double>() - c.t * nonzero.sum().item<double>());
  const at::Tensor m = at::where(a >= 2 * 0.626657069 * mean, 3.0, 1.0).to(at::kDouble);
  const double m1 = (a * m).sum().item<double>(), mm = (m * m).sum().item<double>();
  c.h = m1 / mm;
  c.gain_m = m1 * m1 / mm;
  return c;
}

// The dequantized values of block v under a midrise half step h: (2 q + 1) h for q = floor(v /
// 2h) clamped to [-2, 1], with 1 / 2h taken in fp32 as the kernels do.
at::Tensor midrise_levels(const at::Tensor& v, float h) {
  const float inv_step = 1.0f / (2.0f * h);
  const at::Tensor q = at::clamp(at::floor(v * inv_step), -2, 1);
  return (2 * q + 1) * h;
}

TEST(Quantize, FittedTwoBitCodesClosedForm) {
  const int64_t block = 64, n = 1000;  // a short last block
  at::Tensor x = normal_input(61, n);
  x.narrow(0, 128, 64).fill_(-3.0f);  // all magnitudes equal: none above the mean, no error
  x.narrow(0, 192, 64).zero_();       // all zeros: scale 0
  // Half zeros: the ternary code sends the zeros exactly, the midrise code at +-h.
  x.narrow(0, 256, 32).zero_();
  at::Tensor msg = message_for(x, 2, block);
  quantize(x, at::Tensor(), fitted(2, block), msg);
  const at::Tensor d = decode(msg, n, 2, block);
  const at::Tensor scales = scales_of(msg, n, block);
  int64_t midrise = 0;
  for (int64_t b = 0; b * block < n; ++b) {
    const int64_t len = std::min(block, n - b * block);
    const at::Tensor v = x.narrow(0, b * block, len);
    const FittedCodes c = fitted_codes(v);
    const float scale = scales[b].item<float>();
    // The kernel sums in SIMD lanes: the last bits of its sums may differ from these.
    const double tol = 1e-5 * c.gain_t;
    if (scale < 0) {
      ++midrise;
      const float h = -scale;
      EXPECT_NEAR(h, c.h, 1e-5 * c.h) << "block " << b;
      EXPECT_GT(c.gain_m, c.gain_t - tol) << "block " << b;
      // Every value at the nearest of -3h, -h, h, 3h.
      EXPECT_TRUE(at::equal(d.narrow(0, b * block, len), midrise_levels(v, h))) << "block " << b;
    } else {
      EXPECT_NEAR(scale, c.t, 1e-6 * c.t) << "block " << b;
      EXPECT_LE(c.gain_m, c.gain_t + tol) << "block " << b;
      // Every value is sent at the nearest of -scale, 0, +scale (clipped beyond 1.5 scale).
      const at::Tensor q = at::clamp(at::round(v / scale), -1, 1);
      if (scale > 0) {
        EXPECT_TRUE(at::equal(d.narrow(0, b * block, len), q * scale)) << "block " << b;
      }
    }
  }
  // The normal blocks go midrise (about 0.12 of a normal block's energy as squared error,
  // against about 0.19 for the ternary code); the special ones stay ternary.
  EXPECT_EQ(midrise, (n + block - 1) / block - 3);
  EXPECT_EQ(scales[2].item<float>(), 3.0f);
  EXPECT_TRUE(at::equal(d.narrow(0, 128, 64), at::full({64}, -3.0f)));
  EXPECT_EQ(scales[3].item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(d.narrow(0, 192, 64).abs(), at::zeros({64})));
  EXPECT_GT(scales[4].item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(d.narrow(0, 256, 32).abs(), at::zeros({32})));
  // The fit is for 2 bits with nearest rounding only: other widths, and stochastic rounding
  // (unbiased only while every value is within the scale), keep their scales.
  for (const int bits : {8, 4, 2, 1}) {
    for (const bool stochastic : {false, true}) {
      if (bits == 2 && !stochastic) continue;
      at::Tensor a = message_for(x, bits, block), b = message_for(x, bits, block);
      quantize(x, at::Tensor(), spec(bits, block, stochastic), a);
      quantize(x, at::Tensor(), fitted(bits, block, stochastic), b);
      EXPECT_TRUE(at::equal(a, b)) << bits << " bits, stochastic " << stochastic;
    }
  }
}

TEST(Quantize, FittedTwoBitBoundsAndLessError) {
  const int64_t block = 256, n = 256 * 64;
  at::Tensor x = normal_input(62, n);
  x.narrow(0, 0, 4 * block).mul_(at::rand({4 * block}) < 0.3);  // sparse blocks: ternary
  at::Tensor by_max = message_for(x, 2, block), by_fit = message_for(x, 2, block);
  quantize(x, at::Tensor(), spec(2, block), by_max);
  quantize(x, at::Tensor(), fitted(2, block), by_fit);
  const at::Tensor d_max = decode(by_max, n, 2, block), d_fit = decode(by_fit, n, 2, block);
  const at::Tensor scales = scales_of(by_fit, n, block);
  int64_t ternary = 0;
  for (int64_t b = 0; b < n / block; ++b) {
    const at::Tensor v = x.narrow(0, b * block, block);
    const at::Tensor err = (v - d_fit.narrow(0, b * block, block)).abs();
    const float scale = scales[b].item<float>();
    // quantize_ef.h's bounds. Ternary: |v - d| <= max(scale / 2, |v| - scale), mean|v| <= scale
    // <= max|v|. Midrise (scale -h): |v - d| <= max(h, |v| - 3h).
    const float h = std::fabs(scale);
    const at::Tensor bound =
        scale < 0 ? at::clamp_min(v.abs() - 3 * h, h) : at::clamp_min(v.abs() - scale, scale / 2);
    EXPECT_TRUE((err <= bound * (1 + 1e-6f)).all().item<bool>()) << "block " << b;
    if (scale >= 0) {
      ++ternary;
      EXPECT_GE(scale, v.abs().mean().item<float>() * (1 - 1e-6f)) << "block " << b;
      EXPECT_LE(scale, v.abs().max().item<float>()) << "block " << b;
    }
  }
  EXPECT_EQ(ternary, 4);  // the sparse blocks, and only they
  // Under max|v| a normal block sends most values as 0 (those below max|v| / 2, about 1.3 of
  // its 2.8 standard deviations: about 80%) and so shrinks it; the fitted code sends more of
  // them, with less squared error (a normal block's least-squares midrise code: 0.119 of its
  // energy) and a projection <d, v> / <v, v> nearer 1.
  const at::Tensor dense = x.narrow(0, 4 * block, n - 4 * block);
  const at::Tensor fit_dense = d_fit.narrow(0, 4 * block, n - 4 * block);
  const double nonzero_max = (d_max != 0).sum().item<double>() / n;
  const double nonzero_fit = (d_fit != 0).sum().item<double>() / n;
  EXPECT_LT(nonzero_max, 0.3);
  EXPECT_GT(nonzero_fit, 0.9);
  const double sq_max = (x - d_max).pow(2).sum().item<double>();
  const double sq_fit = (x - d_fit).pow(2).sum().item<double>();
  EXPECT_LT(sq_fit, 0.3 * sq_max);
  const double rel_dense =
      (dense - fit_dense).pow(2).sum().item<double>() / dense.pow(2).sum().item<double>();
  EXPECT_LT(rel_dense, 0.125);
  EXPECT_GT(rel_dense, 0.11);
  const double vv = (x * x).sum().item<double>();
  const double gain_max = (d_max * x).sum().item<double>() / vv;
  const double gain_fit = (d_fit * x).sum().item<double>() / vv;
  EXPECT_LT(std::abs(1 - gain_fit), std::abs(1 - gain_max));
}

// ---- the rotation (QuantSpec::rotate) ---------------------------------------------------------

ddpx::kernels::QuantSpec rotating(int bits, int64_t block, uint64_t stream, bool unbiased) {
  ddpx::kernels::QuantSpec s = spec(bits, block, false, stream);
  s.rotate = true;
  s.unbiased_sign = unbiased;
  return s;
}

ddpx::kernels::Unrotate unrotate_of(const ddpx::kernels::QuantSpec& s, uint64_t step = 0) {
  ddpx::kernels::Unrotate u;
  u.on = s.rotate;
  u.seed = s.seed;
  u.stream0 = s.stream;
  u.stream_step = step;
  return u;
}

at::Tensor decode_rotated(const at::Tensor& message, int64_t n, const ddpx::kernels::QuantSpec& s) {
  at::Tensor out = at::empty({n}, at::kFloat);
  ddpx::ops::dequantize_into(message, table(n, s.block), s.bits, s.block, out, unrotate_of(s));
  return out;
}

// The Sylvester-Hadamard matrix of order `len` (entries +-1), in double.
at::Tensor hadamard_matrix(int64_t len) {
  at::Tensor h = at::ones({1, 1}, at::kDouble);
  while (h.size(0) < len) h = at::cat({at::cat({h, h}, 1), at::cat({h, -h}, 1)}, 0);
  return h;
}

// D's signs of block values [draw, draw + len), as +-1 in double (1: not flipped).
at::Tensor rotation_signs(const ddpx::kernels::QuantSpec& s, uint64_t draw, int64_t len) {
  std::vector<double> d(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i) {
    d[static_cast<size_t>(i)] =
        ddpx::kernels::detail::rotation_flip(s.seed, s.stream, draw + static_cast<uint64_t>(i))
            ? -1.0
            : 1.0;
  }
  return at::tensor(d, at::kDouble);
}

TEST(Quantize, RotatedBlocksClosedForm) {
  // Every whole block is sent as the code of y = 2^-ceil(k/2) H D v (block = 2^k) and decoded
  // as 2^-floor(k/2) D H y': checked against that formula in double, block by block, with the
  // bounds of the codes holding for y; a short last block goes as a non-rotating spec sends it.
  const int64_t block = 64, n = 5 * block + 24;
  at::Tensor x = normal_input(41, n);
  x.narrow(0, 3, 1).fill_(40.0f);  // one value far above the rest of block 0
  const at::Tensor r0 = normal_input(42, n) * 0.01;
  const at::Tensor v = x + r0;
  const at::Tensor H = hadamard_matrix(block);
  const double c = std::ldexp(1.0, -3), f = std::ldexp(1.0, -3);  // k = 6: 2^-3 both ways
  for (const int bits : {8, 4, 2, 1}) {
    for (const bool unbiased : {false, true}) {
      if (unbiased && bits != 1) continue;
      SCOPED_TRACE("bits " + std::to_string(bits) + (unbiased ? ", unbiased" : ""));
      const auto s = rotating(bits, block, 7, unbiased);
      at::Tensor residual = r0.clone();
      at::Tensor msg = message_for(x, bits, block);
      quantize(x, residual, s, msg);
      const at::Tensor y_sent = decode(msg, n, bits, block);  // not rotated back
      const at::Tensor back = decode_rotated(msg, n, s);
      const at::Tensor scales = scales_of(msg, n, block);
      // Error feedback: what the receiver decodes plus the new residual is v, up to the
      // roundings of the residual's subtraction.
      EXPECT_LE((back + residual - v).abs().max().item<float>(),
                2e-7f * v.abs().max().item<float>());
      for (int64_t b = 0; b < 5; ++b) {
        SCOPED_TRACE("block " + std::to_string(b));
        const at::Tensor vb = v.narrow(0, b * block, block).to(at::kDouble);
        const at::Tensor D = rotation_signs(s, static_cast<uint64_t>(b * block), block);
        const at::Tensor y = c * at::matmul(H, D * vb);
        const at::Tensor ys = y_sent.narrow(0, b * block, block).to(at::kDouble);
        const double scale = scales[b].item<float>();
        const double ymax = y.abs().max().item<double>();
        if (bits >= 2) {
          const double qmax = (1 << (bits - 1)) - 1;
          EXPECT_NEAR(scale, ymax / qmax, 1e-5 * scale);
          EXPECT_LE((ys - y).abs().max().item<double>(), scale / 2 * (1 + 1e-5) + 1e-6 * ymax);
        } else {
          const double expect = unbiased
                                    ? (y * y).sum().item<double>() / y.abs().sum().item<double>()
                                    : y.abs().mean().item<double>();
          EXPECT_NEAR(scale, expect, 1e-5 * expect);
          EXPECT_TRUE(
              at::equal((ys >= 0) | (y.abs() < 1e-5 * ymax), (y >= 0) | (y.abs() < 1e-5 * ymax)));
        }
        // Rotated back: f D H y', and the error is y's (the rotation is orthogonal).
        const at::Tensor xb = f * D * at::matmul(H, ys);
        const at::Tensor got = back.narrow(0, b * block, block).to(at::kDouble);
        EXPECT_LE((got - xb).abs().max().item<double>(),
                  1e-6 * xb.abs().max().item<double>() + 1e-12);
        const double e_x = (got - vb).pow(2).sum().item<double>();
        const double e_y = (ys - y).pow(2).sum().item<double>();
        EXPECT_NEAR(e_x, e_y, 1e-4 * e_y + 1e-9);
      }
      // The short last block: as a non-rotating spec sends it, bit for bit; under the unbiased
      // sign scale that is the stochastic sign code (unbiased without a rotation).
      at::Tensor plain = message_for(x, bits, block);
      auto ps = spec(bits, block, /*stochastic=*/unbiased, 7);
      quantize(x, r0.clone(), ps, plain);
      const at::Tensor d_plain = decode(plain, n, bits, block);
      EXPECT_EQ(scales[5].item<float>(), scales_of(plain, n, block)[5].item<float>());
      EXPECT_TRUE(at::equal(back.narrow(0, 5 * block, 24), d_plain.narrow(0, 5 * block, 24)));
    }
  }
  // The spike: max|v| / rms of block 0 is 40 / 1.9 before the rotation; the rotated block is
  // spread (every rotated value holds +-40 c), so at 8 bits its squared error is a fraction of
  // the unrotated block's.
  at::Tensor m_rot = message_for(x, 8, block), m_plain = message_for(x, 8, block);
  quantize(x, at::Tensor(), rotating(8, block, 7, false), m_rot);
  quantize(x, at::Tensor(), spec(8, block), m_plain);
  const auto err0 = [&](const at::Tensor& d) {
    return (d.narrow(0, 0, block) - x.narrow(0, 0, block)).pow(2).sum().item<double>();
  };
  EXPECT_LT(err0(decode_rotated(m_rot, n, rotating(8, block, 7, false))),
            0.2 * err0(decode(m_plain, n, 8, block)));
}

TEST(Quantize, RotatedSignsDifferByStreamAndThreadsAgree) {
  const int64_t block = 256, n = 4 * block;
  const at::Tensor x = normal_input(43, n);
  at::Tensor a = message_for(x, 2, block), b = message_for(x, 2, block);
  quantize(x, at::Tensor(), rotating(2, block, 1, false), a);
  quantize(x, at::Tensor(), rotating(2, block, 2, false), b);
  EXPECT_FALSE(at::equal(a, b));  // another stream, other signs
  // One thread and two give the same bits and residuals (each block is its own): enough blocks
  // for several tasks (the ops split 256 blocks of 256 per task).
  {
    const int64_t big = 1 << 18;
    const at::Tensor xs = normal_input(45, big);
    at::Tensor r1 = normal_input(46, big) * 0.01, r2 = r1.clone();
    at::Tensor m1 = message_for(xs, 2, block), m2 = message_for(xs, 2, block);
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    quantize(xs, r1, rotating(2, block, 1, false), m1);
    at::set_num_threads(2);
    quantize(xs, r2, rotating(2, block, 1, false), m2);
    at::set_num_threads(threads);
    EXPECT_TRUE(at::equal(m1, m2));
    EXPECT_TRUE(at::equal(r1, r2));
  }
  // Non-finite values reach the receiver as NaN over their block only, as without rotation;
  // so does a finite block whose rotated values overflow.
  at::Tensor bad = x.clone();
  bad.narrow(0, 5, 1).fill_(std::numeric_limits<float>::infinity());
  // D v = 3e38 over block 2: its first rotated value is 2^-4 * 256 * 3e38.
  bad.narrow(0, 2 * block, block)
      .copy_(rotation_signs(rotating(1, block, 3, true), 2 * block, block) * 3e38);
  at::Tensor res = at::ones({n}, at::kFloat);
  at::Tensor mb = message_for(x, 1, block);
  const auto s = rotating(1, block, 3, true);
  quantize(bad, res, s, mb);
  const at::Tensor d = decode_rotated(mb, n, s);
  for (int64_t blk = 0; blk < 4; ++blk) {
    const bool nan = blk == 0 || blk == 2;
    EXPECT_EQ(at::isnan(d.narrow(0, blk * block, block)).all().item<bool>(), nan) << blk;
    EXPECT_EQ(at::isfinite(d.narrow(0, blk * block, block)).all().item<bool>(), !nan) << blk;
    if (nan) EXPECT_TRUE(at::equal(res.narrow(0, blk * block, block), at::zeros({block})));
  }
}

TEST(Quantize, RotatedSignIsUnbiased) {
  // DRIVE's scale sum y^2 / sum |y| makes the decoded block an unbiased estimate of v under a
  // uniformly random rotation; the random-sign Hadamard transform approximates one well for a
  // dense block (here normal values; a block dominated by one value keeps a bias on the rest):
  // the mean of N rotations converges to v as 1 / N, where with the least-squares scale mean|y|
  // it converges to v shrunk by (sum |y|)^2 / (len sum y^2), about 2 / pi.
  const int64_t block = 256;
  const at::Tensor x = normal_input(44, block) * 0.1;
  const int N = 2000;
  const auto mean_over_streams = [&](bool unbiased, double* per_draw) {
    at::Tensor sum = at::zeros({block}, at::kDouble);
    double sq = 0;
    for (int t = 0; t < N; ++t) {
      const auto s = rotating(1, block, static_cast<uint64_t>(t), unbiased);
      at::Tensor m = message_for(x, 1, block);
      quantize(x, at::Tensor(), s, m);
      const at::Tensor d = decode_rotated(m, block, s).to(at::kDouble);
      sum += d;
      sq += (d - x.to(at::kDouble)).pow(2).sum().item<double>();
    }
    *per_draw = sq / N;
    return sum / N;
  };
  const double energy = x.to(at::kDouble).pow(2).sum().item<double>();
  double var_unbiased = 0, var_ls = 0;
  const at::Tensor m_unbiased = mean_over_streams(true, &var_unbiased);
  const at::Tensor m_ls = mean_over_streams(false, &var_ls);
  const double err_unbiased = (m_unbiased - x.to(at::kDouble)).pow(2).sum().item<double>();
  const double err_ls = (m_ls - x.to(at::kDouble)).pow(2).sum().item<double>();
  // One draw's squared error: about (pi / 2 - 1) of the energy for rotated (Gaussian-like)
  // values, (1 - 2 / pi) with the least-squares scale.
  EXPECT_NEAR(var_unbiased / energy, 3.14159265 / 2 - 1, 0.06);
  EXPECT_NEAR(var_ls / energy, 1 - 2 / 3.14159265, 0.06);
  // Independent draws: the mean's squared error is the variance / N (2x margin: a sum of 256
  // squares concentrates well).
  EXPECT_LT(err_unbiased, 2 * var_unbiased / N);
  EXPECT_GT(err_ls, 0.05 * energy);  // the shrinkage stays
}

// ---- the hook ---------------------------------------------------------------------------------

QuantizedOptions options(int bits, int64_t block, int64_t start_iter = 0, bool ef = true) {
  QuantizedOptions o;
  o.bits = bits;
  o.block_size = block;
  o.start_iter = start_iter;
  o.use_error_feedback = ef;
  return o;
}

// Rank r's gradient of `n` values at step `step` (constant over steps when step < 0).
at::Tensor grad(int rank, int64_t n, int step, at::ScalarType dtype = at::kFloat, int emin = -6) {
  return ddpx_test::make_tensor(
      ddpx_test::random_values(ddpx_test::rank_seed(100 + std::max(step, 0), rank), n, emin),
      dtype);
}

// One model's parameters (two, as make_bucket lays them out) per rank, shared across steps.
std::vector<at::Tensor> params_of(int64_t n) {
  return {at::zeros({n / 2}), at::zeros({n - n / 2})};
}

at::Tensor run_step(const ddpx::hooks::CommHookPtr& hook, const at::Tensor& buffer,
                    const std::vector<at::Tensor>& params) {
  auto bucket = ddpx_test::make_bucket(buffer, params);
  auto fut = hook->runHook(bucket->get());
  fut->wait();
  EXPECT_FALSE(fut->hasError()) << fut->tryRetrieveErrorMessage();
  return buffer;
}

using ddpx::comm::ExchangeMode;

class QuantizedHookWorld : public ::testing::TestWithParam<std::tuple<int, int, ExchangeMode>> {};

TEST_P(QuantizedHookWorld, EveryRankSameBitsAndErrorFeedbackConverges) {
  const int world = std::get<0>(GetParam());
  const int bits = std::get<1>(GetParam());
  QuantizedOptions o = options(bits, 64);
  o.exchange = std::get<2>(GetParam());
  const int64_t n = 1003;
  // 1 bit: the sign compressor contracts a block only by about (mean|v|)^2 / mean(v^2), so its
  // residuals grow to tens of gradients before they settle, and its average needs hundreds of
  // steps to enter the 1 / T regime (a numpy model of the two levels behaves the same). Its
  // gradients span 2^5 in magnitude here, not 2^8.
  const int steps = bits == 1 ? 640 : 40;
  const int emin = bits == 1 ? -2 : -6;
  std::vector<at::Tensor> results(static_cast<size_t>(world));
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    auto state = std::make_shared<QuantizedState>(pg, o);
    auto hook = ddpx::hooks::quantized_hook(state);
    const auto params = params_of(n);
    at::Tensor sum = at::zeros({n}, at::kDouble);
    at::Tensor first, quarter;
    for (int s = 0; s < steps; ++s) {
      at::Tensor out = run_step(hook, grad(rank, n, -1, at::kFloat, emin), params);
      if (s == 0) first = out.clone();
      sum += out.to(at::kDouble);
      if (s + 1 == steps / 4) quarter = (sum / (steps / 4)).to(at::kFloat);
    }
    EXPECT_EQ(state->iter(), steps);
    results[static_cast<size_t>(rank)] = at::cat({first, quarter, (sum / steps).to(at::kFloat)});
  });
  at::Tensor exact = at::zeros({n}, at::kDouble);
  for (int r = 0; r < world; ++r) exact += grad(r, n, -1, at::kFloat, emin).to(at::kDouble);
  exact /= world;
  for (int r = 1; r < world; ++r) EXPECT_TRUE(at::equal(results[r], results[0])) << "rank " << r;
  auto error = [&](int part) {
    return (results[0].narrow(0, part * n, n).to(at::kDouble) - exact).abs().max().item<double>();
  };
  const double one_step = error(0), at_quarter = error(1), at_end = error(2);
  // One step: each level's error is at most half its scale (bits >= 2); the scales are at most
  // max|g| / qmax, and |g| < 8 (random_values' range): at most 8 / qmax.
  if (bits >= 2) EXPECT_LE(one_step, 8.0 / ((1 << (bits - 1)) - 1) + 1e-6);
  // T steps of a constant gradient: sent_t = v_t - e_t with v_t = g + e_{t-1}, so the sum of
  // what is sent telescopes to T g - e_T at each level (both by reduce-scatter, the one by
  // all-gather). The average is within (|e_w| + |e_s|) / T
  // of the mean: it shrinks as 1 / T (a quarter of the steps: about 4 times the error), where
  // without error feedback it would stay at the one-step error.
  EXPECT_LE(at_end, at_quarter / 2.5 + 1e-6) << "one step " << one_step;
  if (bits >= 2) EXPECT_LE(at_end, 8.0 * 4 / steps + 1e-5) << "one step " << one_step;
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndBits, QuantizedHookWorld,
    ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values(8, 4, 2, 1),
                       ::testing::Values(ExchangeMode::kAllgather, ExchangeMode::kReduceScatter)));

TEST(QuantizedHook, AllgatherSumsEveryRanksMessageInRankOrder) {
  // By all-gather a step is the kernels' composition: every rank quantizes its whole gradient
  // plus its residual (keeping the new residual), and every rank sums the W decoded messages in
  // rank order and scales by 1/W. On 2 ranks "auto" is the all-gather; on 3 it is asked for.
  // Parameters of whole blocks (two of 320 values), so that the hook's blocks are the contiguous
  // blocks of the bucket.
  const int64_t n = 640, block = 64;
  const int bits = 4;
  for (const int world : {2, 3}) {
    std::vector<std::vector<at::Tensor>> grads(static_cast<size_t>(world));
    std::vector<at::Tensor> residuals;
    for (int r = 0; r < world; ++r) {
      for (int s = 0; s < 3; ++s) grads[r].push_back(normal_input(80 + 10 * r + s, n));
      residuals.push_back(at::zeros({n}, at::kFloat));
    }
    std::vector<at::Tensor> expected;
    for (int s = 0; s < 3; ++s) {
      at::Tensor sum = at::zeros({n}, at::kFloat);
      for (int r = 0; r < world; ++r) {
        const at::Tensor& g = grads[static_cast<size_t>(r)][static_cast<size_t>(s)];
        at::Tensor message = message_for(g, bits, block);
        quantize(g, residuals[static_cast<size_t>(r)], spec(bits, block), message);
        sum = sum + decode(message, n, bits, block) * (1.0f / static_cast<float>(world));
      }
      expected.push_back(sum);
    }
    ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
      QuantizedOptions o = options(bits, block);
      o.exchange = world == 2 ? ExchangeMode::kAuto : ExchangeMode::kAllgather;
      QuantizedOptions rs = o;
      rs.exchange = ExchangeMode::kReduceScatter;
      auto state = std::make_shared<QuantizedState>(pg, o);
      auto other = std::make_shared<QuantizedState>(pg, rs);
      auto hook = ddpx::hooks::quantized_hook(state);
      auto hook_rs = ddpx::hooks::quantized_hook(other);
      const auto params = params_of(n), params_rs = params_of(n);
      for (int s = 0; s < 3; ++s) {
        const at::Tensor& g = grads[static_cast<size_t>(rank)][static_cast<size_t>(s)];
        const at::Tensor out = run_step(hook, g.clone(), params);
        EXPECT_TRUE(at::equal(out, expected[static_cast<size_t>(s)]))
            << world << " ranks, step " << s << ", rank " << rank;
        // The reduce-scatter quantizes twice: other bits.
        EXPECT_FALSE(at::equal(run_step(hook_rs, g.clone(), params_rs), out));
      }
      // The residual of every value, this rank's own blocks included, is the composition's.
      const auto w = state->worker_residuals();
      const at::Tensor& r = residuals[static_cast<size_t>(rank)];
      EXPECT_TRUE(at::equal(w.at(0), r.narrow(0, 0, 320))) << rank;
      EXPECT_TRUE(at::equal(w.at(1), r.narrow(0, 320, 320))) << rank;
      for (const auto& [k, t] : state->server_residuals()) {
        EXPECT_TRUE(at::equal(t, at::zeros_like(t))) << "no second level, parameter " << k;
      }
    });
  }
}

// state_dict() saves the option `key` of `st` by its name `name`, and load_state_dict()
// restores it (`get` reads it: `saved`); a dict without the key, saved before the option existed,
// loads as `older`; an unknown name `bad` is a ValueError naming the key.
template <typename Get, typename V>
void check_option_saved(const QuantizedState& st, const std::string& key, const std::string& name,
                        Get get, V saved, V older, const std::string& bad) {
  auto d = st.state_dict();
  EXPECT_EQ(d.at(key).toStringRef(), name);
  QuantizedState back(st.process_group(), options(8, 64));
  back.load_state_dict(d);
  EXPECT_EQ(get(back.options()), saved);
  EXPECT_EQ(d.erase(key), 1u);
  back.load_state_dict(d);
  EXPECT_EQ(get(back.options()), older);
  d.insert(key, bad);
  EXPECT_THAT(ddpx_test::value_error([&] { back.load_state_dict(d); }), HasSubstr(key));
}

TEST(QuantizedHook, ExchangeOptionAndOlderCheckpoints) {
  const auto& pgs = ddpx_test::shared_gloo_world(1);
  QuantizedOptions o = options(8, 64);
  o.exchange = ExchangeMode::kAllreduce;
  EXPECT_THAT(ddpx_test::value_error([&] { QuantizedState(pgs[0], o); }),
              HasSubstr("exchange must be 'auto', 'allgather' or 'reduce_scatter', got "
                        "'allreduce'"));
  EXPECT_THAT(ddpx_test::value_error([&] { ddpx::hooks::parse_quantized_exchange("ring"); }),
              HasSubstr("got 'ring'"));
  EXPECT_EQ(ddpx::hooks::parse_quantized_exchange("allgather"), ExchangeMode::kAllgather);
  o.exchange = ExchangeMode::kAllgather;
  // A checkpoint from before the option: its residuals came from the reduce-scatter exchange,
  // and it resumes with it.
  check_option_saved(
      QuantizedState(pgs[0], o), "exchange", "allgather",
      [](const QuantizedOptions& q) { return q.exchange; }, ExchangeMode::kAllgather,
      ExchangeMode::kReduceScatter, "allreduce");
}

TEST(QuantizedHook, WarmUpIsAllreduceAndCheckpointResumesBitForBit) {
  const int world = 3;
  const int64_t n = 700;
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    QuantizedOptions o = options(2, 32, /*start_iter=*/2);
    o.stochastic_rounding = true;
    auto a = std::make_shared<QuantizedState>(pg, o);
    auto hook_a = ddpx::hooks::quantized_hook(a);
    const auto params = params_of(n);
    // Warm-up: the exact mean, as allreduce_hook gives it (divide, then sum).
    for (int s = 0; s < 2; ++s) {
      at::Tensor g = grad(rank, n, s);
      at::Tensor expected = g / world;
      std::vector<at::Tensor> t{expected};
      pg->allreduce(t)->wait();
      EXPECT_TRUE(at::equal(run_step(hook_a, g, params), expected));
    }
    for (int s = 2; s < 5; ++s) run_step(hook_a, grad(rank, n, s), params);
    // Checkpoint, then a new state (a new process: new parameter tensors) resumes.
    const auto saved = a->state_dict();
    auto b = std::make_shared<QuantizedState>(pg, options(8, 256));
    b->load_state_dict(saved);
    EXPECT_EQ(b->options().bits, 2);
    auto hook_b = ddpx::hooks::quantized_hook(b);
    const auto params_b = params_of(n);
    for (int s = 5; s < 9; ++s) {
      at::Tensor x = run_step(hook_a, grad(rank, n, s), params);
      at::Tensor y = run_step(hook_b, grad(rank, n, s), params_b);
      EXPECT_TRUE(at::equal(x, y)) << "step " << s << " rank " << rank;
    }
    for (const auto& [k, t] : a->worker_residuals()) {
      EXPECT_TRUE(at::equal(t, b->worker_residuals().at(k))) << "parameter " << k;
    }
  });
}

TEST(QuantizedHook, ResultsDoNotDependOnTheBuckets) {
  // The same two parameters and gradients, as one bucket and as one bucket each (what DDP's
  // rebuild or another bucket_cap_mb does): blocks, owners and draws follow the parameters, so
  // every step gives the same bits, and a switch of layout mid-run keeps every residual.
  const int64_t n = 517;  // parameters of 258 and 259 values: short blocks at both ends
  ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
    QuantizedOptions o = options(2, 16);
    o.stochastic_rounding = true;
    auto one = std::make_shared<QuantizedState>(pg, o);
    auto split = std::make_shared<QuantizedState>(pg, o);
    auto hook_one = ddpx::hooks::quantized_hook(one);
    auto hook_split = ddpx::hooks::quantized_hook(split);
    const auto params = params_of(n);
    const auto params_split = params_of(n);
    for (int s = 0; s < 6; ++s) {
      const at::Tensor g = grad(rank, n, s);
      at::Tensor a = run_step(hook_one, g.clone(), params);
      at::Tensor b = g.clone();
      if (s % 3 == 2) {  // now and then the whole bucket again: residuals move between layouts
        run_step(hook_split, b, params_split);
      } else {
        const int64_t h = params_split[0].numel();
        std::vector<at::Tensor> p0{params_split[0]}, p1{params_split[1]};
        auto b0 = ddpx_test::make_bucket(b.narrow(0, 0, h), p0, 0, 2);
        auto b1 = ddpx_test::make_bucket(b.narrow(0, h, n - h), p1, 1, 2);
        auto f0 = hook_split->runHook(b0->get());
        auto f1 = hook_split->runHook(b1->get());
        f0->wait();
        f1->wait();
        ASSERT_FALSE(f0->hasError() || f1->hasError());
      }
      EXPECT_TRUE(at::equal(a, b)) << "step " << s << " rank " << rank;
    }
    const auto wa = one->worker_residuals(), wb = split->worker_residuals();
    const auto sa = one->server_residuals(), sb = split->server_residuals();
    ASSERT_EQ(wa.size(), 2u);
    for (const auto& [k, t] : wa) EXPECT_TRUE(at::equal(t, wb.at(k))) << "parameter " << k;
    for (const auto& [k, t] : sa) EXPECT_TRUE(at::equal(t, sb.at(k))) << "parameter " << k;
  });
}

TEST(QuantizedHook, NanOnOneRankReachesEveryRankInItsBlockOnly) {
  const int64_t n = 256, block = 32;
  ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
    auto state = std::make_shared<QuantizedState>(pg, options(8, block));
    auto hook = ddpx::hooks::quantized_hook(state);
    const auto params = params_of(n);
    at::Tensor g = grad(rank, n, 0);
    if (rank == 1) g[70] = std::numeric_limits<float>::quiet_NaN();
    run_step(hook, g, params);
    EXPECT_TRUE(at::isnan(g.narrow(0, 64, 32)).all().item<bool>()) << rank;
    EXPECT_TRUE(at::isfinite(g.narrow(0, 0, 64)).all().item<bool>()) << rank;
    EXPECT_TRUE(at::isfinite(g.narrow(0, 96, n - 96)).all().item<bool>()) << rank;
    // The residuals restarted where the NaN was: the next step is finite everywhere.
    at::Tensor next = run_step(hook, grad(rank, n, 1), params);
    EXPECT_TRUE(at::isfinite(next).all().item<bool>()) << rank;
  });
}

TEST(QuantizedHook, TwoBitsWithoutErrorFeedbackUseTheFittedScale) {
  // Without error feedback a 2-bit step is the kernels' composition with the fitted scale at both
  // levels: every rank quantizes its gradient; each block's owner sums, in rank order, the
  // others' dequantized blocks and its own values as they are (they cross no wire), scales by
  // 1/W, quantizes again; every rank decodes that. Parameters of whole blocks, so that the hook's
  // blocks are the contiguous blocks of the bucket: the two parameters (keys 0 and 1, 320 values
  // each) give block b of key k to rank (k + b) % W.
  const int world = 3;
  const int64_t n = 640, block = 64;
  std::vector<at::Tensor> grads;
  for (int r = 0; r < world; ++r) grads.push_back(normal_input(70 + r, n));
  auto owner_of = [&](int64_t at) { return (at / 320 + (at % 320) / block) % world; };
  auto compose = [&](const ddpx::kernels::QuantSpec& s) {
    at::Tensor sum = at::zeros({n}, at::kFloat);
    for (int r = 0; r < world; ++r) {
      const at::Tensor& g = grads[static_cast<size_t>(r)];
      at::Tensor message = message_for(g, 2, block);
      quantize(g, at::Tensor(), s, message);
      at::Tensor term = decode(message, n, 2, block);
      for (int64_t at = 0; at < n; at += block) {
        if (owner_of(at) == r) term.narrow(0, at, block).copy_(g.narrow(0, at, block));
      }
      sum = sum + term * (1.0f / static_cast<float>(world));
    }
    const at::Tensor mean = sum;
    at::Tensor second = message_for(mean, 2, block);
    quantize(mean, at::Tensor(), s, second);
    return decode(second, n, 2, block);
  };
  const at::Tensor expected = compose(fitted(2, block));
  ASSERT_FALSE(at::equal(expected, compose(spec(2, block))));  // the scales make a difference
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    QuantizedOptions o = options(2, block, 0, /*ef=*/false);
    o.rotation = ddpx::hooks::QuantRotation::kNone;  // the rotated steps: the test below
    auto state = std::make_shared<QuantizedState>(pg, o);
    auto hook = ddpx::hooks::quantized_hook(state);
    const at::Tensor out = run_step(hook, grads[static_cast<size_t>(rank)].clone(), params_of(n));
    EXPECT_TRUE(at::equal(out, expected)) << "rank " << rank;
  });
}

TEST(QuantizedHook, RotatedStepsAreTheKernelsComposition) {
  // Without error feedback "auto" rotates: a step is the kernels' composition with rotating
  // specs whose streams are the hook's, (iter * P + level) * P + rank with P = 0x100000001b3
  // (level 0: each rank's message; level 1: every owner's mean, with rank 0's stream), and whose
  // blocks draw at (key << 40) + offset. By reduce-scatter on 3 ranks (the owner's own values
  // exact, at its row) and by all-gather on 2, at 1 and 2 bits, two steps (iter 0 and 1).
  const int64_t n = 640, block = 64;
  const uint64_t P = 0x100000001b3ULL;
  std::vector<ddpx::kernels::BlockRef> refs;
  for (int64_t at = 0; at < n; at += block) {
    const uint64_t key = static_cast<uint64_t>(at / 320), off = static_cast<uint64_t>(at % 320);
    refs.push_back({at, block, (key << 40) + off});
  }
  const BlockTable hook_table(refs);
  for (const int world : {3, 2}) {
    for (const int bits : {1, 2}) {
      SCOPED_TRACE(std::to_string(world) + " ranks, " + std::to_string(bits) + " bits");
      std::vector<std::vector<at::Tensor>> grads(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        for (int s = 0; s < 2; ++s) grads[r].push_back(normal_input(90 + 10 * r + s, n));
      }
      auto owner_of = [&](int64_t at) { return (at / 320 + (at % 320) / block) % world; };
      auto quantized_spec = [&](uint64_t stream, bool rotate) {
        ddpx::kernels::QuantSpec q = spec(bits, block, false, stream);
        q.seed = 0;
        q.fitted_ternary = true;
        q.rotate = rotate;
        q.unbiased_sign = rotate;
        return q;
      };
      auto decoded = [&](const at::Tensor& values, const ddpx::kernels::QuantSpec& q) {
        at::Tensor m = message_for(values, bits, block);
        ddpx::ops::quantize_ef_into(values, at::Tensor(), hook_table, q, m);
        at::Tensor out = at::empty({n}, at::kFloat);
        ddpx::ops::dequantize_into(m, hook_table, bits, block, out, unrotate_of(q));
        return out;
      };
      auto compose = [&](int step, bool rotate) {
        const uint64_t iter = static_cast<uint64_t>(step);
        at::Tensor sum = at::zeros({n}, at::kFloat);
        for (int r = 0; r < world; ++r) {
          const at::Tensor& g = grads[static_cast<size_t>(r)][static_cast<size_t>(step)];
          at::Tensor term = decoded(g, quantized_spec((iter * P) * P + r, rotate));
          if (world == 3) {
            for (int64_t at = 0; at < n; at += block) {
              if (owner_of(at) == r) term.narrow(0, at, block).copy_(g.narrow(0, at, block));
            }
          }
          sum = sum + term * (1.0f / static_cast<float>(world));
        }
        const at::Tensor mean = sum;
        if (world == 2) return mean;  // one round
        return decoded(mean, quantized_spec((iter * P + 1) * P, rotate));
      };
      std::vector<at::Tensor> expected = {compose(0, true), compose(1, true)};
      ASSERT_FALSE(at::equal(expected[0], compose(0, false)));  // the rotation makes a difference
      ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
        QuantizedOptions o = options(bits, block, 0, /*ef=*/false);
        EXPECT_TRUE(ddpx::hooks::rotates(o));
        auto state = std::make_shared<QuantizedState>(pg, o);
        auto hook = ddpx::hooks::quantized_hook(state);
        const auto params = params_of(n);
        for (int s = 0; s < 2; ++s) {
          const at::Tensor out = run_step(
              hook, grads[static_cast<size_t>(rank)][static_cast<size_t>(s)].clone(), params);
          EXPECT_TRUE(at::equal(out, expected[static_cast<size_t>(s)]))
              << "rank " << rank << ", step " << s;
        }
      });
    }
  }
}

TEST(QuantizedHook, RotationOptionAndOlderCheckpoints) {
  using ddpx::hooks::QuantRotation;
  const auto& pgs = ddpx_test::shared_gloo_world(1);
  // "auto": rotate without error feedback, where the block size allows it.
  EXPECT_FALSE(ddpx::hooks::rotates(options(1, 64)));
  EXPECT_TRUE(ddpx::hooks::rotates(options(1, 64, 0, false)));
  EXPECT_FALSE(ddpx::hooks::rotates(options(1, 96, 0, false)));  // not a power of two
  EXPECT_FALSE(ddpx::hooks::rotates(options(1, 16384, 0, false)));
  QuantizedOptions o = options(8, 96);
  o.rotation = QuantRotation::kHadamard;
  EXPECT_THAT(ddpx_test::value_error([&] { QuantizedState(pgs[0], o); }),
              HasSubstr("rotation='hadamard' needs a block_size that is a power of two in [8, "
                        "8192], got 96"));
  EXPECT_THAT(ddpx_test::value_error([&] { ddpx::hooks::parse_quantized_rotation("givens"); }),
              HasSubstr("rotation must be 'auto', 'hadamard' or 'none', got 'givens'"));
  o.block_size = 64;
  EXPECT_TRUE(ddpx::hooks::rotates(o));  // with error feedback too, when asked for
  // A checkpoint from before the option was taken without rotation, and resumes without it.
  check_option_saved(
      QuantizedState(pgs[0], o), "rotation", "hadamard",
      [](const QuantizedOptions& q) { return q.rotation; }, QuantRotation::kHadamard,
      QuantRotation::kNone, "givens");
}

TEST(QuantizedHook, SixteenBitBucketsAndRefusals) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto state = std::make_shared<QuantizedState>(pg, options(8, 64));
    auto hook = ddpx::hooks::quantized_hook(state);
    const auto params = params_of(300);
    for (const auto dtype : {at::kHalf, at::kBFloat16, at::kDouble}) {
      at::Tensor g = grad(rank, 300, 0, dtype);
      at::Tensor out = run_step(hook, g, params);
      EXPECT_EQ(out.scalar_type(), dtype);
      EXPECT_TRUE(at::isfinite(out).all().item<bool>());
    }
  });
  const auto& pgs = ddpx_test::shared_gloo_world(1);
  EXPECT_THAT(ddpx_test::value_error([&] { QuantizedState(pgs[0], options(3, 64)); }),
              HasSubstr("bits must be 1, 2, 4 or 8, got 3"));
  EXPECT_THAT(ddpx_test::value_error([&] { QuantizedState(pgs[0], options(8, 12)); }),
              HasSubstr("block_size must be a multiple of 8"));
  QuantizedState st(pgs[0], options(8, 64));
  auto d = st.state_dict();
  // Another rank's residuals are refused.
  d.insert_or_assign("rank", int64_t(5));
  auto w = c10::impl::GenericDict(c10::IntType::get(), c10::TensorType::get());
  w.insert(int64_t(0), at::zeros({4}));
  d.insert_or_assign("worker_residuals", w);
  EXPECT_THAT(ddpx_test::value_error([&] { st.load_state_dict(d); }),
              HasSubstr("saved by rank 5 of 1"));
  st.load_state_dict(d, /*allow_reshard=*/true);
}

// ---- the edge cases: each once a silent wrong result, a lost residual or a hang -----------------

// Runs `hook` on rank `rank`'s bucket and returns the c10::ValueError's message (and how long the
// call took) when it throws one, "" otherwise.
std::string agreement_error(const ddpx::hooks::CommHookPtr& hook, const at::Tensor& g,
                            double* seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  try {
    run_step(hook, g.clone(), params_of(g.numel()));
  } catch (const c10::ValueError& e) {
    message = e.what_without_backtrace();
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return message;
}

TEST(QuantizedHook, RanksThatDisagreeFailFastNamingTheOption) {
  // Ranks built with other options, or one step apart (per-rank checkpoints of two steps, a
  // set_iter on one rank: without error feedback the rotation's signs are keyed by the
  // iteration, and the ranks would decode each other's blocks with the wrong ones): every rank
  // raises the same ValueError, naming the option and both values, before any bucket moves.
  const int64_t n = 256;
  struct Case {
    const char* what;
    std::function<void(int, QuantizedOptions&)> options;
    std::function<void(int, QuantizedState&)> state;
    const char* text;
  };
  const std::vector<Case> cases = {
      {"bits", [](int r, QuantizedOptions& o) { o.bits = r == 0 ? 8 : 4; },
       [](int, QuantizedState&) {}, "bits is 8 on rank 0 and 4 on rank 1"},
      {"iter", [](int, QuantizedOptions& o) { o.use_error_feedback = false; },
       [](int r, QuantizedState& st) { st.set_iter(r == 1 ? 7 : 6); },
       "iter is 6 on rank 0 and 7 on rank 1"},
      {"exchange",
       [](int r, QuantizedOptions& o) {
         o.exchange = r == 0 ? ExchangeMode::kAuto : ExchangeMode::kReduceScatter;
       },
       [](int, QuantizedState&) {}, "exchange is 'auto' on rank 0 and 'reduce_scatter' on rank 1"},
  };
  for (const Case& c : cases) {
    ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
      QuantizedOptions o = options(8, 64);
      c.options(rank, o);
      auto state = std::make_shared<QuantizedState>(pg, o);
      c.state(rank, *state);
      double seconds = 0;
      const std::string message =
          agreement_error(ddpx::hooks::quantized_hook(state), grad(rank, n, 0), &seconds);
      EXPECT_THAT(message, HasSubstr(c.text)) << c.what << ", rank " << rank;
      EXPECT_THAT(message, HasSubstr("quantized_hook")) << c.what;
      EXPECT_LT(seconds, 5.0) << c.what;
      // The ranks stay in step: the next agreement (equal options) passes on both.
      state->set_options(options(8, 64));
      state->set_iter(0);
      run_step(ddpx::hooks::quantized_hook(state), grad(rank, n, 0), params_of(n));
    });
  }
}

TEST(QuantizedHook, MeanOfHugeGradientsStaysFinite) {
  // Gradients near the largest float on 3 ranks: their sum overflows fp32, their mean does not.
  // Each term is scaled by 1/W before it is added, as allreduce_hook divides before it sums.
  const int64_t n = 512;
  for (const ExchangeMode mode : {ExchangeMode::kAllgather, ExchangeMode::kReduceScatter}) {
    ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
      QuantizedOptions o = options(8, 64);
      o.exchange = mode;
      auto hook = ddpx::hooks::quantized_hook(std::make_shared<QuantizedState>(pg, o));
      const at::Tensor g = at::full({n}, 1.5e38f) * (1.0f - 0.1f * static_cast<float>(rank));
      const at::Tensor out = run_step(hook, g.clone(), params_of(n));
      EXPECT_TRUE(at::isfinite(out).all().item<bool>()) << "rank " << rank;
      // The mean, 1.35e38, within the two levels' half steps (8 bits: 1/127 of max|v| each).
      EXPECT_LE((out.to(at::kDouble) - 1.35e38).abs().max().item<double>(), 1.35e38 * 0.02);
    });
  }
}

TEST(Quantize, OneBitUnbiasedOnShortBlocksToo) {
  // 1 bit without error feedback (the rotated spec's unbiased sign scale): a block too short to
  // rotate (a bias, a small head, a parameter's tail) takes the stochastic sign code, also
  // unbiased. [10, 1, ..., 1] averaged over 2000 draws: each value comes back as itself (the
  // deterministic mean|v| sign code gave 1.9 for every 1).
  const int64_t block = 64, n = 24;
  at::Tensor x = at::ones({n}, at::kFloat);
  x[0] = 10.0f;
  at::Tensor sum = at::zeros({n}, at::kDouble);
  const int draws = 2000;
  for (int t = 0; t < draws; ++t) {
    const auto s = rotating(1, block, static_cast<uint64_t>(t), /*unbiased=*/true);
    at::Tensor msg = message_for(x, 1, block);
    quantize(x, at::Tensor(), s, msg);
    sum += decode(msg, n, 1, block).to(at::kDouble);
  }
  const at::Tensor mean = sum / draws;
  EXPECT_NEAR(mean[0].item<double>(), 10.0, 1e-9);  // at the scale: always +10
  // The ones: variance 10^2 - 1 per draw; the mean of 23 values over 2000 draws has sd 0.046.
  EXPECT_NEAR(mean.narrow(0, 1, n - 1).mean().item<double>(), 1.0, 0.2);
  EXPECT_LE((mean.narrow(0, 1, n - 1) - 1.0).abs().max().item<double>(),
            5 * std::sqrt(99.0 / draws));
}

TEST(QuantizedHook, UnusedParameterKeepsItsResiduals) {
  // DDP hands the hook zeros for a parameter that no rank used in a step (find_unused_parameters)
  // and discards what the hook returns for it: its residuals must stay for a later step, not be
  // quantized into a result that is thrown away. Parameter 1 (the bucket's second half) is
  // unused at step 1 on every rank, used at steps 0 and 2.
  const int64_t n = 256, half = n / 2;
  for (const ExchangeMode mode : {ExchangeMode::kAllgather, ExchangeMode::kReduceScatter}) {
    ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
      QuantizedOptions o = options(4, 64);
      o.exchange = mode;
      auto state = std::make_shared<QuantizedState>(pg, o);
      auto hook = ddpx::hooks::quantized_hook(state);
      const auto params = params_of(n);
      run_step(hook, grad(rank, n, 0), params);
      const auto w0 = state->worker_residuals(), s0 = state->server_residuals();
      ASSERT_GT(w0.at(1).abs().max().item<float>(), 0.0f);
      at::Tensor g = grad(rank, n, 1);
      g.narrow(0, half, n - half).zero_();
      const at::Tensor out = run_step(hook, g, params);
      EXPECT_TRUE(at::equal(out.narrow(0, half, n - half).abs(), at::zeros({n - half})));
      EXPECT_TRUE(at::equal(state->worker_residuals().at(1), w0.at(1))) << "rank " << rank;
      if (s0.count(1)) {
        EXPECT_TRUE(at::equal(state->server_residuals().at(1), s0.at(1))) << "rank " << rank;
      }
      // Used again: the residual goes out with the gradient and is replaced.
      run_step(hook, grad(rank, n, 2), params);
      EXPECT_FALSE(at::equal(state->worker_residuals().at(1), w0.at(1)));
    });
  }
}

// The error the residuals still owe the mean, per value: the rank-level residuals summed over
// the ranks and divided by W (each rank's message is divided by W), plus the owner-level ones.
at::Tensor owed(const std::vector<std::map<int64_t, at::Tensor>>& workers,
                const std::vector<std::map<int64_t, at::Tensor>>& servers, int64_t world) {
  std::vector<at::Tensor> per_param;
  for (int64_t k = 0; k < 2; ++k) {
    at::Tensor sum = at::zeros_like(workers[0].at(k), at::kDouble);
    for (int64_t r = 0; r < world; ++r) {
      sum += workers[r].at(k).to(at::kDouble) / static_cast<double>(world);
      if (servers[r].count(k)) sum += servers[r].at(k).to(at::kDouble);
    }
    per_param.push_back(sum);
  }
  return at::cat(per_param);
}

TEST(QuantizedHook, ExchangeSwitchKeepsEveryResidual) {
  // All-gather -> reduce-scatter: a rank's own blocks cross no wire by reduce-scatter, so their
  // rank-level residuals move to the owner level (divided by W); back again, the owner level's
  // move to the rank level (times W). A step of zero gradients (which keeps every residual)
  // shows the move alone: what the residuals owe the mean is unchanged, and nothing is left on
  // the level the new exchange never sends from.
  const int64_t n = 512, world = 3;
  std::vector<std::map<int64_t, at::Tensor>> w(world), s(world);
  auto snapshot = [&](int rank, const QuantizedState& st) {
    w[rank] = st.worker_residuals();
    s[rank] = st.server_residuals();
  };
  std::vector<at::Tensor> before(2), after(2);
  std::vector<std::shared_ptr<QuantizedState>> states(world);
  std::vector<std::vector<at::Tensor>> params(world);  // one model per rank, all along
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    QuantizedOptions o = options(2, 64);
    o.exchange = ExchangeMode::kAllgather;
    states[rank] = std::make_shared<QuantizedState>(pg, o);
    auto hook = ddpx::hooks::quantized_hook(states[rank]);
    params[rank] = params_of(n);
    for (int step = 0; step < 2; ++step) run_step(hook, grad(rank, n, step), params[rank]);
    snapshot(rank, *states[rank]);
  });
  before[0] = owed(w, s, world);
  for (const ExchangeMode to : {ExchangeMode::kReduceScatter, ExchangeMode::kAllgather}) {
    ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
      QuantizedOptions o = states[rank]->options();
      o.exchange = to;
      states[rank]->set_options(o);
      run_step(ddpx::hooks::quantized_hook(states[rank]), at::zeros({n}), params[rank]);
      snapshot(rank, *states[rank]);
    });
    const at::Tensor now = owed(w, s, world);
    EXPECT_LE((now - before[0]).abs().max().item<double>(),
              1e-6 * before[0].abs().max().item<double>());
    for (int64_t r = 0; r < world; ++r) {
      if (to == ExchangeMode::kAllgather) {
        for (const auto& [k, t] : s[r]) EXPECT_EQ(t.abs().max().item<float>(), 0.0f);
      } else {
        // Rank r's own blocks: block b of parameter k is owned by (k + b) % W.
        for (int64_t k = 0; k < 2; ++k) {
          for (int64_t b = 0; b * 64 < n / 2; ++b) {
            if ((k + b) % world != r) continue;
            EXPECT_EQ(w[r].at(k).narrow(0, b * 64, 64).abs().max().item<float>(), 0.0f)
                << "rank " << r << " parameter " << k << " block " << b;
          }
        }
      }
    }
  }
}

TEST(QuantizedHook, FailedSecondRoundFailsEveryRankPromptly) {
  // Rank 1's round one fails after the data moved (its all-to-all reports an error): its
  // deferred round two cannot be computed. It still issues round two, poisoned, so its peers
  // are not left waiting for it until the group's timeout (30 s here); every rank's bucket
  // future fails within seconds, the peers' naming rank 1.
  const int64_t n = 512;
  const auto pgs =
      ddpx_test::make_gloo_world_failing_alltoall(3, 1, 0, "injected round-one failure");
  ddpx_test::run_ranks(pgs, [&](int rank, const ProcessGroupPtr& pg) {
    QuantizedOptions o = options(8, 64);
    o.exchange = ExchangeMode::kReduceScatter;
    auto hook = ddpx::hooks::quantized_hook(std::make_shared<QuantizedState>(pg, o));
    at::Tensor buffer = grad(rank, n, 0);
    auto bucket = ddpx_test::make_bucket(buffer, params_of(n));
    const auto t0 = std::chrono::steady_clock::now();
    auto fut = hook->runHook(bucket->get());  // the last bucket: round two is issued at once
    fut->wait();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(fut->hasError()) << "rank " << rank;
    EXPECT_THAT(fut->tryRetrieveErrorMessage(),
                HasSubstr(rank == 1 ? "injected round-one failure" : "rank 1 failed"))
        << "rank " << rank;
    EXPECT_LT(seconds, 10.0) << "rank " << rank;
  });
}

TEST(QuantizedHook, OptionsAndGroupRefusedDuringBackward) {
  // Between two buckets of one backward pass (bucket 0's round two still deferred), a new layout
  // would re-cut the residuals under it and free buffers its queued kernels still read.
  const int64_t n = 256;
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    QuantizedOptions o = options(8, 64);
    o.exchange = ExchangeMode::kReduceScatter;
    auto state = std::make_shared<QuantizedState>(pg, o);
    auto hook = ddpx::hooks::quantized_hook(state);
    at::Tensor b0 = grad(rank, n, 0), b1 = grad(rank, n, 1);
    std::vector<at::Tensor> p0 = params_of(n), p1 = params_of(n);
    auto bucket0 = ddpx_test::make_bucket(b0, p0, 0, 2);
    auto f0 = hook->runHook(bucket0->get());
    EXPECT_THAT(ddpx_test::error_message([&] { state->set_options(o); }),
                HasSubstr("during backward"));
    EXPECT_THAT(ddpx_test::error_message([&] { state->set_process_group(pg); }),
                HasSubstr("during backward"));
    EXPECT_THAT(ddpx_test::error_message([&] { state->set_iter(3); }),
                HasSubstr("during backward"));
    auto bucket1 = ddpx_test::make_bucket(b1, p1, 1, 2);
    auto f1 = hook->runHook(bucket1->get());
    f0->wait();
    f1->wait();
    EXPECT_FALSE(f0->hasError() || f1->hasError());
    state->set_options(o);  // between steps: fine
  });
}

TEST(QuantizedHook, CompressionStatsCountTheQuantizedBuckets) {
  const int64_t n = 1000;
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto state = std::make_shared<QuantizedState>(pg, options(4, 64, /*start_iter=*/1));
    auto hook = ddpx::hooks::quantized_hook(state);
    const auto params = params_of(n);
    run_step(hook, grad(rank, n, 0), params);  // warm-up: not counted
    EXPECT_EQ(std::get<1>(state->compression_stats()), 0);
    run_step(hook, grad(rank, n, 1), params);
    run_step(hook, grad(rank, n, 2), params);
    const auto [rate, before, after] = state->compression_stats();
    EXPECT_EQ(before, 2 * n * 4);
    // Two parameters of 500 values: 8 blocks each (the last of 52), 4 bits and a scale a block.
    EXPECT_EQ(after, 2 * ddpx::ops::quantized_message_bytes(16, 4, 64));
    EXPECT_DOUBLE_EQ(rate, static_cast<double>(before) / static_cast<double>(after));
  });
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  // Rank threads are the parallelism here; intra-op threads would only oversubscribe.
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
