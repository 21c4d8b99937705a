// ATen layer over kernels/elementwise_optim.h: one tensor's update by an elementwise optimizer
// (ddpx/optim/elementwise/all.h), split across ATen's intra-op threads on CPU, launched on the
// device's current stream on CUDA.
//
// Callers (optim/functional.cpp) validate user input first; this asserts only what the kernels
// need (same device, dtype and element count; contiguous; float32/float64).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ddpx {
namespace ops {

// One update of `param` and `states` (Traits::kStates tensors, in Traits::kStateNames' order;
// undefined where the options do not keep that state) in place with `grad`, for step number `step`
// (torch's state["step"] after its increment).
template <typename Traits>
void elementwise_update(const at::Tensor& param, const at::Tensor& grad,
                        const std::vector<at::Tensor>& states, const typename Traits::Options& o,
                        int64_t step);

}  // namespace ops
}  // namespace ddpx
