// Tests of the torch-free CPU kernels in src/kernels/cast.h.
//
// References: c10::Half / c10::BFloat16 (torch's own conversions) for the scalar conversions,
// plus an independent closed-form decoder; a naive element-by-element loop built on c10 types
// for scaled_cast_cpu and sum_rows_cpu. Every comparison is bit for bit, except that a NaN only
// has to be a NaN (payloads legitimately differ between F16C, the portable code and c10).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cast.h"
#include "kernels/multi_tensor.h"

namespace {

namespace k = ddpx::kernels;
using k::DType;

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float f32_from(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint64_t f64_bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

bool half_is_nan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0; }
bool bf16_is_nan(uint16_t h) { return (h & 0x7F80u) == 0x7F80u && (h & 0x007Fu) != 0; }

// torch's conversions: the references the kernels must reproduce.
uint16_t c10_float_to_half(float f) { return c10::Half(f).x; }
float c10_half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
uint16_t c10_float_to_bf16(float f) { return c10::BFloat16(f).x; }
float c10_bf16_to_float(uint16_t h) {
  return static_cast<float>(c10::BFloat16(h, c10::BFloat16::from_bits()));
}

// Independent closed-form binary16 decoder (guards against c10 and ddpx sharing a mistake).
double half_value(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  if (e == 0) return sign * std::ldexp(m, -24);
  if (e == 31)
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  return sign * std::ldexp(1024 + m, e - 25);
}

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

// Collects up to kMax mismatch descriptions so a broken kernel reports a few examples, not
// millions of lines.
class Mismatches {
 public:
  void add(const std::string& what) {
    if (count_++ < kMax) examples_ += "  " + what + "\n";
  }
  int64_t count() const { return count_; }
  std::string report() const { return std::to_string(count_) + " mismatches, e.g.:\n" + examples_; }

