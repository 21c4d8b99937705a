// CUDA variants of the kernels in optim.h: same element updates (optim_inl.h), whole tensors of
// device pointers, launched asynchronously on `stream` (pass the caller's current stream).
// Errors in the launch are raised as std::runtime_error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "optim.h"

namespace ddpx {
namespace kernels {

// Updates all t.n elements of `t`; float32 and float64 only (std::invalid_argument otherwise).
void sgd_cuda(const SgdTensor& t, DType dtype, const SgdScalars& s, cudaStream_t stream);
void adam_cuda(const AdamTensor& t, DType dtype, const AdamScalars& s, cudaStream_t stream);

// Many tensors, each with its own scalars (an SGD buffer's first step, an Adam step's bias
// corrections), in as few launches as possible: kMultiTensors (multi_tensor.h) per launch instead
// of one launch per tensor. The same element updates, so the same results bit for bit. Every
// tensor is checked before anything is launched (std::invalid_argument).
void sgd_cuda_multi(const SgdTensor* t, const SgdScalars* s, int64_t count, DType dtype,
                    cudaStream_t stream);
void adam_cuda_multi(const AdamTensor* t, const AdamScalars* s, int64_t count, DType dtype,
                     cudaStream_t stream);

}  // namespace kernels
}  // namespace ddpx
