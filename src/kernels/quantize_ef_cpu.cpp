// CPU implementation of the block quantization with error feedback (quantize_ef.h). Per block:
// one pass loads the values (plus the residual) into a buffer and reduces max|v| and sum|v| in
// SIMD lanes (the fitted 2-bit codes: two more over the buffer, for the magnitudes above the
// mean and the sums that choose the code), one encodes, packs and writes the new residual. Compiled
// with -ffp-contract=off, like the uint8 kernels: the CUDA kernels round every product and sum
// alike.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "convert_inl.h"
#include "quantize_ef.h"
#include "quantize_ef_inl.h"

// The exported entry points are compiled twice on x86-64, for AVX2 and for the baseline (SSE2),
// and the loader picks one per machine (GCC's target_clones); flatten inlines the loops into each
// clone. The arithmetic is IEEE single precision either way: only the 1-bit mean scale's
// summation order, and so its last bits, differs between the two (each rank sends the scales it
// used, so ranks never disagree).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DDPX_QEF_CLONES __attribute__((target_clones("avx2", "default"), flatten))
#define DDPX_QEF_HELPER __attribute__((target_clones("avx2", "default"), noinline))
#else
#define DDPX_QEF_CLONES
#define DDPX_QEF_HELPER inline
#endif

// The nearest-level encode and the rotation's first Hadamard stages in vector extensions need
// __builtin_shufflevector (GCC 12, clang); an older compiler (GCC 9-11) runs the plain loops, to
// the same bits.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && __has_builtin(__builtin_convertvector)
#define DDPX_QEF_VECTOR_ENCODE 1
#endif
#endif
#ifndef DDPX_QEF_VECTOR_ENCODE
#define DDPX_QEF_VECTOR_ENCODE 0
#endif

namespace ddpx {
namespace kernels {
namespace {

#if defined(__GNUC__)
// Eight lanes of 32 bits (GCC's vector extensions): an AVX2 register in the AVX2 clone, two SSE2
// ones in the baseline. Casts between these types reinterpret the bits.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
#endif

[[noreturn]] void bad_dtype(DType t) {
  throw std::invalid_argument("ddpx quantize_ef kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

struct LoadF32 {
  using T = float;
  static float load(float v) { return v; }
};
struct LoadF64 {
  using T = double;
  static float load(double v) { return static_cast<float>(v); }
};
struct LoadF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return detail::half_to_float(v); }
};
struct LoadBF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return detail::bf16_to_float(v); }
};

// Calls f(L{}) with the loader of dtype t.
template <typename F>
void with_loader(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(LoadF32{});
    case DType::kFloat64:
      return f(LoadF64{});
    case DType::kFloat16:
      return f(LoadF16{});
    case DType::kBFloat16:
      return f(LoadBF16{});
  }
  bad_dtype(t);
}

