// Inline scalar conversions between fp32 and IEEE binary16 / bfloat16, for the kernels' loops
// (the exported functions in cast.h wrap them; calling those from a loop would not inline
// in a -fPIC build and would block vectorisation).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ddpx {
namespace kernels {
namespace detail {

inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The classic branch-free binary16 decoder: normals by exponent rebias and a multiply,
// subnormals via a magic-number subtraction.
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = two_w < (1u << 27) ? to_bits(denormalized) : to_bits(normalized);
  return from_bits(sign | mag);
}

// Branch-free binary16 encoder with round to nearest even: scaling by 2^112 then 2^-110 lets
// the fp32 adder do the rounding; inputs beyond the range become inf, NaN becomes 0x7E00.
inline uint16_t float_to_half(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_float(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest even by adding 0x7FFF plus the lowest kept bit; NaN maps to the canonical
// quiet NaN 0x7FC0, as c10::BFloat16 does, so results match torch bit for bit.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(std::isnan(f) ? 0x7FC0u : rounded);
}

}  // namespace detail
}  // namespace kernels
}  // namespace ddpx
