// CUDA batched Gram-Schmidt: same contract as kernels/orthogonalize.h, one launch for
// all matrices (one thread block per matrix). `offsets`, `rows`, `cols` are DEVICE arrays.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ddpx {
namespace kernels {

void orthogonalize_cuda(float* data, const int64_t* offsets, const int64_t* rows,
                        const int64_t* cols, int64_t count, float epsilon, cudaStream_t stream);
void orthogonalize_cuda(double* data, const int64_t* offsets, const int64_t* rows,
                        const int64_t* cols, int64_t count, double epsilon, cudaStream_t stream);

}  // namespace kernels
}  // namespace ddpx