// Calls f(std::integral_constant<int, B>{}) for the width B == bits (8, 4, 2 or 1).
template <typename F>
void with_bits(int bits, F&& f) {
  switch (bits) {
    case 8:
      return f(std::integral_constant<int, 8>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 1:
      return f(std::integral_constant<int, 1>{});
  }
  throw std::invalid_argument("ddpx quantize_ef kernels: bits must be 1, 2, 4 or 8");
}

// Packs the codes of one block (PER = 8 / BITS to a byte, little end first).
template <int BITS>
inline void pack_codes(const uint8_t* code, int64_t block_bytes, uint8_t* out) {
  constexpr int kPer = 8 / BITS;
  if (BITS == 8) {
    std::memcpy(out, code, static_cast<size_t>(block_bytes));
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < block_bytes; ++j) {
    uint32_t byte = 0;
    for (int k = 0; k < kPer; ++k) byte |= static_cast<uint32_t>(code[j * kPer + k]) << (k * BITS);
    out[j] = static_cast<uint8_t>(byte);
  }
}

#if DDPX_QEF_VECTOR_ENCODE
// The nearest-level codes of a block of `len` values (a multiple of 8), packed straight into
// `out` (block_bytes; the bytes past the block's codes zeroed), and the new residual when `rb`
// is not null: detail::encode's arithmetic, eight values at a time in GCC's vector extensions
// (an AVX2 register in the AVX2 clone). Written out because GCC's vectorisation of the plain
// loop narrowed the codes to bytes with masked blends and register spills: at 8 bits the pass
// ran at the speed of 2 bits' with their packing loop, and at 60% of the 1-bit pass's.
template <int BITS>
inline void encode_nearest(const float* vb, float* rb, int64_t len, float scale, float inv,
                           int64_t block_bytes, uint8_t* out) {
  if constexpr (BITS >= 2) {
    constexpr float kQmax = static_cast<float>((1 << (BITS - 1)) - 1);
    constexpr int32_t kZero = 1 << (BITS - 1);
    // Lane k's code lands at bit (k * BITS) % 32 of the 32-bit word that holds it.
    constexpr uint32_t kPerWord = 32 / BITS < 8 ? 32 / BITS : 8;
    const v8u shift = {(0 % kPerWord) * BITS, (1 % kPerWord) * BITS, (2 % kPerWord) * BITS,
                       (3 % kPerWord) * BITS, (4 % kPerWord) * BITS, (5 % kPerWord) * BITS,
                       (6 % kPerWord) * BITS, (7 % kPerWord) * BITS};
    const v8f vinv = {inv, inv, inv, inv, inv, inv, inv, inv};
    const v8f vscale = {scale, scale, scale, scale, scale, scale, scale, scale};
    const v8f hi = {kQmax, kQmax, kQmax, kQmax, kQmax, kQmax, kQmax, kQmax};
    const v8f lo = -hi;
    const v8f magic = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                       12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};
    constexpr int64_t kGroupBytes = BITS;  // eight codes
    for (int64_t g = 0; g < len / 8; ++g) {
      v8f v;
      std::memcpy(&v, vb + g * 8, sizeof(v));
      // round_even(v * inv), clamped to +-qmax: detail::encode's steps, lane by lane.
      v8f q = (v * vinv + magic) - magic;
      q = q > hi ? hi : q;
      q = q < lo ? lo : q;
      if (rb) {
        const v8f r = v - q * vscale;  // q_add(v, -q_mul(q, scale)): the same roundings
        std::memcpy(rb + g * 8, &r, sizeof(r));
      }
      v8u c = (v8u)(__builtin_convertvector(q, v8i) + kZero) << shift;
      // OR the lanes of each 32-bit word together (4 lanes a word at 8 bits, all 8 below).
      c |= __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6);
      c |= __builtin_shufflevector(c, c, 2, 3, 0, 1, 6, 7, 4, 5);
      if (BITS == 8) {
        const uint32_t words[2] = {c[0], c[4]};
        std::memcpy(out + g * kGroupBytes, words, 8);
      } else {
        const uint32_t word = c[0] | c[4];
        std::memcpy(out + g * kGroupBytes, &word, kGroupBytes);  // little-endian: low bytes
      }
    }
    // A short block's unused codes are zeros, as in the scalar path.
    const int64_t used = len / 8 * kGroupBytes;
    std::memset(out + used, 0, static_cast<size_t>(block_bytes - used));
  }
}

#endif  // DDPX_QEF_VECTOR_ENCODE

// The rotation (QuantSpec::rotate, quantize_ef_inl.h). dst[i] = src[i] * +-factor (dst may be
// src), the sign D's for draw index draw + i: one generator word per 64 values; the product by a
// power of two is exact.
inline void scale_signs(const float* src, float* dst, int64_t len, uint64_t seed, uint64_t stream,
                        uint64_t draw, float factor) {
#if defined(__GNUC__)
  if ((draw & 7) == 0 && len % 8 == 0) {
    // Eight values at a time (every whole block of a parameter starts at a multiple of 8): the
    // byte of D's word that holds their signs, spread to the lanes' sign bits. y * -f is -(y * f)
    // bit for bit, so flipping the product's sign is the scalar loop's q_mul.
    const v8u lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8f vf = {factor, factor, factor, factor, factor, factor, factor, factor};
    uint64_t word = 0;
    for (int64_t i = 0; i < len; i += 8) {
      const uint64_t at = draw + static_cast<uint64_t>(i);
      if (i == 0 || (at & 63) == 0) word = detail::rotation_word(seed, stream, at >> 6);
      const uint32_t byte = static_cast<uint32_t>(word >> (at & 63)) & 0xffu;
      const v8u flip = (((v8u{byte, byte, byte, byte, byte, byte, byte, byte}) >> lane) & 1u) << 31;
      v8f v;
      std::memcpy(&v, src + i, sizeof(v));
      v = (v8f)((v8u)(v * vf) ^ flip);
      std::memcpy(dst + i, &v, sizeof(v));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < len;) {
    const uint64_t at = draw + static_cast<uint64_t>(i);
    const uint64_t word = detail::rotation_word(seed, stream, at >> 6);
    const int first = static_cast<int>(at & 63);
    const int64_t n = std::min<int64_t>(len - i, 64 - first);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const bool flip = (word >> (first + j)) & 1u;
      dst[i + j] = detail::q_mul(src[i + j], flip ? -factor : factor);
    }
    i += n;
  }
}

#if DDPX_QEF_VECTOR_ENCODE
// (a, b) -> (a + b, a - b), lane by lane.
inline void butterfly(v8f& a, v8f& b) {
  const v8f t = a;
  a = t + b;
  b = t - b;
}