 private:
  static constexpr int64_t kMax = 8;
  int64_t count_ = 0;
  std::string examples_;
};

// Floats that stress 16-bit rounding: every finite fp16 value, the midpoints between
// neighbours (ties: round to even), one float ulp either side of each midpoint, the overflow
// threshold, fp32 subnormals and extremes, infinities and NaNs, then `random_bits` uniformly
// random 32-bit patterns (every exponent, NaNs included).
std::vector<float> rounding_probe_floats(int64_t random_bits, uint64_t seed) {
  std::vector<float> v;
  for (uint32_t h = 0; h < 0x7C00u; ++h) {  // positive finite halves, zero included
    const float a = static_cast<float>(half_value(static_cast<uint16_t>(h)));
    v.push_back(a);
    v.push_back(-a);
    // The midpoint needs 12 significant bits: exact in fp32. For h = 0x7BFF it is 65520, the
    // value that must round to infinity.
    const float mid = static_cast<float>(
        (half_value(static_cast<uint16_t>(h)) +
         (h + 1 == 0x7C00u ? 65536.0 : half_value(static_cast<uint16_t>(h + 1)))) /
        2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  // bf16 midpoints: every bf16 bit pattern with the half-ulp bit set, and one ulp around it.
  for (uint32_t b = 0; b < 0x7F80u; b += 7) {
    const uint32_t mid = (b << 16) | 0x8000u;
    for (uint32_t u : {mid, mid - 1, mid + 1}) {
      v.push_back(f32_from(u));
      v.push_back(f32_from(u | 0x80000000u));
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f,
                  -0.0f,
                  inf,
                  -inf,
                  std::numeric_limits<float>::quiet_NaN(),
                  f32_from(0x7F800001u) /* signalling NaN */,
                  f32_from(0xFFC12345u),
                  std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::lowest(),
                  std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::denorm_min(),
                  1e-40f,
                  -3e-39f,
                  65504.0f,
                  65519.996f,
                  65520.0f,
                  1e5f,
                  -1e5f,
                  0x1p-24f,
                  0x1p-25f,
                  0x1.8p-25f,
                  0x1p-26f,
                  0x1.fffffep+127f}) {
    v.push_back(x);
  }
  std::mt19937_64 gen(seed);
  for (int64_t i = 0; i < random_bits; ++i) v.push_back(f32_from(static_cast<uint32_t>(gen())));
  return v;
}

// ---- scalar conversions --------------------------------------------------------------------

TEST(ScalarConversion, HalfDecodeAllPatternsMatchesC10) {
  Mismatches bad;
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const uint16_t hb = static_cast<uint16_t>(h);
    const float got = k::half_bits_to_float(hb);
    if (half_is_nan(hb)) {
      if (!std::isnan(got)) bad.add(hex(h) + " (NaN) decoded to " + std::to_string(got));
      continue;
    }
    const float want = c10_half_to_float(hb);
    if (f32_bits(got) != f32_bits(want) ||
        f64_bits(static_cast<double>(got)) != f64_bits(half_value(hb))) {
      bad.add(hex(h) + ": got " + hex(f32_bits(got)) + ", c10 " + hex(f32_bits(want)));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.report();
}

TEST(ScalarConversion, Bf16DecodeAllPatternsMatchesC10) {
  Mismatches bad;
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const uint16_t hb = static_cast<uint16_t>(h);
    const float got = k::bf16_bits_to_float(hb);
    if (bf16_is_nan(hb)) {
      if (!std::isnan(got)) bad.add(hex(h) + " (NaN) decoded to " + std::to_string(got));
      continue;
    }
    const float want = c10_bf16_to_float(hb);
    if (f32_bits(got) != f32_bits(want) || f32_bits(got) != (h << 16)) {
      bad.add(hex(h) + ": got " + hex(f32_bits(got)) + ", c10 " + hex(f32_bits(want)));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.report();
}

TEST(ScalarConversion, HalfEncodeMatchesC10) {
  const auto probes = rounding_probe_floats(1 << 21, 11);
  Mismatches bad;
  for (float f : probes) {
    const uint16_t got = k::float_to_half_bits(f);
    if (std::isnan(f)) {
      if (!half_is_nan(got)) bad.add("NaN " + hex(f32_bits(f)) + " encoded to " + hex(got));
      continue;
    }
    const uint16_t want = c10_float_to_half(f);
    if (got != want) {
      bad.add(hex(f32_bits(f)) + ": got " + hex(got) + ", c10 " + hex(want));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.report();
}

TEST(ScalarConversion, Bf16EncodeMatchesC10) {
  const auto probes = rounding_probe_floats(1 << 21, 12);
  Mismatches bad;
  for (float f : probes) {
    const uint16_t got = k::float_to_bf16_bits(f);
    if (std::isnan(f)) {
      if (!bf16_is_nan(got)) bad.add("NaN " + hex(f32_bits(f)) + " encoded to " + hex(got));
      continue;
    }
    const uint16_t want = c10_float_to_bf16(f);
    if (got != want) {
      bad.add(hex(f32_bits(f)) + ": got " + hex(got) + ", c10 " + hex(want));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.report();
}

// Hand-checked values: ties to even, overflow to infinity, gradual underflow.
TEST(ScalarConversion, KnownRoundingCases) {
  EXPECT_EQ(k::float_to_half_bits(1.0f), 0x3C00);
  EXPECT_EQ(k::float_to_half_bits(-2.0f), 0xC000);
  EXPECT_EQ(k::float_to_half_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(k::float_to_half_bits(65519.996f), 0x7BFF);
  EXPECT_EQ(k::float_to_half_bits(65520.0f), 0x7C00);           // tie rounds to even: infinity
  EXPECT_EQ(k::float_to_half_bits(0x1p-24f), 0x0001);           // smallest subnormal
  EXPECT_EQ(k::float_to_half_bits(0x1p-25f), 0x0000);           // tie with zero: even is zero
  EXPECT_EQ(k::float_to_half_bits(0x1.8p-24f), 0x0002);         // 1.5 ulp: tie to even (2)
  EXPECT_EQ(k::float_to_half_bits(1.0f + 0x1p-11f), 0x3C00);    // tie: stays even
  EXPECT_EQ(k::float_to_half_bits(1.0f + 0x1.8p-10f), 0x3C02);  // tie: up to even
  EXPECT_EQ(k::float_to_bf16_bits(1.0f + 0x1p-8f), 0x3F80);     // tie: stays even
  EXPECT_EQ(k::float_to_bf16_bits(1.0f + 0x1.8p-7f), 0x3F82);   // tie: up to even
  EXPECT_EQ(k::float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7F80);  // to +inf
  EXPECT_EQ(k::float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  EXPECT_TRUE(std::isnan(k::half_bits_to_float(0x7E00)));
  EXPECT_EQ(k::half_bits_to_float(0x8001), -0x1p-24f);
}

// ---- F16C path vs portable path ------------------------------------------------------------

// The block kernels use F16C when the CPU has it; the scalar functions are the portable code.
// Whatever path is active must agree with the portable one on every value.
TEST(HalfPaths, VectorDecodeMatchesPortableOnAllPatterns) {
  std::cout << "[ info ] fp16 path: " << (k::cpu_has_fast_half() ? "F16C" : "portable")
            << std::endl;
  ::testing::Test::RecordProperty("fast_half", k::cpu_has_fast_half() ? "F16C" : "portable");
  std::vector<uint16_t> all(0x10000 + 3);
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) all[h + 3] = static_cast<uint16_t>(h);
  Mismatches bad;
  // Offsets 3 and 0 (for the 3 leading extra values) exercise unaligned starts and the tails.
  for (int offset : {0, 3}) {
    const int64_t n = static_cast<int64_t>(all.size()) - offset;
    std::vector<float> out(n);
    k::scaled_cast_cpu(all.data() + offset, DType::kFloat16, out.data(), DType::kFloat32, n, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = all[i + offset];
      const float want = k::half_bits_to_float(h);
      const bool ok = half_is_nan(h) ? std::isnan(out[i]) : f32_bits(out[i]) == f32_bits(want);
      if (!ok)
        bad.add(hex(h) + ": vector " + hex(f32_bits(out[i])) + ", portable " + hex(f32_bits(want)));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.report();
}

TEST(HalfPaths, VectorEncodeMatchesPortable) {
  const auto probes = rounding_probe_floats(1 << 20, 13);
  Mismatches bad;
  for (int offset : {0, 5}) {
    const int64_t n = static_cast<int64_t>(probes.size()) - offset;
    std::vector<uint16_t> out(n);
    k::scaled_cast_cpu(probes.data() + offset, DType::kFloat32, out.data(), DType::kFloat16, n,
                       1.0f);
    for (int64_t i = 0; i < n; ++i) {
      const float f = probes[i + offset];
      const uint16_t want = k::float_to_half_bits(f);
      const bool ok = std::isnan(f) ? half_is_nan(out[i]) : out[i] == want;
      if (!ok) bad.add(hex(f32_bits(f)) + ": vector " + hex(out[i]) + ", portable " + hex(want));
    }
  }
  EXPECT_EQ(bad.count(), 0) << bad.report();
}

// ---- block kernels vs a naive reference ----------------------------------------------------

const DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};

// A typed host buffer with `guard` extra elements after the payload, filled with a sentinel,
// so that writes past n are caught.
struct Buffer {
  static constexpr int64_t kGuard = 17;
  static constexpr unsigned char kSentinel = 0xA5;

  Buffer(DType t, int64_t n, int64_t offset = 0)
      : dtype(t),
        n(n),
        offset(offset),
        bytes(static_cast<size_t>((n + offset + kGuard) * k::dtype_size(t)), kSentinel) {}

  void* data() { return bytes.data() + offset * k::dtype_size(dtype); }
  const void* data() const { return bytes.data() + offset * k::dtype_size(dtype); }

  // Element i as its raw bits (zero-extended).
  uint64_t bits(int64_t i) const {
    uint64_t u = 0;
    std::memcpy(&u, static_cast<const unsigned char*>(data()) + i * k::dtype_size(dtype),
                k::dtype_size(dtype));
    return u;
  }
  bool is_nan(int64_t i) const {
    const uint64_t u = bits(i);
    switch (dtype) {
      case DType::kFloat32:
        return std::isnan(f32_from(static_cast<uint32_t>(u)));
      case DType::kFloat64: {
        double d;
        std::memcpy(&d, &u, 8);
        return std::isnan(d);
      }
      case DType::kFloat16:
        return half_is_nan(static_cast<uint16_t>(u));
      case DType::kBFloat16:
        return bf16_is_nan(static_cast<uint16_t>(u));
    }
    return false;
  }
  // Exact value of element i (through c10 for the 16-bit types).
  double value(int64_t i) const {
    const uint64_t u = bits(i);
    switch (dtype) {
      case DType::kFloat32:
        return f32_from(static_cast<uint32_t>(u));
      case DType::kFloat64: {
        double d;
        std::memcpy(&d, &u, 8);
        return d;
      }
      case DType::kFloat16:
        return c10_half_to_float(static_cast<uint16_t>(u));
      case DType::kBFloat16:
        return c10_bf16_to_float(static_cast<uint16_t>(u));
    }
    return 0;
  }
  // Stores v as torch would: fp64 -> fp32 -> 16-bit, round to nearest even at each step.
  void set(int64_t i, double v) {
    unsigned char* p = static_cast<unsigned char*>(data()) + i * k::dtype_size(dtype);
    switch (dtype) {
      case DType::kFloat32: {
        const float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        return;
      }
      case DType::kFloat64:
        std::memcpy(p, &v, 8);
        return;
      case DType::kFloat16: {
        const uint16_t h = c10_float_to_half(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        return;
      }
      case DType::kBFloat16: {
        const uint16_t h = c10_float_to_bf16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        return;
      }
    }
  }
  bool guard_intact() const {
    const size_t es = k::dtype_size(dtype);
    for (size_t b = static_cast<size_t>((offset + n) * es); b < bytes.size(); ++b) {
      if (bytes[b] != kSentinel) return false;
    }
    for (size_t b = 0; b < static_cast<size_t>(offset * es); ++b) {
      if (bytes[b] != kSentinel) return false;
    }
    return true;
  }

  DType dtype;
  int64_t n;
  int64_t offset;
  std::vector<unsigned char> bytes;
};

// Kernel inputs: mostly sign * U[1,2) * 2^e over e in [-30, 20] (fp16 overflow, subnormals
// and underflow included), plus ~5% special values.
void fill_random(Buffer& b, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-30, 20);
  std::uniform_int_distribution<int> pick(0, 99);
  const double inf = std::numeric_limits<double>::infinity();
  const double specials[] = {0.0,     -0.0,    inf,   -inf,   std::nan(""), 65504.0,  65520.0,
                             0x1p-24, 0x1p-25, 1e-40, -1e-42, 3.4e38,       -1.0e300, 1e-310};
  const int n_special = sizeof(specials) / sizeof(specials[0]);
  for (int64_t i = 0; i < b.n; ++i) {
    const int p = pick(gen);
    double v;
    if (p < 5) {
      v = specials[(p * 7 + i) % n_special];
    } else {
      v = (p % 2 ? -1.0 : 1.0) * std::ldexp(mant(gen), expo(gen));
    }
    b.set(i, v);
  }
}

bool involves_f64(DType a, DType b) { return a == DType::kFloat64 || b == DType::kFloat64; }

// Naive reference of scaled_cast_cpu: documented semantics, one element at a time.
void reference_scaled_cast(const Buffer& src, Buffer& dst, float scale) {
  for (int64_t i = 0; i < src.n; ++i) {
    if (involves_f64(src.dtype, dst.dtype)) {
      dst.set(i, src.value(i) * static_cast<double>(scale));
    } else {
      dst.set(i, static_cast<double>(static_cast<float>(src.value(i)) * scale));
    }
  }
}

// Naive reference of sum_rows_cpu: rows summed in order in fp32 (fp64), then scaled.
void reference_sum_rows(const Buffer& src, int64_t rows, int64_t n, Buffer& dst, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    if (involves_f64(src.dtype, dst.dtype)) {
      double acc = src.value(i);  // from row 0, like the kernels: -0.0 rows sum to -0.0
      for (int64_t r = 1; r < rows; ++r) acc += src.value(r * n + i);
      dst.set(i, acc * static_cast<double>(scale));
    } else {
      float acc = static_cast<float>(src.value(i));
      for (int64_t r = 1; r < rows; ++r) acc += static_cast<float>(src.value(r * n + i));
      dst.set(i, static_cast<double>(acc * scale));
    }
  }
}

// Bitwise comparison of the first n elements; NaN only has to be NaN.
void expect_same(const Buffer& got, const Buffer& want, const std::string& what) {
  ASSERT_EQ(got.dtype, want.dtype);
  Mismatches bad;
  for (int64_t i = 0; i < want.n; ++i) {
    if (want.is_nan(i)) {
      if (!got.is_nan(i))
        bad.add("[" + std::to_string(i) + "] expected NaN, got " + hex(got.bits(i)));
    } else if (got.bits(i) != want.bits(i)) {
      bad.add("[" + std::to_string(i) + "] got " + hex(got.bits(i)) + " (" +
              std::to_string(got.value(i)) + "), expected " + hex(want.bits(i)) + " (" +
              std::to_string(want.value(i)) + ")");
    }
  }
  EXPECT_EQ(bad.count(), 0) << what << ": " << bad.report();
  EXPECT_TRUE(got.guard_intact()) << what << ": wrote outside [0, n)";
}

using KernelParam = std::tuple<DType, DType, int64_t>;

std::string kernel_param_name(const ::testing::TestParamInfo<KernelParam>& info) {
  return std::string(k::dtype_name(std::get<0>(info.param))) + "_to_" +
         k::dtype_name(std::get<1>(info.param)) + "_n" + std::to_string(std::get<2>(info.param));
}

class KernelTest : public ::testing::TestWithParam<KernelParam> {
 protected:
  DType src_t() const { return std::get<0>(GetParam()); }
  DType dst_t() const { return std::get<1>(GetParam()); }
  int64_t n() const { return std::get<2>(GetParam()); }
  uint64_t seed() const {
    return (static_cast<uint64_t>(src_t()) * 4 + static_cast<uint64_t>(dst_t())) * 1000003u +
           static_cast<uint64_t>(n());
  }
  std::string label(const char* op, float scale, int64_t extra = -1) const {
    std::string s = std::string(op) + " " + k::dtype_name(src_t()) + "->" + k::dtype_name(dst_t()) +
                    " n=" + std::to_string(n()) + " scale=" + std::to_string(scale);
    if (extra >= 0) s += " rows=" + std::to_string(extra);
    return s;
  }
};

using ScaledCastCpu = KernelTest;
using SumRowsCpu = KernelTest;

TEST_P(ScaledCastCpu, MatchesNaiveReference) {
  Buffer src(src_t(), n());
  fill_random(src, seed());
  for (float scale : {1.0f, 0.5f, 1.0f / 3.0f, 0.25f, -1.75f, 3.0f}) {
    Buffer got(dst_t(), n()), want(dst_t(), n());
    k::scaled_cast_cpu(src.data(), src_t(), got.data(), dst_t(), n(), scale);
    reference_scaled_cast(src, want, scale);
    expect_same(got, want, label("scaled_cast_cpu", scale));
  }
}

// Pointers one element past an aligned address (as inside a bucket view) give the same bits.
TEST_P(ScaledCastCpu, MisalignedPointers) {
  Buffer src(src_t(), n(), /*offset=*/1);
  fill_random(src, seed() + 1);
  Buffer got(dst_t(), n(), /*offset=*/1), want(dst_t(), n());
  k::scaled_cast_cpu(src.data(), src_t(), got.data(), dst_t(), n(), 0.125f);
  reference_scaled_cast(src, want, 0.125f);
  expect_same(got, want, label("scaled_cast_cpu (offset 1)", 0.125f));
}

TEST_P(SumRowsCpu, MatchesNaiveReference) {
  for (int64_t rows : {1, 2, 3, 4, 7}) {
    Buffer src(src_t(), rows * n());
    fill_random(src, seed() * 31 + rows);
    for (float scale : {1.0f, 1.0f / 3.0f, 0.25f}) {
      Buffer got(dst_t(), n()), want(dst_t(), n());
      k::sum_rows_cpu(src.data(), src_t(), rows, n(), got.data(), dst_t(), scale);
      reference_sum_rows(src, rows, n(), want, scale);
      expect_same(got, want, label("sum_rows_cpu", scale, rows));
    }
  }
}

TEST_P(SumRowsCpu, MisalignedPointers) {
  const int64_t rows = 3;
  Buffer src(src_t(), rows * n(), /*offset=*/1);
  fill_random(src, seed() + 7);
  Buffer got(dst_t(), n(), /*offset=*/1), want(dst_t(), n());
  k::sum_rows_cpu(src.data(), src_t(), rows, n(), got.data(), dst_t(), 0.5f);
  reference_sum_rows(src, rows, n(), want, 0.5f);
  expect_same(got, want, label("sum_rows_cpu (offset 1)", 0.5f, rows));
}

const int64_t kSizes[] = {0, 1, 7, 2047, 2048, 2049, 100003};

INSTANTIATE_TEST_SUITE_P(AllPairs, ScaledCastCpu,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kSizes)),
                         kernel_param_name);
INSTANTIATE_TEST_SUITE_P(AllPairs, SumRowsCpu,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kSizes)),
                         kernel_param_name);

// In place (src == dst, same dtype) is allowed and must equal the out-of-place result.
class ScaledCastInPlace : public ::testing::TestWithParam<DType> {};

TEST_P(ScaledCastInPlace, MatchesOutOfPlace) {
  const DType t = GetParam();
  const int64_t n = 4099;
  Buffer buf(t, n), want(t, n);
  fill_random(buf, 99 + static_cast<uint64_t>(t));
  reference_scaled_cast(buf, want, 0.25f);
  k::scaled_cast_cpu(buf.data(), t, buf.data(), t, n, 0.25f);
  expect_same(buf, want, std::string("in-place ") + k::dtype_name(t));
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, ScaledCastInPlace, ::testing::ValuesIn(kAllDTypes),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(k::dtype_name(info.param));
                         });

// ---- API contract --------------------------------------------------------------------------

TEST(KernelApi, DTypeSizesAndNames) {
  EXPECT_EQ(k::dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(k::dtype_size(DType::kFloat64), 8u);
  EXPECT_EQ(k::dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(k::dtype_size(DType::kBFloat16), 2u);
  EXPECT_STREQ(k::dtype_name(DType::kFloat32), "float32");
  EXPECT_STREQ(k::dtype_name(DType::kFloat64), "float64");
  EXPECT_STREQ(k::dtype_name(DType::kFloat16), "float16");
  EXPECT_STREQ(k::dtype_name(DType::kBFloat16), "bfloat16");
}

TEST(KernelApi, RejectsBadArguments) {
  float a[4] = {1, 2, 3, 4}, b[4];
  const DType bad = static_cast<DType>(7);
  EXPECT_THROW(k::scaled_cast_cpu(a, bad, b, DType::kFloat32, 4, 1.0f), std::invalid_argument);
  EXPECT_THROW(k::scaled_cast_cpu(a, DType::kFloat32, b, bad, 4, 1.0f), std::invalid_argument);
  EXPECT_THROW(k::sum_rows_cpu(a, bad, 1, 4, b, DType::kFloat32, 1.0f), std::invalid_argument);
  EXPECT_THROW(k::sum_rows_cpu(a, DType::kFloat32, 0, 4, b, DType::kFloat32, 1.0f),
               std::invalid_argument);
  EXPECT_THROW(k::dtype_size(bad), std::invalid_argument);
  EXPECT_THROW(k::dtype_name(bad), std::invalid_argument);
}

TEST(KernelApi, ZeroAndNegativeCountsWriteNothing) {
  Buffer src(DType::kFloat32, 8), dst(DType::kFloat16, 0);
  fill_random(src, 5);
  k::scaled_cast_cpu(src.data(), DType::kFloat32, dst.data(), DType::kFloat16, 0, 2.0f);
  k::scaled_cast_cpu(src.data(), DType::kFloat32, dst.data(), DType::kFloat16, -3, 2.0f);
  k::sum_rows_cpu(src.data(), DType::kFloat32, 2, 0, dst.data(), DType::kFloat16, 2.0f);
  EXPECT_TRUE(dst.guard_intact());
}

// ---- multi-tensor launches: how the blocks are shared (host code; the kernels themselves run
// in test_cuda_kernels.cpp) ---------------------------------------------------------------------

TEST(MultiTensorPlan, EveryElementIsCoveredByItsTensorsBlocks) {
  namespace k = ddpx::kernels;
  const int threads = 256;
  const std::vector<int64_t> n{0, 1, 255, 256, 257, 0, 100003, 3, 1000000000, 0, 512};
  int starts[k::kMultiTensors + 1];
  const int count = static_cast<int>(n.size());
  const int64_t total = k::plan_blocks(n.data(), count, threads, 1024, starts);
  EXPECT_EQ(starts[0], 0);
  EXPECT_EQ(starts[count], total);
  const std::vector<int64_t> want{0, 1, 1, 1, 2, 0, 391, 1, 1024, 0, 2};
  for (int i = 0; i < count; ++i) {
    EXPECT_EQ(starts[i + 1] - starts[i], want[i]) << "tensor " << i;
  }
  // Every block maps to a tensor with elements, in order; each tensor's blocks, striding by their
  // count, visit each of its elements exactly once (checked on the small tensors).
  std::vector<std::vector<int>> hits(count);
  for (int i = 0; i < count; ++i) hits[i].assign(n[i] < 200000 ? n[i] : 0, 0);
  for (int64_t b = 0; b < total; ++b) {
    const int t = k::tensor_of_block(starts, count, b);
    ASSERT_GT(n[t], 0) << "block " << b;
    ASSERT_TRUE(starts[t] <= b && b < starts[t + 1]);
    if (hits[t].empty()) continue;
    const int64_t blocks = starts[t + 1] - starts[t];
    for (int th = 0; th < threads; ++th) {
      for (int64_t e = (b - starts[t]) * threads + th; e < n[t]; e += blocks * threads) {
        ++hits[t][e];
      }
    }
  }
  for (int i = 0; i < count; ++i) {
    for (size_t e = 0; e < hits[i].size(); ++e) ASSERT_EQ(hits[i][e], 1) << i << ":" << e;
  }
  // Nothing to do: no blocks.
  const int64_t none[2] = {0, 0};
  EXPECT_EQ(k::plan_blocks(none, 2, threads, 1024, starts), 0);
}

}  // namespace
