// The per-channel and per-element steps of the uint8 min-max quantization, shared by the CPU
// kernels (quantize_cpu.cpp) and the CUDA kernels (quantize_cuda.cu) so that both compute the
// same bits. Each step is one ATen operation of torch's observer and quantization hooks, rounded
// as ATen rounds it. Products and sums are written so that no compiler contraction into an fma
// can skip a rounding (quantize_cpu.cpp is compiled with -ffp-contract=off; nvcc contracts by
// default, hence the __f*_rn intrinsics).
#pragma once

#include <math.h>

#include <cstdint>

#ifdef __CUDACC__
#define DDPX_QUANT_INLINE __host__ __device__ __forceinline__
#else
#define DDPX_QUANT_INLINE inline __attribute__((always_inline))
#endif

namespace ddpx {
namespace kernels {
namespace detail {

// torch.finfo(torch.float32).eps, the observer's lower bound on a scale.
constexpr float kQuantEps = 1.1920928955078125e-07f;

DDPX_QUANT_INLINE float q_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DDPX_QUANT_INLINE float q_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DDPX_QUANT_INLINE float q_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Round half to even (torch.round) for |v| < 2^22: adding and subtracting 1.5 * 2^23 leaves
// the nearest integer under the default rounding mode, in two additions that vectorise.
DDPX_QUANT_INLINE float round_even(float v) { return q_add(q_add(v, 12582912.0f), -12582912.0f); }
DDPX_QUANT_INLINE double round_even(double v) {
  return (v + 6755399441055744.0) - 6755399441055744.0;
}

// The observer's parameters from a channel's min and max (taken with 0 included, as
// MinMaxObserver's min(min, 0) and max(max, 0) do). Non-finite min or max: scale NaN.
DDPX_QUANT_INLINE void minmax_qparams(float mn, float mx, float* scale, float* zero_point) {
  if (!(isfinite(mn) && isfinite(mx))) {
    *scale = NAN;
    *zero_point = 0.0f;
    return;
  }
  const float min_neg = mn < 0.0f ? mn : 0.0f;
  const float max_pos = mx > 0.0f ? mx : 0.0f;
  float s = q_div(q_add(max_pos, -min_neg), 255.0f);
  s = s > kQuantEps ? s : kQuantEps;
  // |min_neg / s| <= 255, so round_even applies.
  const float z = -round_even(q_div(min_neg, s));
  *scale = s;
  // + 0: round_even gives -0 for a small negative quotient, torch's integer zero point 0.
  *zero_point = q_add(z < 0.0f ? 0.0f : (z > 255.0f ? 255.0f : z), 0.0f);
}

// clamp(r + zero_point, 0, 255) as a byte, for an integral r with |r| <= 256 (a finite
// channel's |x / scale| is at most 255 by construction, plus the quotient's rounding).
template <typename F>
DDPX_QUANT_INLINE uint8_t to_byte(F r, float zero_point) {
  F v = r + static_cast<F>(zero_point);
  v = v < F(0) ? F(0) : v;
  v = v > F(255) ? F(255) : v;
  return static_cast<uint8_t>(v);
}

// scale * (float(q) - zero_point): the dequantized value, two fp32 roundings (the first exact).
DDPX_QUANT_INLINE float dequantize(uint8_t q, float scale, float zero_point) {
  return q_mul(scale, q_add(static_cast<float>(q), -zero_point));
}

}  // namespace detail
}  // namespace kernels
}  // namespace ddpx