// Stages 1, 2 and 4 within one vector of eight values, in place: v * (+-1) + (v's partners), which
// is a + b or -b + a = a - b exactly, with one shuffle a stage. (By reference: a vector returned
// by value changes the baseline clone's ABI.)
inline void hadamard8(v8f& v) {
  const v8f s1 = {1, -1, 1, -1, 1, -1, 1, -1};
  const v8f s2 = {1, 1, -1, -1, 1, 1, -1, -1};
  const v8f s4 = {1, 1, 1, 1, -1, -1, -1, -1};
  v = v * s1 + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  v = v * s2 + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v * s4 + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
}

// Stages 1 to 32 of 64 consecutive values, in eight registers.
inline void hadamard64(float* y) {
  v8f r[8];
  std::memcpy(r, y, sizeof(r));
  for (v8f& v : r) hadamard8(v);
  butterfly(r[0], r[1]);
  butterfly(r[2], r[3]);
  butterfly(r[4], r[5]);
  butterfly(r[6], r[7]);
  butterfly(r[0], r[2]);
  butterfly(r[1], r[3]);
  butterfly(r[4], r[6]);
  butterfly(r[5], r[7]);
  butterfly(r[0], r[4]);
  butterfly(r[1], r[5]);
  butterfly(r[2], r[6]);
  butterfly(r[3], r[7]);
  std::memcpy(y, r, sizeof(r));
}
#endif

// In place, y = H y for len = 2^k values: stages h = 1, 2, ..., len / 2, each taking the pairs
// (i, i + h) of every group of 2h values to (a + b, a - b). The CUDA kernels run the same
// stages, so the sums are the same bit for bit (each value's sums are fixed by the stages, not
// by the loop order). Stages 1 to 32 go in registers, 64 values at a time; the later ones pass
// over the block once each.
inline void hadamard(float* y, int64_t len) {
#if DDPX_QEF_VECTOR_ENCODE
  if (len >= 8) {
    int64_t h = 64;
    if (len >= 64) {
      for (int64_t g = 0; g < len; g += 64) hadamard64(y + g);
    } else {
      for (int64_t g = 0; g < len; g += 8) {
        v8f v;
        std::memcpy(&v, y + g, sizeof(v));
        hadamard8(v);
        std::memcpy(y + g, &v, sizeof(v));
      }
      h = 8;
    }
    for (; h < len; h *= 2) {
      for (int64_t g = 0; g < len; g += 2 * h) {
        for (int64_t i = 0; i < h; i += 8) {
          v8f a, b;
          std::memcpy(&a, y + g + i, sizeof(a));
          std::memcpy(&b, y + g + h + i, sizeof(b));
          butterfly(a, b);
          std::memcpy(y + g + i, &a, sizeof(a));
          std::memcpy(y + g + h + i, &b, sizeof(b));
        }
      }
    }
    return;
  }
#endif
  for (int64_t h = 1; h < len; h *= 2) {
    for (int64_t g = 0; g < len; g += 2 * h) {
      float* lo = y + g;
      float* hi = y + g + h;
      for (int64_t i = 0; i < h; ++i) {
        const float a = lo[i], b = hi[i];
        lo[i] = detail::q_add(a, b);
        hi[i] = detail::q_add(a, -b);
      }
    }
  }
}

// y = c H D v (a whole block of `len` = block values; y and v distinct).
inline void rotate_forward(const float* v, float* y, int64_t len, const QuantSpec& spec,
                           uint64_t draw) {
  scale_signs(v, y, len, spec.seed, spec.stream, draw, detail::rotation_forward_factor(len));
  hadamard(y, len);
}

// d = 2^-floor(k/2) D H d, in place (the inverse of rotate_forward).
inline void rotate_back(float* d, int64_t len, uint64_t seed, uint64_t stream, uint64_t draw) {
  hadamard(d, len);
  scale_signs(d, d, len, seed, stream, draw, detail::rotation_inverse_factor(len));
}

