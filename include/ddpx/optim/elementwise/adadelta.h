// torch.optim.Adadelta as an elementwise optimizer: its options and its element update (see
// all.h).
#pragma once

#include <cstdint>

#include "math.h"

namespace ddpx {
namespace optim {
namespace elementwise {

struct Adadelta;

// torch.optim.Adadelta's hyper-parameters.
struct AdadeltaOptions {
  using Traits = Adadelta;  // the element update these options are for
  double lr = 1.0;          // >= 0; scales the delta
  double rho = 0.9;         // in [0, 1]; smoothing constant of both running averages
  double eps = 1e-6;        // >= 0; added inside both square roots
  double weight_decay = 0;  // >= 0; L2 penalty added to the gradient
  bool maximize = false;    // ascend instead of descend
  // Calls f(name, field) for every field, named as torch's constructor argument.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("rho", rho), f("eps", eps), f("weight_decay", weight_decay);
    f("maximize", maximize);
  }
  // Calls fail(parts...) with torch's message for the first value its constructor refuses.
  template <typename Fail>
  void check(Fail&& fail) const {
    if (!(0.0 <= lr)) fail("Invalid learning rate: ", lr);
    if (!(0.0 <= rho && rho <= 1.0)) fail("Invalid rho value: ", rho);
    if (!(0.0 <= eps)) fail("Invalid epsilon value: ", eps);
    if (!(0.0 <= weight_decay)) fail("Invalid weight_decay value: ", weight_decay);
  }
};

struct Adadelta {
  using Options = AdadeltaOptions;                  // its hyper-parameters
  static constexpr const char* kName = "Adadelta";  // the torch.optim class
  static constexpr const char* kKind = "adadelta";  // its name in lower case (RPC, messages)
  static constexpr const char* kOptionsName = "AdadeltaOptions";  // the Python options class
  static constexpr int kStates = 2;                               // state tensors per parameter
  // torch's state names, in the order element() takes them; a fresh state is zeros.
  static constexpr const char* kStateNames[kStates] = {"square_avg", "acc_delta"};
  static double initial_state(int /*k*/, const Options& /*o*/) { return 0.0; }

  // The options rounded to the element type; flags as 0/1 of it (elementwise::select).
  template <typename T>
  struct Coeffs {
    T neg_lr, rho, one_minus_rho, eps;  // see coeffs()
    Prologue<T> l2;                     // maximize and the L2 decay
  };
  // The same formulas in torch 1.13 and 2.x; the step count is not used.
  template <typename T>
  static Coeffs<T> coeffs(const Options& o, int64_t /*step*/, int /*torch_version*/) {
    Coeffs<T> c;
    c.neg_lr = static_cast<T>(-o.lr);
    c.rho = static_cast<T>(o.rho);
    c.one_minus_rho = static_cast<T>(1.0 - o.rho);
    c.eps = static_cast<T>(o.eps);
    c.l2 = prologue<T>(o.weight_decay, o.weight_decay != 0, o.maximize);
    return c;
  }

  // torch.optim.adadelta._single_tensor_adadelta; s = {square_avg, acc_delta}.
  template <typename T>
  DDPX_OPTIM_INLINE static void element(T& p, T g, T* s, const Coeffs<T>& c) {
    g = l2_grad(p, g, c.l2);
    T& sq = s[0];
    T& acc = s[1];
    sq = fmadd(c.one_minus_rho * g, g, mul_rn(sq, c.rho));  // mul_(rho).addcmul_(g, g, 1 - rho)
    const T std = sqrt_rn(sq + c.eps);                      // square_avg.add(eps).sqrt_()
    const T delta = mul_rn(sqrt_rn(acc + c.eps) / std, g);  // acc_delta.add(eps).sqrt_()
                                                            //   .div_(std).mul_(grad)
    acc = fmadd(c.one_minus_rho * delta, delta, mul_rn(acc, c.rho));
    p = fmadd(delta, c.neg_lr, p);  // param.add_(delta, alpha=-lr)
  }
};

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
