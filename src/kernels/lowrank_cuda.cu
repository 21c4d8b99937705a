// PowerSGD's error-feedback application on CUDA (the products themselves run as cuBLAS batched
// GEMMs through at::bmm in the ATen layer).
#include "cuda_check.h"
#include "lowrank_cuda.h"

namespace ddpx {
namespace kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void ef_apply_kernel(T* __restrict__ in, T* __restrict__ err, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const T v = err[i] + in[i];
    err[i] = v;
    in[i] = v;
  }
}

template <typename T>
void launch_ef(T* in, T* err, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 4096 ? blocks : 4096);
  ef_apply_kernel<T><<<grid, kThreads, 0, stream>>>(in, err, n);
  DDPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void error_feedback_apply_cuda(float* in, float* err, int64_t n, cudaStream_t stream) {
  launch_ef(in, err, n, stream);
}
void error_feedback_apply_cuda(double* in, double* err, int64_t n, cudaStream_t stream) {
  launch_ef(in, err, n, stream);
}

}  // namespace kernels
}  // namespace ddpx
