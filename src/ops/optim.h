// ATen layer over kernels/optim{,_cuda}.h: one tensor's fused optimizer update, split across
// ATen's intra-op threads on CPU, launched on the device's current stream on CUDA.
//
// Callers (optim/functional.cpp) validate user input first; these functions assert only what
// the kernels need (same device, dtype and element count; contiguous; float32/float64).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels/optim.h"

namespace ddpx {
namespace ops {

// One SGD update of `param` in place; `buf` (the momentum buffer) may be undefined when
// s.momentum == 0, and is only written when s.init_buffer.
void sgd_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& buf,
                const kernels::SgdScalars& s);

// One Adam/AdamW update of `param`, `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad;
// undefined otherwise) in place.
void adam_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                 const kernels::AdamScalars& s);

// Many updates, each with its own scalars (s[i] for params[i]; bufs / max_exp_avg_sqs entries
// may be undefined where unused): on CUDA (every tensor on params[0]'s device) in multi-tensor
// launches, on CPU one tensor after another. The same results as one call per tensor.
void sgd_update_multi(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& bufs,
                      const std::vector<kernels::SgdScalars>& s);
void adam_update_multi(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs,
                       const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& max_exp_avg_sqs,
                       const std::vector<kernels::AdamScalars>& s);

}  // namespace ops
}  // namespace ddpx
