#include "ops/elementwise_optim.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "common/compat_internal.h"
#include "ops/cuda_launch.h"

#ifdef DDPX_WITH_CUDA
#define DDPX_ELEMENTWISE_CUDA_API 1
#endif
#include "kernels/elementwise_optim.h"

namespace ddpx {
namespace ops {
namespace {

// Elements per task: ATen's own grain, so small tensors run on the calling thread.
constexpr int64_t kElementwiseGrain = 32768;

template <typename Traits, typename T>
void update_as(const at::Tensor& param, const at::Tensor& grad,
               const std::vector<at::Tensor>& states, const typename Traits::Options& o,
               int64_t step) {
  kernels::ElementwiseTensor<Traits, T> t;
  t.param = param.data_ptr<T>();
  t.grad = grad.data_ptr<T>();
  for (int k = 0; k < Traits::kStates; ++k) {
    t.state[k] = states[k].defined() ? states[k].data_ptr<T>() : nullptr;
  }
  t.n = param.numel();
  // The formulas of the torch ddpx is built against, where torch.optim changed them.
  const auto c = Traits::template coeffs<T>(o, step, compat::kTorchVersion);
  run_elementwise(
      param, t.n, kElementwiseGrain,
      [&](auto stream) {
#ifdef DDPX_WITH_CUDA
        kernels::elementwise_cuda(t, c, stream);
#endif
        (void)stream;
      },
      [&](int64_t begin, int64_t end) { kernels::elementwise_cpu(t, c, begin, end); });
}

}  // namespace

template <typename Traits>
void elementwise_update(const at::Tensor& param, const at::Tensor& grad,
                        const std::vector<at::Tensor>& states, const typename Traits::Options& o,
                        int64_t step) {
  TORCH_INTERNAL_ASSERT(states.size() == static_cast<size_t>(Traits::kStates));
  auto like = [&](const at::Tensor& t) {
    TORCH_INTERNAL_ASSERT(t.defined() && t.device() == param.device() &&
                              t.scalar_type() == param.scalar_type() &&
                              t.numel() == param.numel() && t.is_contiguous(),
                          Traits::kKind, ": tensors must match the parameter and be contiguous");
  };
  like(param);
  like(grad);
  for (int k = 0; k < Traits::kStates; ++k) {
    TORCH_INTERNAL_ASSERT(states[k].defined() == optim::elementwise::keeps_state<Traits>(k, o),
                          Traits::kKind, ": state ", Traits::kStateNames[k],
                          " must be given exactly when the options keep it");
    if (states[k].defined()) like(states[k]);
  }
  switch (param.scalar_type()) {
    case at::kFloat:
      return update_as<Traits, float>(param, grad, states, o, step);
    case at::kDouble:
      return update_as<Traits, double>(param, grad, states, o, step);
    default:
      TORCH_INTERNAL_ASSERT(false, Traits::kKind, ": float32 and float64 only");
  }
}

#define DDPX_INSTANTIATE(Name)                                              \
  template void elementwise_update<optim::elementwise::Name>(               \
      const at::Tensor&, const at::Tensor&, const std::vector<at::Tensor>&, \
      const optim::elementwise::Name::Options&, int64_t);
DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_INSTANTIATE)
#undef DDPX_INSTANTIATE

}  // namespace ops
}  // namespace ddpx
