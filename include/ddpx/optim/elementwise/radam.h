// torch.optim.RAdam as an elementwise optimizer: its options and its element update (see
// all.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "checks.h"
#include "math.h"

namespace ddpx {
namespace optim {
namespace elementwise {

struct RAdam;

// torch.optim.RAdam's hyper-parameters (torch's betas as beta1 and beta2).
struct RAdamOptions {
  using Traits = RAdam;                 // the element update these options are for
  double lr = 1e-3;                     // >= 0
  double beta1 = 0.9;                   // in [0, 1)
  double beta2 = 0.999;                 // in [0, 1)
  double eps = 1e-8;                    // >= 0; added to the second moment's square root
  double weight_decay = 0;              // >= 0; L2 penalty, or AdamW's decay (below)
  bool decoupled_weight_decay = false;  // decay the weights (AdamW's way), not the gradient
  bool maximize = false;                // ascend instead of descend
  // Calls f(name, field) for every field, named as torch's constructor argument.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("beta1", beta1), f("beta2", beta2), f("eps", eps);
    f("weight_decay", weight_decay), f("decoupled_weight_decay", decoupled_weight_decay);
    f("maximize", maximize);
  }
  // Calls fail(parts...) with torch's message for the first value its constructor refuses.
  template <typename Fail>
  void check(Fail&& fail) const {
    check_adam_family(fail, lr, eps, beta1, beta2, weight_decay);
  }
};

struct RAdam {
  using Options = RAdamOptions;                  // its hyper-parameters
  static constexpr const char* kName = "RAdam";  // the torch.optim class
  static constexpr const char* kKind = "radam";  // its name in lower case (RPC, messages)
  static constexpr const char* kOptionsName = "RAdamOptions";  // the Python options class
  static constexpr int kStates = 2;                            // state tensors per parameter
  // torch's state names, in the order element() takes them; a fresh state is zeros.
  static constexpr const char* kStateNames[kStates] = {"exp_avg", "exp_avg_sq"};
  static double initial_state(int /*k*/, const Options& /*o*/) { return 0.0; }

  // The step's scalars as torch's Python code computes them in double (the bias corrections,
  // the rectification term and whether it applies: a property of the step count alone), then
  // rounded to the element type; flags as 0/1 of it.
  template <typename T>
  struct Coeffs {
    T lr, bias_correction1, sqrt_bias_correction2, rect, eps, beta1, one_minus_beta1;  // coeffs()
    T lerp_small, beta2, one_minus_beta2, decay;                                       // coeffs()
    T rectify, has_decay, lerp;                                                        // flags
    Prologue<T> l2;  // maximize and the L2 decay (off with the decoupled decay)
  };
  // step: this update's count (torch's state["step"] after its increment); torch_version:
  // torch's major * 100 + minor, from 200 on torch 2.x's
  // formulas (exp_avg.lerp_, `x ** 0.5`), else 1.13's (exp_avg.mul_(beta1).add_(grad,
  // alpha=1 - beta1), math.sqrt; 1.13 has no maximize and no decoupled decay, so those stay
  // off there).
  template <typename T>
  static Coeffs<T> coeffs(const Options& o, int64_t step, int torch_version) {
    const bool torch2 = torch_version >= 200;
    const double n = static_cast<double>(step);
    const double bc1 = 1.0 - std::pow(o.beta1, n);
    const double bc2 = 1.0 - std::pow(o.beta2, n);
    // The length of the approximated simple moving average, its maximum, and the rectification
    // term where it is defined (rho_t > 5): the same operations in the same order as torch's,
    // so the same doubles.
    const double rho_inf = 2.0 / (1.0 - o.beta2) - 1.0;
    const double rho_t = rho_inf - 2.0 * n * std::pow(o.beta2, n) / bc2;
    const bool rectify = rho_t > 5.0;
    double rect = 0.0;
    if (rectify) {
      const double r =
          (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t);
      rect = torch2 ? std::pow(r, 0.5) : std::sqrt(r);
    }
    Coeffs<T> c;
    c.lr = static_cast<T>(o.lr);
    c.bias_correction1 = static_cast<T>(bc1);
    c.sqrt_bias_correction2 = static_cast<T>(torch2 ? std::pow(bc2, 0.5) : std::sqrt(bc2));
    c.rect = static_cast<T>(rect);
    c.eps = static_cast<T>(o.eps);
    c.beta1 = static_cast<T>(o.beta1);
    c.one_minus_beta1 = static_cast<T>(1.0 - o.beta1);
    c.lerp_small = lerp_small_flag(c.one_minus_beta1);
    c.beta2 = static_cast<T>(o.beta2);
    c.one_minus_beta2 = static_cast<T>(1.0 - o.beta2);
    c.decay = static_cast<T>(1.0 - o.lr * o.weight_decay);
    const bool decoupled = torch2 && o.decoupled_weight_decay;
    c.rectify = rectify ? T(1) : T(0);
    c.has_decay = o.weight_decay != 0 && decoupled ? T(1) : T(0);
    c.l2 = prologue<T>(o.weight_decay, o.weight_decay != 0 && !decoupled, torch2 && o.maximize);
    c.lerp = torch2 ? T(1) : T(0);
    return c;
  }

  // torch.optim.radam._single_tensor_radam; s = {exp_avg, exp_avg_sq}.
  template <typename T>
  DDPX_OPTIM_INLINE static void element(T& p, T g, T* s, const Coeffs<T>& c) {
    g = l2_grad(p, g, c.l2);
    p = select(c.has_decay, mul_rn(p, c.decay), p);  // param.mul_(1 - lr * wd)
    T& m = s[0];
    T& v = s[1];
    m = select(c.lerp, lerp(m, g, c.one_minus_beta1, c.lerp_small),
               fmadd(g, c.one_minus_beta1, mul_rn(m, c.beta1)));
    v = fmadd(c.one_minus_beta2 * g, g, mul_rn(v, c.beta2));  // mul_(b2).addcmul_(g, g, 1 - b2)
    // bias_corrected_exp_avg * lr, each product rounded (tensor ops, left to right).
    const T scaled = mul_rn(m / c.bias_correction1, c.lr);
    // sqrt(bc2) / (exp_avg_sq.sqrt() + eps) is Tensor.__rtruediv__: reciprocal() * scalar.
    const T adaptive = mul_rn(T(1) / (sqrt_rn(v) + c.eps), c.sqrt_bias_correction2);
    const T rectified = mul_rn(mul_rn(scaled, adaptive), c.rect);
    p = p - select(c.rectify, rectified, scaled);  // param.add_(update, alpha=-1.0)
  }
};

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
