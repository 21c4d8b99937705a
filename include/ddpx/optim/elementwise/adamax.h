// torch.optim.Adamax as an elementwise optimizer: its options and its element update, which
// src/optim/functional.cpp, the CPU loops and the CUDA kernels run (see all.h).
#pragma once

#include <cstdint>

#include "checks.h"
#include "math.h"

namespace ddpx {
namespace optim {
namespace elementwise {

struct Adamax;

// torch.optim.Adamax's hyper-parameters (torch's betas as beta1 and beta2).
struct AdamaxOptions {
  using Traits = Adamax;    // the element update these options are for
  double lr = 2e-3;         // >= 0
  double beta1 = 0.9;       // in [0, 1)
  double beta2 = 0.999;     // in [0, 1)
  double eps = 1e-8;        // >= 0; added to |grad| before the running maximum
  double weight_decay = 0;  // >= 0; L2 penalty added to the gradient
  bool maximize = false;    // ascend instead of descend
  // Calls f(name, field) for every field, named as torch's constructor argument.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("beta1", beta1), f("beta2", beta2), f("eps", eps);
    f("weight_decay", weight_decay), f("maximize", maximize);
  }
  // Calls fail(parts...) with torch's message for the first value its constructor refuses.
  template <typename Fail>
  void check(Fail&& fail) const {
    check_adam_family(fail, lr, eps, beta1, beta2, weight_decay);
  }
};

struct Adamax {
  using Options = AdamaxOptions;                  // its hyper-parameters
  static constexpr const char* kName = "Adamax";  // the torch.optim class
  static constexpr const char* kKind = "adamax";  // its name in lower case (RPC, messages)
  static constexpr const char* kOptionsName = "AdamaxOptions";  // the Python options class
  static constexpr int kStates = 2;                             // state tensors per parameter
  // torch's state names, in the order element() takes them; a fresh state is zeros.
  static constexpr const char* kStateNames[kStates] = {"exp_avg", "exp_inf"};
  static double initial_state(int /*k*/, const Options& /*o*/) { return 0.0; }

  // Options rounded to the element type, with the step's learning rate as torch's Python code
  // computes it in double: clr = lr / (1 - beta1 ** step).
  template <typename T>
  struct Coeffs {
    T neg_clr, beta1, one_minus_beta1, lerp_small, beta2, eps;  // see coeffs()
    T lerp;                                                     // a flag as 0/1 of the type
    Prologue<T> l2;                                             // maximize and the L2 decay
  };
  // step: this update's count (torch's state["step"] after its increment); torch_version:
  // torch's major * 100 + minor, from 200 on torch 2.x's
  // formulas (exp_avg.lerp_), else 1.13's (exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)).
  template <typename T>
  static Coeffs<T> coeffs(const Options& o, int64_t step, int torch_version) {
    const bool torch2 = torch_version >= 200;
    Coeffs<T> c;
    c.neg_clr = static_cast<T>(-(o.lr / (1.0 - pow(o.beta1, static_cast<double>(step)))));
    c.beta1 = static_cast<T>(o.beta1);
    c.one_minus_beta1 = static_cast<T>(1.0 - o.beta1);
    c.lerp_small = lerp_small_flag(c.one_minus_beta1);
    c.beta2 = static_cast<T>(o.beta2);
    c.eps = static_cast<T>(o.eps);
    c.l2 = prologue<T>(o.weight_decay, o.weight_decay != 0, o.maximize);
    c.lerp = torch2 ? T(1) : T(0);
    return c;
  }

  // torch.optim.adamax._single_tensor_adamax; s = {exp_avg, exp_inf}.
  template <typename T>
  DDPX_OPTIM_INLINE static void element(T& p, T g, T* s, const Coeffs<T>& c) {
    g = l2_grad(p, g, c.l2);
    T& m = s[0];
    T& inf = s[1];
    m = select(c.lerp, lerp(m, g, c.one_minus_beta1, c.lerp_small),
               fmadd(g, c.one_minus_beta1, mul_rn(m, c.beta1)));
    // torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps)): NaN wins.
    const T g_abs = g < T(0) ? -g : g;
    inf = maximum(mul_rn(inf, c.beta2), g_abs + c.eps);
    p = p + (c.neg_clr * m) / inf;  // param.addcdiv_(exp_avg, exp_inf, value=-clr)
  }
};

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
