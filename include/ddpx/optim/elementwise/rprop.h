// torch.optim.Rprop as an elementwise optimizer: its options and its element update (see all.h).
#pragma once

#include <cstdint>

#include "math.h"

namespace ddpx {
namespace optim {
namespace elementwise {

struct Rprop;

// torch.optim.Rprop's hyper-parameters (torch's etas and step_sizes pairs as two fields each).
struct RpropOptions {
  using Traits = Rprop;         // the element update these options are for
  double lr = 1e-2;             // >= 0; every element's first step size
  double etaminus = 0.5;        // 0 < etaminus < 1 < etaplus
  double etaplus = 1.2;         // step size factors on a sign change / no change
  double step_size_min = 1e-6;  // the step sizes are clamped to [min, max]
  double step_size_max = 50;    // (torch's step_sizes pair)
  bool maximize = false;        // ascend instead of descend
  // Calls f(name, field) for every field, named as torch's constructor argument.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("etaminus", etaminus), f("etaplus", etaplus);
    f("step_size_min", step_size_min), f("step_size_max", step_size_max);
    f("maximize", maximize);
  }
  // Calls fail(parts...) with torch's message for the first value its constructor refuses.
  template <typename Fail>
  void check(Fail&& fail) const {
    if (!(0.0 <= lr)) fail("Invalid learning rate: ", lr);
    if (!(0.0 < etaminus && etaminus < 1.0 && 1.0 < etaplus)) {
      fail("Invalid eta values: ", etaminus, ", ", etaplus);
    }
  }
};

struct Rprop {
  using Options = RpropOptions;                  // its hyper-parameters
  static constexpr const char* kName = "Rprop";  // the torch.optim class
  static constexpr const char* kKind = "rprop";  // its name in lower case (RPC, messages)
  static constexpr const char* kOptionsName = "RpropOptions";  // the Python options class
  static constexpr int kStates = 2;                            // state tensors per parameter
  // prev starts at zero, step_size at lr (torch's full_like(grad, lr)).
  static constexpr const char* kStateNames[kStates] = {"prev", "step_size"};
  static double initial_state(int k, const Options& o) { return k == 1 ? o.lr : 0.0; }

  // The options rounded to the element type; maximize as 0/1 of it (elementwise::select).
  template <typename T>
  struct Coeffs {
    T etaminus, etaplus, step_size_min, step_size_max, maximize;  // see coeffs()
  };
  // The same formulas in torch 1.13 and 2.x; the step count is not used.
  template <typename T>
  static Coeffs<T> coeffs(const Options& o, int64_t /*step*/, int /*torch_version*/) {
    Coeffs<T> c;
    c.etaminus = static_cast<T>(o.etaminus);
    c.etaplus = static_cast<T>(o.etaplus);
    c.step_size_min = static_cast<T>(o.step_size_min);
    c.step_size_max = static_cast<T>(o.step_size_max);
    c.maximize = o.maximize ? T(1) : T(0);
    return c;
  }

  // torch.sign as ATen computes it: (0 < x) - (x < 0), so NaN gives 0.
  template <typename T>
  DDPX_OPTIM_INLINE static T sign(T x) {
    return static_cast<T>(T(0) < x) - static_cast<T>(x < T(0));
  }

  // torch.optim.rprop._single_tensor_rprop; s = {prev, step_size}.
  template <typename T>
  DDPX_OPTIM_INLINE static void element(T& p, T g, T* s, const Coeffs<T>& c) {
    g = select(c.maximize, -g, g);
    T& prev = s[0];
    T& step_size = s[1];
    // sign = grad.mul(prev).sign(), then > 0 -> etaplus, < 0 -> etaminus, == 0 -> 1.
    const T sg = sign(mul_rn(g, prev));
    const T factor = sg > T(0) ? c.etaplus : (sg < T(0) ? c.etaminus : T(1));
    // step_size.mul_(sign).clamp_(min, max); clamp keeps NaN.
    const T scaled = mul_rn(step_size, factor);
    step_size = scaled < c.step_size_min ? c.step_size_min
                                         : (scaled > c.step_size_max ? c.step_size_max : scaled);
    g = factor == c.etaminus ? T(0) : g;  // grad[sign.eq(etaminus)] = 0
    p = fmadd(-sign(g), step_size, p);    // param.addcmul_(grad.sign(), step_size, value=-1)
    prev = g;
  }
};

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