// The fitted 2-bit mode's scale of a finite block (quantize_ef.h): the ternary scale t, or -h
// where the midrise code at half step h has the smaller squared error. Two passes over the
// buffered values: the magnitudes above the mean (t), then the sums midrise_step compares.
inline float fitted_2bit_scale(const float* vb, int64_t len, float abssum, float absmax) {
  const float mean = detail::q_div(abssum, static_cast<float>(len));
  float above_sum = 0.0f;
  int64_t above = 0;
#pragma omp simd reduction(+ : above_sum, above)
  for (int64_t i = 0; i < len; ++i) {
    const float a = fabsf(vb[i]);
    const bool kept = a > mean;
    above_sum += kept ? a : 0.0f;
    above += kept ? 1 : 0;
  }
  const float t = detail::ternary_scale(mean, above_sum, above, absmax);
  const float inv_t = detail::inverse_scale(t);
  const float h0 = detail::midrise_start(mean);
  // The sums, eight values at a time in GCC's vector extensions where the compiler has them
  // (GCC left the plain loop scalar in the AVX2 clone, with a branch per value: 3-8 ns a
  // value), the rest one at a time. Counts are kept in floats: exact below 2^24.
  float t1 = 0.0f, m1 = 0.0f, tk = 0.0f, outer = 0.0f;
  int64_t i = 0;
#if defined(__GNUC__)
  {
    const v8f vinv = {inv_t, inv_t, inv_t, inv_t, inv_t, inv_t, inv_t, inv_t};
    const float thresh = detail::q_mul(2.0f, h0);  // midrise_outer's bound
    const v8f vthresh = {thresh, thresh, thresh, thresh, thresh, thresh, thresh, thresh};
    const v8f half = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
    const v8f one = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
    const v8i abs_mask = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                          0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    v8f vt1 = {}, vm1 = {}, vtk = {}, vouter = {};
    for (; i + 8 <= len; i += 8) {
      v8f v;
      std::memcpy(&v, vb + i, sizeof(v));
      const v8f a = (v8f)((v8i)v & abs_mask);
      // Comparisons give all-ones lanes where true: AND with 1.0f's bits makes 0/1 factors.
      const v8f nonzero = (v8f)((a * vinv > half) & (v8i)one);  // ternary_nonzero
      const v8f out = (v8f)((a >= vthresh) & (v8i)one);         // midrise_outer
      vt1 += nonzero * a;
      vtk += nonzero;
      vm1 += a * (one + out + out);  // a or 3a
      vouter += out;
    }
    for (int k = 0; k < 8; ++k) {
      t1 += vt1[k];
      tk += vtk[k];
      m1 += vm1[k];
      outer += vouter[k];
    }
  }
#endif
  for (; i < len; ++i) {
    const float a = fabsf(vb[i]);
    const float nonzero = detail::ternary_nonzero(a, inv_t) ? 1.0f : 0.0f;
    const float out = detail::midrise_outer(a, h0) ? 1.0f : 0.0f;
    t1 += nonzero * a;
    tk += nonzero;
    m1 += a * (1.0f + out + out);
    outer += out;
  }
  const float h = detail::midrise_step(t, t1, static_cast<int64_t>(tk), m1,
                                       len + 8 * static_cast<int64_t>(outer));
  return h > 0.0f ? -h : t;
}

// max|v|, sum|v|, whether a value is NaN or infinite, and (load_block with a residual) whether
// every value of x is zero. Functions of their own, cloned like the entry points and never
// inlined into them: flattened into them, GCC kept the sum's lanes on the stack in some widths'
// loops (a store-to-load chain per eight values, on the critical path of the block loop).
struct BlockStats {
  float absmax;
  float abssum;
  bool nonfinite;
  bool idle;
};

// The largest |value| is reduced as its bits, whose integer order is that of finite floats (a
// block with a NaN or an infinity uses no scale): an integer max reduction vectorises with every
// compiler, a float one under these flags with GCC only.
#define DDPX_QEF_STATS_STEP(value)                              \
  const float a = fabsf(value);                                 \
  amax = detail::to_bits(a) > amax ? detail::to_bits(a) : amax; \
  abssum += a;                                                  \
  nonfinite |= !(a <= 3.4028234663852886e+38f) /* NaN or infinity */

DDPX_QEF_HELPER BlockStats block_stats(const float* v, int64_t len) {
  uint32_t amax = 0;
  float abssum = 0.0f;
  int nonfinite = 0;
#pragma omp simd reduction(max : amax) reduction(+ : abssum) reduction(| : nonfinite)
  for (int64_t i = 0; i < len; ++i) {
    DDPX_QEF_STATS_STEP(v[i]);
  }
  return {detail::from_bits(amax), abssum, nonfinite != 0, false};
}

// v = x (+ r) and its statistics, in one pass.
template <typename L>
DDPX_QEF_HELPER BlockStats load_block(const typename L::T* x, const float* r, float* v,
                                      int64_t len) {
  uint32_t amax = 0;
  float abssum = 0.0f;
  int nonfinite = 0, xnonzero = 0;
  if (r) {
#pragma omp simd reduction(max : amax) reduction(+ : abssum) reduction(| : nonfinite, xnonzero)
    for (int64_t i = 0; i < len; ++i) {
      const float xi = L::load(x[i]);
      const float value = detail::q_add(xi, r[i]);
      v[i] = value;
      xnonzero |= xi != 0.0f;
      DDPX_QEF_STATS_STEP(value);
    }
  } else {
#pragma omp simd reduction(max : amax) reduction(+ : abssum) reduction(| : nonfinite)
    for (int64_t i = 0; i < len; ++i) {
      const float value = L::load(x[i]);
      v[i] = value;
      DDPX_QEF_STATS_STEP(value);
    }
    xnonzero = 1;
  }
  return {detail::from_bits(amax), abssum, nonfinite != 0, xnonzero == 0};
}
#undef DDPX_QEF_STATS_STEP

