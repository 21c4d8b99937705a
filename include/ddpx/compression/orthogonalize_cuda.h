// CUDA batched Gram-Schmidt: same contract as <ddpx/compression/orthogonalize.h>, one launch for
// all matrices (one thread block per matrix). `offsets`, `rows`, `cols` are DEVICE arrays.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ddpx {
namespace kernels {

void orthogonalize_cuda(float* data, const int64_t* offsets, const int64_t* rows,
                        const int64_t* cols, int64_t count, float epsilon, cudaStream_t stream);
void orthogonalize_cuda(double* data, const int64_t* offsets, const int64_t* rows,
                        const int64_t* cols, int64_t count, double epsilon, cudaStream_t stream);

// err[i] += in[i]; in[i] = err[i]: PowerSGD's error-feedback application and the copy of the
// compensated input, fused in one pass (float or double, selected by the overload).
void error_feedback_apply_cuda(float* in, float* err, int64_t n, cudaStream_t stream);
void error_feedback_apply_cuda(double* in, double* err, int64_t n, cudaStream_t stream);

}  // namespace kernels
}  // namespace ddpx
