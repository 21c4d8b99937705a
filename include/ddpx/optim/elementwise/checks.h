// torch.optim's argument checks that several optimizers share, with torch's messages, for the
// options' check(fail) (see all.h).
#pragma once

namespace ddpx {
namespace optim {
namespace elementwise {

// The checks of torch's Adam family (Adam, Adamax, RAdam, NAdam), in torch's order; calls
// fail(parts...) for the first value refused (`not 0.0 <= x`: NaN too).
template <typename Fail>
void check_adam_family(Fail&& fail, double lr, double eps, double beta1, double beta2,
                       double weight_decay) {
  if (!(0.0 <= lr)) fail("Invalid learning rate: ", lr);
  if (!(0.0 <= eps)) fail("Invalid epsilon value: ", eps);
  if (!(0.0 <= beta1 && beta1 < 1.0)) fail("Invalid beta parameter at index 0: ", beta1);
  if (!(0.0 <= beta2 && beta2 < 1.0)) fail("Invalid beta parameter at index 1: ", beta2);
  if (!(0.0 <= weight_decay)) fail("Invalid weight_decay value: ", weight_decay);
}

}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