template <int BITS>
inline void decode_block(const uint8_t* cb, float scale, int64_t len, float* db);

template <int BITS, typename L>
void quantize_blocks(const typename L::T* x, float* residual, const BlockRef* refs, int64_t first,
                     int64_t last, const QuantSpec& spec, float* scales, uint8_t* codes) {
  const int64_t block = spec.block;
  const int64_t block_bytes = packed_block_bytes(BITS, block);
  constexpr uint32_t kZero = BITS == 1 ? 0u : 1u << (BITS - 1);
  constexpr float kQmax = BITS == 1 ? 1.0f : static_cast<float>((1 << (BITS - 1)) - 1);
  // One block's values and codes; thread_local so that threads running other block ranges of the
  // same message do not share them.
  thread_local std::vector<float> v, y;
  thread_local std::vector<uint8_t> code;
  v.resize(static_cast<size_t>(block));
  if (spec.rotate) y.resize(static_cast<size_t>(block));
  code.resize(static_cast<size_t>(block));
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = refs[b].begin;
    const int64_t len = refs[b].len;
    const typename L::T* xb = x + begin;
    float* rb = residual ? residual + begin : nullptr;
    float* vb = v.data();
    BlockStats stats = load_block<L>(xb, rb, vb, len);
    if (rb && stats.idle) {
      // An idle block (every value of x zero: a parameter DDP found unused) sends zeros and
      // keeps its residual for a later step (quantize_ef.h).
      scales[b] = 0.0f;
      uint8_t* cv = code.data();
      std::fill(cv, cv + len, static_cast<uint8_t>(kZero));
      std::fill(cv + len, cv + block, uint8_t(0));
      pack_codes<BITS>(cv, block_bytes, codes + b * block_bytes);
      continue;
    }
    uint8_t* cb = codes + b * block_bytes;
    // A whole block of a rotating spec is encoded from its rotated values (eb), and its residual
    // taken afterwards from the decoded codes rotated back; any other block from vb as it is.
    const bool rotated = spec.rotate && len == block && !stats.nonfinite;
    float* eb = vb;
    if (rotated) {
      eb = y.data();
      rotate_forward(vb, eb, len, spec, refs[b].draw);
      stats = block_stats(eb, len);  // nonfinite: overflowed in the rotation
    }
    const float absmax = stats.absmax, abssum = stats.abssum;
    const bool nonfinite = stats.nonfinite;
    if (nonfinite) {
      scales[b] = NAN;
      std::memset(cb, 0, static_cast<size_t>(block_bytes));
      if (rb) std::fill(rb, rb + len, 0.0f);
      continue;
    }
    float* erb = rotated ? nullptr : rb;  // the residual written by the encode loops
    const bool stochastic =
        detail::rounds_stochastically(spec.stochastic, spec.unbiased_sign, BITS, rotated);
    float scale = detail::block_scale(BITS, stochastic, absmax, abssum, len);
    if (detail::ternary_fit(BITS, spec.stochastic, spec.fitted_ternary)) {
      scale = fitted_2bit_scale(eb, len, abssum, absmax);
    } else if (BITS == 1 && rotated && spec.unbiased_sign && !spec.stochastic) {
      const float inv_m = detail::inverse_scale(absmax);
      float sq = 0.0f, l1 = 0.0f;
#pragma omp simd reduction(+ : sq, l1)
      for (int64_t i = 0; i < len; ++i) {
        const float a = detail::q_mul(fabsf(eb[i]), inv_m);
        sq += detail::q_mul(a, a);
        l1 += a;
      }
      if (inv_m > 0.0f) scale = detail::unbiased_sign_scale(absmax, sq, l1);
    }
    const float inv = detail::encode_factor(scale, BITS);
    scales[b] = scale;
    uint8_t* cv = code.data();
    bool packed = false;
    if (BITS == 2 && scale < 0.0f) {
      // A midrise block (fitted mode; never stochastic). The residual is the rounded v - d.
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t c = detail::encode_midrise(eb[i], inv);
        cv[i] = static_cast<uint8_t>(c);
        if (erb) erb[i] = detail::q_add(eb[i], -detail::decode(c, scale, 2));
      }
    } else if (stochastic) {
      const uint64_t base = refs[b].draw;
      for (int64_t i = 0; i < len; ++i) {
        const float u = detail::uniform01(spec.seed, spec.stream, base + static_cast<uint64_t>(i));
        cv[i] = static_cast<uint8_t>(detail::encode(eb[i], scale, inv, BITS, true, u));
      }
      if (erb) {
        for (int64_t i = 0; i < len; ++i) {
          erb[i] = detail::q_add(eb[i], -detail::decode(cv[i], scale, BITS));
        }
      }
    } else if (BITS == 1) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) cv[i] = eb[i] >= 0.0f ? 1 : 0;
      if (erb) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i)
          erb[i] = detail::q_add(eb[i], eb[i] >= 0.0f ? -scale : scale);
      }
