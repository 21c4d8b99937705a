// CUDA variants of <lowrank.h>'s kernels: same semantics, device pointers, launched
// asynchronously on `stream` (pass the caller's current stream). Launch errors are raised as
// std::runtime_error. PowerSGD's products run as batched GEMMs (at::bmm) on CUDA, so only the
// error-feedback application has a kernel of its own here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ddpx {
namespace kernels {

// err[i] += in[i]; in[i] = err[i]: PowerSGD's error-feedback application and the copy of the
// compensated input, fused in one pass (float or double, selected by the overload).
void error_feedback_apply_cuda(float* in, float* err, int64_t n, cudaStream_t stream);
void error_feedback_apply_cuda(double* in, double* err, int64_t n, cudaStream_t stream);

}  // namespace kernels
}  // namespace ddpx
