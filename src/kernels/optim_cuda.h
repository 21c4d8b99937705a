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

}  // namespace kernels
}  // namespace ddpx