#if DDPX_QEF_VECTOR_ENCODE
    } else if (len % 8 == 0) {
      encode_nearest<BITS>(eb, erb, len, scale, inv, block_bytes, cb);
      packed = true;
#endif
    } else {
      // Nearest level: the same arithmetic as detail::encode, in a loop GCC vectorises.
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        float q = detail::round_even(detail::q_mul(eb[i], inv));
        q = q > kQmax ? kQmax : (q < -kQmax ? -kQmax : q);
        cv[i] = static_cast<uint8_t>(static_cast<int32_t>(q) + static_cast<int32_t>(kZero));
        if (erb) erb[i] = detail::q_add(eb[i], -detail::q_mul(q, scale));
      }
    }
    if (!packed) {
      // The short last block's unused codes are zeros: a message's bytes depend on its values.
      std::fill(cv + len, cv + block, uint8_t(0));
      pack_codes<BITS>(cv, block_bytes, cb);
    }
    if (rotated && rb) {
      // The residual of a rotated block: v minus what the receiver decodes (in eb, no longer
      // needed).
      decode_block<BITS>(cb, scale, len, eb);
      rotate_back(eb, len, spec.seed, spec.stream, refs[b].draw);
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) rb[i] = detail::q_add(vb[i], -eb[i]);
    }
  }
}

// The dequantized values of one block (`len` values, codes at `cb`) into db, in whole groups of
// eight: db must hold len rounded up to a multiple of 8 (a short block's padding codes decode
// too).
template <int BITS>
inline void decode_block(const uint8_t* cb, float scale, int64_t len, float* db) {
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  if (BITS == 8) {
#if defined(__GNUC__)
    // Eight codes at a time from two 32-bit words, each broadcast to four lanes and shifted
    // per lane (as the narrower widths below): GCC's vectorisation of the byte loop, and a
    // vector conversion from bytes, both assembled lanes from scalar extracts and ran at half
    // of memcpy's bandwidth.
    const v8u shift = {0, 8, 16, 24, 0, 8, 16, 24};
    const v8f vscale = {scale, scale, scale, scale, scale, scale, scale, scale};
    const int64_t groups = (len + 7) / 8;
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t lo, hi;
      std::memcpy(&lo, cb + g * 8, 4);
      std::memcpy(&hi, cb + g * 8 + 4, 4);
      const v8u codes = ((v8u{lo, lo, lo, lo, hi, hi, hi, hi}) >> shift) & 0xffu;
      const v8i q = (v8i)codes - 128;
      const v8f out = __builtin_convertvector(q, v8f) * vscale;
      std::memcpy(db + g * 8, &out, sizeof(out));
    }
#else
    for (int64_t j = 0; j < len; ++j) db[j] = detail::decode(cb[j], scale, 8);
#endif
  } else {
    // Eight codes at a time from the BITS bytes that hold them: one word, broadcast to eight
    // lanes, each shifted by its own constant, masked, decoded, stored as one vector (GCC's
    // vector extensions: an AVX2 register in the AVX2 clone, two SSE2 ones in the baseline).
    // Written out because GCC vectorises the plain loop across groups instead, with a scalar
    // store per value. The arithmetic is detail::decode's: the sign select for 1 bit, one
    // product (no fma: -ffp-contract=off) otherwise. A block is a multiple of 8 values, so
    // whole groups never read past its codes.
    const int64_t groups = (len + 7) / 8;
#if defined(__GNUC__)
    const v8u shift = {0 * BITS, 1 * BITS, 2 * BITS, 3 * BITS,
                       4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS};
    // A midrise 2-bit block (scale -h) decodes as (2 q + 1) h: the integer step per lane is
    // q * qmul + qadd, 1 and 0 for the other blocks (the same bits as q * scale there).
    const bool midrise = BITS == 2 && scale < 0.0f;
    const int32_t qmul = midrise ? 2 : 1, qadd = midrise ? 1 : 0;
    const float level = midrise ? -scale : scale;
    const v8f vscale = {level, level, level, level, level, level, level, level};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* src = cb + g * BITS;
      uint32_t w = 0;
      for (int k = 0; k < BITS; ++k) w |= static_cast<uint32_t>(src[k]) << (8 * k);
      const v8u codes = ((v8u{w, w, w, w, w, w, w, w}) >> shift) & kMask;
      v8f out;
      // (Casts between vector types of one size reinterpret the bits.)
      if (BITS == 1) {
        const v8i one = (v8i)codes != 0;  // all ones where the code is 1
        out = (v8f)((one & (v8i)vscale) | (~one & (v8i)(-vscale)));
      } else if (BITS == 2) {
        const v8i q = (v8i)codes - 2;
        out = __builtin_convertvector(q * qmul + qadd, v8f) * vscale;
      } else {
        const v8i q = (v8i)codes - static_cast<int32_t>(1 << (BITS - 1));
        out = __builtin_convertvector(q, v8f) * vscale;
      }
      std::memcpy(db + g * 8, &out, sizeof(out));
    }
