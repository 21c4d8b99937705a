// torch.optim.RMSprop as an elementwise optimizer: its options and its element update (see
// all.h). Its momentum buffer and grad_avg are optional states: kept only with momentum > 0 and
// with centered, as torch keeps them.
#pragma once

#include <cstdint>

#include "math.h"

namespace ddpx {
namespace optim {
namespace elementwise {

struct RMSprop;

// torch.optim.RMSprop's hyper-parameters.
struct RMSpropOptions {
  using Traits = RMSprop;   // the element update these options are for
  double lr = 1e-2;         // >= 0
  double alpha = 0.99;      // >= 0; smoothing constant of square_avg (and grad_avg)
  double eps = 1e-8;        // >= 0; added to the root of the (centered) mean square
  double weight_decay = 0;  // >= 0; L2 penalty added to the gradient
  double momentum = 0;      // >= 0; > 0: keep a momentum buffer
  bool centered = false;    // normalise by the variance estimate (keeps grad_avg)
  bool maximize = false;    // ascend instead of descend
  // Calls f(name, field) for every field, named as torch's constructor argument.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("alpha", alpha), f("eps", eps), f("weight_decay", weight_decay);
    f("momentum", momentum), f("centered", centered), f("maximize", maximize);
  }
  // Calls fail(parts...) with torch's message for the first value its constructor refuses, in
  // its order (NaN refused too).
  template <typename Fail>
  void check(Fail&& fail) const {
    if (!(0.0 <= lr)) fail("Invalid learning rate: ", lr);
    if (!(0.0 <= eps)) fail("Invalid epsilon value: ", eps);
    if (!(0.0 <= momentum)) fail("Invalid momentum value: ", momentum);
    if (!(0.0 <= weight_decay)) fail("Invalid weight_decay value: ", weight_decay);
    if (!(0.0 <= alpha)) fail("Invalid alpha value: ", alpha);
  }
};

struct RMSprop {
  using Options = RMSpropOptions;                  // its hyper-parameters
  static constexpr const char* kName = "RMSprop";  // the torch.optim class
  static constexpr const char* kKind = "rmsprop";  // its name in lower case (RPC, messages)
  static constexpr const char* kOptionsName = "RMSpropOptions";  // the Python options class
  static constexpr int kStates = 3;                              // state tensors per parameter
  // torch's state names, in the order element() takes them; a fresh state is zeros.
  static constexpr const char* kStateNames[kStates] = {"square_avg", "momentum_buffer", "grad_avg"};
  // momentum_buffer (bit 1) and grad_avg (bit 2) are kept only when has_state says so.
  static constexpr unsigned kOptionalStates = 0b110;
  static bool has_state(int k, const Options& o) { return k == 1 ? o.momentum > 0 : o.centered; }
  static double initial_state(int /*k*/, const Options& /*o*/) { return 0.0; }

  // The options rounded to the element type; flags as 0/1 of it (elementwise::select).
  template <typename T>
  struct Coeffs {
    T neg_lr, alpha, one_minus_alpha, eps, momentum, lerp_small;  // coeffs()
    T has_momentum, centered, lerp;                               // flags
    Prologue<T> l2;                                               // maximize and the L2 decay
  };
  // torch_version >= 201: grad_avg.lerp_(grad, 1 - alpha) (pytorch#104796); before, 1.13's and
  // 2.0's grad_avg.mul_(alpha).add_(grad, alpha=1 - alpha). The step count is not used.
  template <typename T>
  static Coeffs<T> coeffs(const Options& o, int64_t /*step*/, int torch_version) {
    Coeffs<T> c;
    c.neg_lr = static_cast<T>(-o.lr);
    c.alpha = static_cast<T>(o.alpha);
    c.one_minus_alpha = static_cast<T>(1.0 - o.alpha);
    c.eps = static_cast<T>(o.eps);
    c.l2 = prologue<T>(o.weight_decay, o.weight_decay != 0, o.maximize);
    c.momentum = static_cast<T>(o.momentum);
    c.lerp_small = lerp_small_flag(c.one_minus_alpha);
    c.has_momentum = o.momentum > 0 ? T(1) : T(0);
    c.centered = o.centered ? T(1) : T(0);
    c.lerp = torch_version >= 201 ? T(1) : T(0);
    return c;
  }

  // torch.optim.rmsprop._single_tensor_rmsprop; s = {square_avg, momentum_buffer, grad_avg}, the
  // last two zero and ignored when not kept.
  template <typename T>
  DDPX_OPTIM_INLINE static void element(T& p, T g, T* s, const Coeffs<T>& c) {
    g = l2_grad(p, g, c.l2);
    T& sq = s[0];
    T& buf = s[1];
    T& ga = s[2];
    // square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
    // (A product passed to fmadd is rounded on its own: no contraction reaches it.)
    sq = fmadd(c.one_minus_alpha * g, g, sq * c.alpha);
    const T ga_next = select(c.lerp, lerp(ga, g, c.one_minus_alpha, c.lerp_small),
                             fmadd(g, c.one_minus_alpha, ga * c.alpha));
    ga = select(c.centered, ga_next, ga);
    // centered: square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_(); else square_avg.sqrt()
    const T var = fmadd(-ga_next, ga_next, sq);
    const T avg = sqrt_rn(select(c.centered, var, sq)) + c.eps;  // avg.add_(eps)
    // momentum > 0: buf.mul_(momentum).addcdiv_(grad, avg); param.add_(buf, alpha=-lr)
    const T buf_next = mul_rn(buf, c.momentum) + g / avg;
    buf = select(c.has_momentum, buf_next, buf);
    const T p_momentum = fmadd(buf_next, c.neg_lr, p);
    const T p_plain = p + (c.neg_lr * g) / avg;  // param.addcdiv_(grad, avg, value=-lr)
    p = select(c.has_momentum, p_momentum, p_plain);
  }
};

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
