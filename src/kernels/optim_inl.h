// The per-element updates of SGD and Adam/AdamW, shared by the CPU kernels
// (optim_cpu.cpp) and the CUDA kernels (optim_cuda.cu), so both compute the same thing. Each line
// reproduces one ATen operation of torch.optim's single-tensor implementation, in its order and
// with its rounding, with the arithmetic of ddpx/optim/elementwise/math.h (which says how ATen
// rounds each operation).
#pragma once

#include <ddpx/optim/elementwise/math.h>

#include "optim.h"

namespace ddpx {
namespace kernels {
namespace detail {

using optim::elementwise::fmadd;
using optim::elementwise::maximum;
using optim::elementwise::mul_rn;
using optim::elementwise::select;
using optim::elementwise::sqrt_rn;

// SgdScalars rounded to the element type, as ATen rounds a Python scalar.
template <typename T>
struct SgdCoeffs {
  T neg_lr;
  T momentum;
  T one_minus_dampening;
  T weight_decay;
  bool has_momentum;
  bool has_weight_decay;
  bool nesterov;
  bool maximize;
  bool init_buffer;
};

template <typename T>
inline SgdCoeffs<T> sgd_coeffs(const SgdScalars& s) {
  SgdCoeffs<T> c;
  c.neg_lr = static_cast<T>(-s.lr);
  c.momentum = static_cast<T>(s.momentum);
  c.one_minus_dampening = static_cast<T>(1.0 - s.dampening);
  c.weight_decay = static_cast<T>(s.weight_decay);
  c.has_momentum = s.momentum != 0;
  c.has_weight_decay = s.weight_decay != 0;
  c.nesterov = s.nesterov;
  c.maximize = s.maximize;
  c.init_buffer = s.init_buffer;
  return c;
}

// torch.optim.sgd._single_tensor_sgd (identical in 1.13 and 2.11). `buf` is meaningful only
// when c.has_momentum. Every candidate is computed and the flags only select among values: a
// branch around floating-point work keeps GCC from vectorising the CPU loops (it may not
// speculate an operation that could trap), and selects cost nothing on a GPU.
template <typename T>
DDPX_OPTIM_INLINE void sgd_element(T& p, T g, T& buf, const SgdCoeffs<T>& c) {
  g = c.maximize ? -g : g;                     // grad = -grad
  const T g_wd = fmadd(p, c.weight_decay, g);  // grad.add(param, alpha=weight_decay)
  g = c.has_weight_decay ? g_wd : g;
  const T b_next = fmadd(g, c.one_minus_dampening, buf * c.momentum);  // buf.mul_(m).add_(g, 1-d)
  const T b = c.init_buffer ? g : b_next;  // first step: buf = clone(grad)
  buf = c.has_momentum ? b : buf;
  const T g_nesterov = fmadd(b, c.momentum, g);  // grad.add(buf, alpha=momentum)
  const T g_momentum = c.nesterov ? g_nesterov : b;
  g = c.has_momentum ? g_momentum : g;
  p = fmadd(g, c.neg_lr, p);  // param.add_(grad, alpha=-lr)
}

// AdamScalars rounded to the element type; the flags as 0/1 of the element type (see select).
template <typename T>
struct AdamCoeffs {
  T weight_decay;
  T decay;  // 1 - lr * weight_decay (AdamW)
  T beta1;
  T one_minus_beta1;
  T beta2;
  T one_minus_beta2;
  T neg_step_size;
  T bias_correction2_sqrt;
  T eps;
  T decoupled_decay;  // weight_decay != 0, AdamW
  T l2_decay;         // weight_decay != 0, Adam
  T lerp;             // torch 2.x: exp_avg.lerp_(grad, 1 - beta1)
  T lerp_small;       // |1 - beta1| < 0.5: ATen's lerp starts from exp_avg, else from grad
  T amsgrad;
  T maximize;
};

template <typename T>
inline AdamCoeffs<T> adam_coeffs(const AdamScalars& s) {
  AdamCoeffs<T> c;
  c.weight_decay = static_cast<T>(s.weight_decay);
  c.decay = static_cast<T>(1.0 - s.lr * s.weight_decay);
  c.beta1 = static_cast<T>(s.beta1);
  c.one_minus_beta1 = static_cast<T>(1.0 - s.beta1);
  c.beta2 = static_cast<T>(s.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - s.beta2);
  c.neg_step_size = static_cast<T>(-s.step_size);
  c.bias_correction2_sqrt = static_cast<T>(s.bias_correction2_sqrt);
  c.eps = static_cast<T>(s.eps);
  c.decoupled_decay = s.weight_decay != 0 && s.decoupled_weight_decay ? T(1) : T(0);
  c.l2_decay = s.weight_decay != 0 && !s.decoupled_weight_decay ? T(1) : T(0);
  c.lerp = s.formula == AdamFormula::kTorch2 ? T(1) : T(0);
  c.lerp_small = c.one_minus_beta1 < T(0.5) && c.one_minus_beta1 > T(-0.5) ? T(1) : T(0);
  c.amsgrad = s.amsgrad ? T(1) : T(0);
  c.maximize = s.maximize ? T(1) : T(0);
  return c;
}

// torch.optim.adam._single_tensor_adam (2.11: decoupled_weight_decay for AdamW) and 1.13's
// _single_tensor_adam / adamw._single_tensor_adamw. `vmax` is meaningful only with c.amsgrad.
template <typename T>
DDPX_OPTIM_INLINE void adam_element(T& p, T g, T& m, T& v, T& vmax, const AdamCoeffs<T>& c) {
  // As sgd_element: every candidate computed, the flags select among values.
  g = select(c.maximize, -g, g);
  const T p_decayed = p * c.decay;             // AdamW: param.mul_(1 - lr * weight_decay)
  const T g_l2 = fmadd(p, c.weight_decay, g);  // Adam: grad.add(param, alpha=weight_decay)
  p = select(c.decoupled_decay, p_decayed, p);
  g = select(c.l2_decay, g_l2, g);
  // 2.x: exp_avg.lerp_(grad, 1 - beta1), ATen's two-sided form; 1.13: exp_avg.mul_(beta1)
  // .add_(grad, alpha=1 - beta1).
  const T w = c.one_minus_beta1;
  const T d = g - m;
  const T m_lerp_small = fmadd(w, d, m);
  const T m_lerp_large = fmadd(w - T(1), d, g);
  const T m_mul_add = fmadd(g, c.one_minus_beta1, m * c.beta1);
  m = select(c.lerp, select(c.lerp_small, m_lerp_small, m_lerp_large), m_mul_add);
  v = fmadd(c.one_minus_beta2 * g, g, v * c.beta2);  // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
  // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq): NaN wins.
  const T vmax_next = maximum(vmax, v);
  vmax = select(c.amsgrad, vmax_next, vmax);
  const T s = select(c.amsgrad, vmax_next, v);
  const T denom = sqrt_rn(s) / c.bias_correction2_sqrt + c.eps;  // (sqrt / bc2_sqrt).add_(eps)
  p = p + (c.neg_step_size * m) / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
}

}  // namespace detail
}  // namespace kernels
}  // namespace ddpx