#else
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* src = cb + g * BITS;
      uint32_t w = 0;
      for (int k = 0; k < BITS; ++k) w |= static_cast<uint32_t>(src[k]) << (8 * k);
      float* o = db + g * 8;
      for (int k = 0; k < 8; ++k) o[k] = detail::decode((w >> (k * BITS)) & kMask, scale, BITS);
    }
#endif
  }
}

// `direct`: an fp32 destination indexed like the refs, where a block whose length is a multiple
// of 8 decodes in place; other blocks, and every block when it is null, decode into a buffer
// that `store` then consumes. (Through the buffer, the copy was a library call per block.)
template <int BITS, typename Store>
void dequantize_blocks_fixed(const uint8_t* message, int64_t blocks, const BlockRef* refs,
                             int64_t first, int64_t last, int64_t block, Store store, float* direct,
                             const Unrotate& unrotate) {
  const auto* scales = reinterpret_cast<const float*>(message);
  const uint8_t* codes = message + 4 * blocks;
  const int64_t block_bytes = packed_block_bytes(BITS, block);
  thread_local std::vector<float> d;
  d.resize(static_cast<size_t>(block));
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = refs[b].begin;
    const int64_t len = refs[b].len;
    const bool in_place = direct != nullptr && len % 8 == 0;
    float* db = in_place ? direct + begin : d.data();
    decode_block<BITS>(codes + b * block_bytes, scales[b], len, db);
    if (unrotate.on && len == block) {
      rotate_back(db, len, unrotate.seed, unrotate.stream_of(0), refs[b].draw);
    }
    if (!in_place) store(begin, db, len);
  }
}

template <typename Store>
void dequantize_blocks(const uint8_t* message, int64_t blocks, const BlockRef* refs, int64_t first,
                       int64_t last, int bits, int64_t block, const Unrotate& unrotate, Store store,
                       float* direct = nullptr) {
  with_bits(bits, [&](auto b) {
    dequantize_blocks_fixed<decltype(b)::value>(message, blocks, refs, first, last, block, store,
                                                direct, unrotate);
  });
}

// dequantize_sum_blocks_cpu for one width, the exact term's values loaded by L. Block by block:
// each term of a block is scaled and added into an accumulator (in L1) in term order, then the
// block is stored once. (Term by term over the whole range, dst was read and written once per
// term: 7 passes over it for two messages.) Each term is scaled before it is added, as
// allreduce_hook divides before it sums: terms near the largest float do not overflow the sum.
template <int BITS, typename L>
void sum_blocks(const uint8_t* messages, int64_t count, int64_t message_bytes, int64_t blocks,
                const BlockRef* refs, int64_t first, int64_t last, int64_t block, float post_scale,
                float* dst, const ExactTerm& exact, const Unrotate& unrotate) {
  const int64_t block_bytes = packed_block_bytes(BITS, block);
  thread_local std::vector<float> acc, d;
  acc.resize(static_cast<size_t>(block));
  d.resize(static_cast<size_t>(block));
  const bool has_exact = exact.x != nullptr;
  const auto* ex = static_cast<const typename L::T*>(exact.x);
  for (int64_t b = first; b < last; ++b) {
    const int64_t len = refs[b].len;
    float* a = acc.data();
    const float* db = d.data();
    std::fill(a, a + len, 0.0f);
    for (int64_t term = 0; term < count + (has_exact ? 1 : 0); ++term) {
      if (has_exact && term == exact.row) {
        const typename L::T* sx = ex + exact.refs[b].begin;
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) {
          a[i] = detail::q_add(a[i], detail::q_mul(L::load(sx[i]), post_scale));
        }
        continue;
      }
      const int64_t r = has_exact && term > exact.row ? term - 1 : term;
      const uint8_t* m = messages + r * message_bytes;
      decode_block<BITS>(m + 4 * blocks + b * block_bytes, reinterpret_cast<const float*>(m)[b],
                         len, d.data());
      if (unrotate.on && len == block) {
        rotate_back(d.data(), len, unrotate.seed, unrotate.stream_of(term), refs[b].draw);
      }
#pragma omp simd
      for (int64_t i = 0; i < len; ++i)
        a[i] = detail::q_add(a[i], detail::q_mul(db[i], post_scale));
    }
    std::memcpy(dst + refs[b].begin, a, static_cast<size_t>(len) * sizeof(float));
  }
}

