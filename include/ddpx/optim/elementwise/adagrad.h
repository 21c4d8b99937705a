// torch.optim.Adagrad as an elementwise optimizer: its options and its element update (see
// all.h). Dense gradients only; torch's sparse Adagrad stays torch's.
#pragma once

#include <cstdint>

#include "math.h"

namespace ddpx {
namespace optim {
namespace elementwise {

struct Adagrad;

// torch.optim.Adagrad's hyper-parameters.
struct AdagradOptions {
  using Traits = Adagrad;                // the element update these options are for
  double lr = 1e-2;                      // >= 0
  double lr_decay = 0;                   // >= 0; step t uses lr / (1 + (t - 1) * lr_decay)
  double weight_decay = 0;               // >= 0; L2 penalty added to the gradient
  double initial_accumulator_value = 0;  // >= 0; what each element of "sum" starts from
  double eps = 1e-10;                    // >= 0; added to sqrt(sum)
  bool maximize = false;                 // ascend instead of descend
  // Calls f(name, field) for every field, named as torch's constructor argument.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("lr_decay", lr_decay), f("weight_decay", weight_decay);
    f("initial_accumulator_value", initial_accumulator_value), f("eps", eps);
    f("maximize", maximize);
  }
  // Calls fail(parts...) with torch's message for the first value its constructor refuses, in
  // its order (`not 0.0 <= x`: NaN too).
  template <typename Fail>
  void check(Fail&& fail) const {
    if (!(0.0 <= lr)) fail("Invalid learning rate: ", lr);
    if (!(0.0 <= lr_decay)) fail("Invalid lr_decay value: ", lr_decay);
    if (!(0.0 <= weight_decay)) fail("Invalid weight_decay value: ", weight_decay);
    if (!(0.0 <= initial_accumulator_value)) {
      fail("Invalid initial_accumulator_value value: ", initial_accumulator_value);
    }
    if (!(0.0 <= eps)) fail("Invalid epsilon value: ", eps);
  }
};

struct Adagrad {
  using Options = AdagradOptions;                  // its hyper-parameters
  static constexpr const char* kName = "Adagrad";  // the torch.optim class
  static constexpr const char* kKind = "adagrad";  // its name in lower case (RPC, messages)
  static constexpr const char* kOptionsName = "AdagradOptions";  // the Python options class
  static constexpr int kStates = 1;                              // state tensors per parameter
  // torch's state name: the running sum of squared gradients.
  static constexpr const char* kStateNames[kStates] = {"sum"};
  // torch.optim.Adagrad makes every parameter's state in its constructor: step 0 and a sum
  // filled with initial_accumulator_value.
  static constexpr bool kStateFromConstructor = true;
  static double initial_state(int /*k*/, const Options& o) { return o.initial_accumulator_value; }

  // The options rounded to the element type, with the step's decayed learning rate as torch's
  // Python code computes it; flags as 0/1 of the element type (elementwise::select).
  template <typename T>
  struct Coeffs {
    T neg_clr, eps;  // see coeffs()
    Prologue<T> l2;  // maximize and the L2 decay
  };
  // The same formulas in torch 1.13 and 2.x. torch keeps the step in a float32 tensor and
  // decays the rate in Python floats: clr = lr / (1 + (float(step) - 1) * lr_decay).
  template <typename T>
  static Coeffs<T> coeffs(const Options& o, int64_t step, int /*torch_version*/) {
    const double t = static_cast<double>(static_cast<float>(step));
    Coeffs<T> c;
    c.neg_clr = static_cast<T>(-(o.lr / (1 + (t - 1) * o.lr_decay)));
    c.l2 = prologue<T>(o.weight_decay, o.weight_decay != 0, o.maximize);
    c.eps = static_cast<T>(o.eps);
    return c;
  }

  // torch.optim.adagrad._single_tensor_adagrad, dense gradient; s = {sum}.
  template <typename T>
  DDPX_OPTIM_INLINE static void element(T& p, T g, T* s, const Coeffs<T>& c) {
    g = l2_grad(p, g, c.l2);
    T& sum = s[0];
    sum = fmadd(g, g, sum);              // state_sum.addcmul_(grad, grad, value=1)
    const T std = sqrt_rn(sum) + c.eps;  // state_sum.sqrt().add_(eps)
    p = p + (c.neg_clr * g) / std;       // param.addcdiv_(grad, std, value=-clr)
  }
};

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
