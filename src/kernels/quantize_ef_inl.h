// The per-block and per-element steps of the block quantization with error feedback
// (quantize_ef.h), shared by the CPU kernels (quantize_ef_cpu.cpp) and the CUDA kernels
// (quantize_ef_cuda.cu) so that both encode, decode and keep residuals with the same
// arithmetic. Products and sums go through q_mul / q_add (quantize_inl.h): no fma contraction.
#pragma once

#include <math.h>

#include <cstdint>

#include "quantize_inl.h"

namespace ddpx {
namespace kernels {
namespace detail {

// The code of q = 0 for bits >= 2 (the offset of the stored integers).
DDPX_QUANT_INLINE uint32_t zero_code(int bits) { return bits == 1 ? 0u : 1u << (bits - 1); }
DDPX_QUANT_INLINE float qmax_of(int bits) { return static_cast<float>((1 << (bits - 1)) - 1); }

// SplitMix64's finaliser: a bijective 64-bit mix, enough to make counters look uniform.
DDPX_QUANT_INLINE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A uniform draw in [0, 1) on a 2^-24 grid from (seed, stream, index): counter-based, so any
// value's draw is known without the others' (threads, resumed runs).
DDPX_QUANT_INLINE float uniform01(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t key = mix64(seed + 0x9e3779b97f4a7c15ULL * (stream + 1));
  return static_cast<float>(mix64(key ^ index) >> 40) * 5.9604644775390625e-08f;
}

// The block's scale from its largest magnitude and the sum of its magnitudes (see quantize_ef.h).
DDPX_QUANT_INLINE float block_scale(int bits, bool stochastic, float absmax, float abssum,
                                    int64_t len) {
  if (bits == 1) return stochastic ? absmax : q_div(abssum, static_cast<float>(len));
  return q_div(absmax, qmax_of(bits));
}

// Whether a finite block is rounded stochastically: with QuantSpec::stochastic, and at 1 bit
// under QuantSpec::unbiased_sign for a block that is not rotated (a parameter's short last
// block): the rotated blocks' unbiased scale needs a rotation, and the stochastic sign code
// (scale max|v|, code 1 with probability (1 + v / scale) / 2) is the unbiased one without it.
DDPX_QUANT_INLINE bool rounds_stochastically(bool stochastic, bool unbiased_sign, int bits,
                                             bool rotated) {
  return stochastic || (bits == 1 && unbiased_sign && !rotated);
}

// Whether a block's scale is the fitted ternary one (QuantSpec::fitted_ternary).
DDPX_QUANT_INLINE bool ternary_fit(int bits, bool stochastic, bool fitted) {
  return fitted && bits == 2 && !stochastic;
}

// The fitted ternary scale from the block's mean magnitude and the sum and count of the
// magnitudes above it. Clamped to max|v|, which the rounded sum could pass by an ulp, so that the
// bound scale <= max|v| is exact.
DDPX_QUANT_INLINE float ternary_scale(float mean, float above_sum, int64_t above, float absmax) {
  if (above == 0) return mean;
  const float s = q_div(above_sum, static_cast<float>(above));
  return s < absmax ? s : absmax;
}

// 1 / scale, or 0 for a zero scale or one so small (denormal) that its inverse overflows: the
// block then sends zeros and keeps its values in the residual. Values are encoded by a product
// with it (a division per value would cost several times more); the product differs from
// v / scale by at most an ulp, so the code is the nearest level up to a tie, and the error
// bounds of quantize_ef.h hold.
DDPX_QUANT_INLINE float inverse_scale(float scale) {
  const float inv = scale > 0.0f ? q_div(1.0f, scale) : 0.0f;
  return inv <= 3.4028234663852886e+38f ? inv : 0.0f;
}

// The fitted 2-bit mode's midrise code (quantize_ef.h). Its starting half step, from the block's
// mean magnitude: half the rms of a normal block of that mean (rms = mean * sqrt(pi / 2)).
DDPX_QUANT_INLINE float midrise_start(float mean) { return q_mul(mean, 0.626657069f); }

// Whether the ternary code at inverse scale inv_t sends magnitude a as +-t (round_even(a * inv_t)
// is nonzero: above one half; a tie rounds to 0).
DDPX_QUANT_INLINE bool ternary_nonzero(float a, float inv_t) { return q_mul(a, inv_t) > 0.5f; }
// Whether the midrise code at half step h0 sends magnitude a as +-3 h0 (rather than +-h0).
DDPX_QUANT_INLINE bool midrise_outer(float a, float h0) { return a >= q_mul(2.0f, h0); }

// The choice between the codes, from the block's sums: t1 = the sum of the magnitudes the ternary
// code at scale t sends as +-t, tk = their count; m1 = the sum of the magnitudes times their
// midrise multiple (1 or 3, at the starting half step), mm = the sum of the squared multiples.
// A code's squared error is sum v^2 minus its gain: t (2 t1 - t tk) for the ternary code, m1^2 /
// mm for the midrise one at its least-squares half step h = m1 / mm with those multiples (the
// encode then takes the nearest level at h, which can only lower the error). Returns h where the
// midrise code gains more (and 1 / 2h is finite), 0 otherwise.
DDPX_QUANT_INLINE float midrise_step(float t, float t1, int64_t tk, float m1, int64_t mm) {
  if (mm <= 0) return 0.0f;
  const float h = q_div(m1, static_cast<float>(mm));
  const float gain_m = q_mul(h, m1);
  const float gain_t = q_mul(t, q_add(q_mul(2.0f, t1), -q_mul(t, static_cast<float>(tk))));
  const bool finite_step = inverse_scale(q_mul(2.0f, h)) > 0.0f;
  return gain_m > gain_t && h > 0.0f && finite_step ? h : 0.0f;
}

// The factor a block's values are multiplied by to find their codes: inverse_scale(scale), or
// for a midrise block (2 bits, stored scale -h < 0) the inverse of its step, 1 / 2h.
DDPX_QUANT_INLINE float encode_factor(float scale, int bits) {
  return bits == 2 && scale < 0.0f ? inverse_scale(q_mul(-2.0f, scale)) : inverse_scale(scale);
}

// A midrise block's code: q + 2 for q = floor(v / 2h) clamped to [-2, 1], the nearest of the
// levels -3h, -h, h, 3h (`inv_step` = 1 / 2h). Counted by comparisons, which vectorise (floorf
// was a library call per value in the baseline x86-64 build: 5 ns a value).
DDPX_QUANT_INLINE uint32_t encode_midrise(float v, float inv_step) {
  const float x = q_mul(v, inv_step);
  return static_cast<uint32_t>(x >= -1.0f) + static_cast<uint32_t>(x >= 0.0f) +
         static_cast<uint32_t>(x >= 1.0f);
}

// The code of a finite value v of a finite block with scale `scale` (0 included; `inv` its
// encode_factor). `u`: the uniform draw (stochastic rounding only).
DDPX_QUANT_INLINE uint32_t encode(float v, float scale, float inv, int bits, bool stochastic,
                                  float u) {
  if (bits == 2 && scale < 0.0f) return encode_midrise(v, inv);
  if (bits == 1) {
    if (!stochastic || scale == 0.0f) return v >= 0.0f ? 1u : 0u;
    // P(code 1) = (1 + v / scale) / 2, so E[decode] = v.
    const float p = q_mul(q_add(1.0f, q_mul(v, inv)), 0.5f);
    return u < p ? 1u : 0u;
  }
  const float qmax = qmax_of(bits);
  float q = q_mul(v, inv);
  // |q| <= qmax (up to the rounding of scale), so the float -> integer steps are exact.
  q = stochastic ? floorf(q_add(q, u)) : round_even(q);
  q = q > qmax ? qmax : (q < -qmax ? -qmax : q);
  return static_cast<uint32_t>(static_cast<int32_t>(q) + static_cast<int32_t>(zero_code(bits)));
}

// The dequantized value of a code: q * scale, or for a midrise block (2 bits, stored scale
// -h < 0) (2 q + 1) h (2 q + 1 is exact: one rounding either way).
DDPX_QUANT_INLINE float decode(uint32_t code, float scale, int bits) {
  if (bits == 1) return code ? scale : -scale;
  const float q =
      static_cast<float>(static_cast<int32_t>(code) - static_cast<int32_t>(zero_code(bits)));
  if (bits == 2 && scale < 0.0f) return q_mul(q_add(q_mul(2.0f, q), 1.0f), -scale);
  return q_mul(q, scale);
}

// --- The rotation (QuantSpec::rotate) ---
// A rotated block of B = 2^k values travels as the code of y = c H D x, with D a diagonal of
// random signs, H the B x B Sylvester-Hadamard matrix (entries +-1, H H = B I) and c =
// 2^-ceil(k/2); it is decoded as x' = 2^-floor(k/2) D H y'. c H and 2^-floor(k/2) H are inverse up
// to a factor 2^(k/2 - ceil(k/2)) * 2^(k/2 - floor(k/2)) = 1: both factors are powers of two, so
// the only roundings are the butterflies' sums (the same sums, in the same order, on CPU and CUDA).

// 64 of D's signs: bit j of the word for index w is the sign of value 64 w + j (1: negative),
// counted over the block's draw indices (BlockRef::draw), so sender and receiver derive the same
// signs from (seed, stream) and every block and step gets its own.
DDPX_QUANT_INLINE uint64_t rotation_word(uint64_t seed, uint64_t stream, uint64_t w) {
  const uint64_t key = mix64(seed ^ 0x5851f42d4c957f2dULL) + 0xd1b54a32d192ed03ULL * (stream + 1);
  return mix64(mix64(key) ^ w);
}

// Whether value `draw` (a draw index) has its sign flipped by D.
DDPX_QUANT_INLINE bool rotation_flip(uint64_t seed, uint64_t stream, uint64_t draw) {
  return (rotation_word(seed, stream, draw >> 6) >> (draw & 63)) & 1u;
}

// k for a block of B = 2^k values (B a power of two).
DDPX_QUANT_INLINE int log2_of(int64_t block) {
  int k = 0;
  while ((int64_t(1) << k) < block) ++k;
  return k;
}

// The forward factor c = 2^-ceil(k/2) and the inverse one 2^-floor(k/2) (exact powers of two).
DDPX_QUANT_INLINE float rotation_forward_factor(int64_t block) {
  return ldexpf(1.0f, -((log2_of(block) + 1) / 2));
}
DDPX_QUANT_INLINE float rotation_inverse_factor(int64_t block) {
  return ldexpf(1.0f, -(log2_of(block) / 2));
}

// The 1-bit scale of a rotated block without error feedback: S = sum y^2 / sum |y|, which makes
// the decoded block an unbiased estimate of x over the random signs (DRIVE, Vargaftik et al.,
// NeurIPS 2021), computed as m * (sum (y/m)^2) / (sum |y| / m) with m = max|y| so that no sum
// overflows. `sq` = sum (y/m)^2 and `l1` = sum |y| / m, both taken with y * inv_m.
DDPX_QUANT_INLINE float unbiased_sign_scale(float absmax, float sq, float l1) {
  return l1 > 0.0f ? q_mul(absmax, q_div(sq, l1)) : 0.0f;
}

// Code i of a block's packed codes.
DDPX_QUANT_INLINE uint32_t unpack_code(const uint8_t* codes, int64_t i, int bits) {
  const int per = 8 / bits;
  return (static_cast<uint32_t>(codes[i / per]) >> ((i % per) * bits)) & ((1u << bits) - 1u);
}

}  // namespace detail
}  // namespace kernels
}  // namespace ddpx