template <typename L>
void quantize_blocks_any(int bits, const typename L::T* x, float* residual, const BlockRef* refs,
                         int64_t first, int64_t last, const QuantSpec& spec, float* scales,
                         uint8_t* codes) {
  with_bits(bits, [&](auto b) {
    quantize_blocks<decltype(b)::value, L>(x, residual, refs, first, last, spec, scales, codes);
  });
}

}  // namespace

bool valid_quant_bits(int bits) { return bits == 1 || bits == 2 || bits == 4 || bits == 8; }

bool rotation_block_ok(int64_t block) {
  return block >= 8 && block <= 8192 && (block & (block - 1)) == 0;
}

int64_t packed_block_bytes(int bits, int64_t block) { return block * bits / 8; }

int64_t quantized_message_bytes(int64_t blocks, int bits, int64_t block) {
  return (4 * blocks + blocks * packed_block_bytes(bits, block) + 15) / 16 * 16;
}

DDPX_QEF_CLONES
void quantize_ef_blocks_cpu(const void* x, DType t, float* residual, const BlockRef* refs,
                            int64_t first, int64_t last, const QuantSpec& spec, float* scales,
                            uint8_t* codes) {
  with_loader(t, [&](auto loader) {
    using L = decltype(loader);
    quantize_blocks_any<L>(spec.bits, static_cast<const typename L::T*>(x), residual, refs, first,
                           last, spec, scales, codes);
  });
}

DDPX_QEF_CLONES
void dequantize_sum_blocks_cpu(const uint8_t* messages, int64_t count, int64_t message_bytes,
                               int64_t blocks, const BlockRef* refs, int64_t first, int64_t last,
                               int bits, int64_t block, float post_scale, float* dst,
                               const ExactTerm& exact, const Unrotate& unrotate) {
  if (exact.x != nullptr && (exact.row < 0 || exact.row > count)) {
    throw std::invalid_argument("ddpx quantize_ef kernels: the exact term's row is out of range");
  }
  with_loader(exact.x != nullptr ? exact.t : DType::kFloat32, [&](auto loader) {
    with_bits(bits, [&](auto b) {
      sum_blocks<decltype(b)::value, decltype(loader)>(messages, count, message_bytes, blocks, refs,
                                                       first, last, block, post_scale, dst, exact,
                                                       unrotate);
    });
  });
}

DDPX_QEF_CLONES
void dequantize_blocks_cpu(const uint8_t* message, int64_t blocks, const BlockRef* refs,
                           int64_t first, int64_t last, int bits, int64_t block, void* dst,
                           DType dst_t, const Unrotate& unrotate) {
  switch (dst_t) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(dst);
      return dequantize_blocks(
          message, blocks, refs, first, last, bits, block, unrotate,
          [d](int64_t at, const float* v, int64_t len) {
            std::memcpy(d + at, v, static_cast<size_t>(len) * sizeof(float));
          },
          d);
    }
    case DType::kFloat64: {
      double* d = static_cast<double*>(dst);
      return dequantize_blocks(message, blocks, refs, first, last, bits, block, unrotate,
                               [d](int64_t at, const float* v, int64_t len) {
                                 for (int64_t i = 0; i < len; ++i) d[at + i] = v[i];
                               });
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return dequantize_blocks(message, blocks, refs, first, last, bits, block, unrotate,
                               [d](int64_t at, const float* v, int64_t len) {
                                 for (int64_t i = 0; i < len; ++i) {
                                   d[at + i] = detail::float_to_half(v[i]);
                                 }
                               });
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return dequantize_blocks(message, blocks, refs, first, last, bits, block, unrotate,
                               [d](int64_t at, const float* v, int64_t len) {
                                 for (int64_t i = 0; i < len; ++i) {
                                   d[at + i] = detail::float_to_bf16(v[i]);
                                 }
                               });
    }
  }
  bad_dtype(dst_t);
}

}  // namespace kernels
}  // namespace ddpx
