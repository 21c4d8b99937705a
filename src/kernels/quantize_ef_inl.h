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

// The code of a finite value v of a finite block with scale `scale` (0 included; `inv` its
// inverse_scale). `u`: the uniform draw (stochastic rounding only).
DDPX_QUANT_INLINE uint32_t encode(float v, float scale, float inv, int bits, bool stochastic,
                                  float u) {
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

// The dequantized value of a code.
DDPX_QUANT_INLINE float decode(uint32_t code, float scale, int bits) {
  if (bits == 1) return code ? scale : -scale;
  const float q =
      static_cast<float>(static_cast<int32_t>(code) - static_cast<int32_t>(zero_code(bits)));
  return q_mul(q, scale);
}

// Code i of a block's packed codes.
DDPX_QUANT_INLINE uint32_t unpack_code(const uint8_t* codes, int64_t i, int bits) {
  const int per = 8 / bits;
  return (static_cast<uint32_t>(codes[i / per]) >> ((i % per) * bits)) & ((1u << bits) - 1u);
}

}  // namespace detail
}  // namespace kernels
}  // namespace ddpx
