// The arithmetic of the optimizers' element updates, torch-free and shared by the CPU loops and
// the CUDA kernels (each optimizer's traits in this folder, and src/kernels/optim_inl.h).
//
// An element update reproduces torch.optim's single-tensor implementation (foreach=False, torch's
// CPU default) operation by operation, with its rounding. ATen's CPU kernels compute
// `a.add(b, alpha=s)` as fma(b, s, a), `a.addcmul(b, c, value=s)` as fma(s * b, c, a),
// `a.addcdiv(b, c, value=s)` as a + (s * b) / c and `a.lerp(b, w)` as fma(w, b - a, a) for
// |w| < 0.5, else fma(w - 1, b - a, b); scalars are rounded to the element type first. Written
// with explicit fma so that no compiler contraction can change a result. CUDA's fma, division
// and sqrt are IEEE-rounded (nvcc's defaults), as on the CPU.
#pragma once

#include <math.h>

#ifdef __CUDACC__
#define DDPX_OPTIM_INLINE __host__ __device__ __forceinline__  // in CUDA code: for both sides
#else
#define DDPX_OPTIM_INLINE inline __attribute__((always_inline))  // inlined into the loops
#endif

namespace ddpx {
namespace optim {
namespace elementwise {

// a * b + c rounded once (ATen's add with alpha, addcmul).
DDPX_OPTIM_INLINE float fmadd(float a, float b, float c) { return fmaf(a, b, c); }
// a * b + c rounded once, in double.
DDPX_OPTIM_INLINE double fmadd(double a, double b, double c) { return fma(a, b, c); }
// The correctly rounded square root (IEEE; torch 1.13's CPU sqrt, numpy's).
DDPX_OPTIM_INLINE float sqrt_rn(float a) { return sqrtf(a); }
// The correctly rounded square root, in double.
DDPX_OPTIM_INLINE double sqrt_rn(double a) { return sqrt(a); }
// a * b rounded on its own, for a product that an addition then takes as it is (ATen's mul_
// followed by another op): GCC and nvcc contract `a * b + c` into one fma by default, which would
// skip that rounding. An fma with -0 adds nothing (the sign of a zero product included) and is
// never contracted further.
DDPX_OPTIM_INLINE float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return fmaf(a, b, -0.0f);
#endif
}
DDPX_OPTIM_INLINE double mul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return fma(a, b, -0.0);
#endif
}
// torch.maximum (and torch.amax over two values): NaN in either operand gives NaN.
template <typename T>
DDPX_OPTIM_INLINE T maximum(T a, T b) {
  const T larger = a > b ? a : b;
  return a != a ? a : larger;
}
// A select on a flag held as 0 or 1 in the element type: GCC vectorises a comparison of a
// float with a select, but not a select on an invariant bool (it keeps the loop scalar). Element
// updates compute every candidate and select among values: a branch around floating-point work
// keeps GCC from vectorising the CPU loops, and selects cost nothing on a GPU.
template <typename T>
DDPX_OPTIM_INLINE T select(T flag, T if_set, T if_clear) {
  return flag != T(0) ? if_set : if_clear;
}
// a.lerp_(b, w) as ATen computes it (two-sided: from a when |w| < 0.5, else from b); w_small is
// that condition as a select flag, decided once per tensor.
template <typename T>
DDPX_OPTIM_INLINE T lerp(T a, T b, T w, T w_small) {
  const T d = b - a;
  return select(w_small, fmadd(w, d, a), fmadd(w - T(1), d, b));
}
// torch's gradient prologue, grad = -grad under maximize and then grad.add(param, alpha=wd)
// where the L2 decay applies: its coefficients rounded to the element type (flags as 0/1 of it),
// a field of an optimizer's Coeffs filled by prologue(), and its application.
template <typename T>
struct Prologue {
  T weight_decay, has_l2, maximize;  // the L2 factor and two flags
};
// The prologue's coefficients from the options' values (computed once per step, on the host).
template <typename T>
inline Prologue<T> prologue(double weight_decay, bool has_l2, bool maximize) {
  return {static_cast<T>(weight_decay), has_l2 ? T(1) : T(0), maximize ? T(1) : T(0)};
}
// The gradient after the prologue, for the element p.
template <typename T>
DDPX_OPTIM_INLINE T l2_grad(T p, T g, const Prologue<T>& c) {
  g = select(c.maximize, -g, g);
  return select(c.has_l2, fmadd(p, c.weight_decay, g), g);
}
// lerp's w_small flag for the weight w, decided once per tensor.
template <typename T>
inline T lerp_small_flag(T w) {
  return w < T(0.5) && w > T(-0.5) ? T(1) : T(0);
}

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
