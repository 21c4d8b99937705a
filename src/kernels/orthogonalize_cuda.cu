// Batched Gram-Schmidt on CUDA: one block per matrix, column by column, block-wide reductions in
// double through shared memory. PowerSGD's matrices are tall and thin (rank 1-32), so one block
// per matrix keeps every reduction on-chip and the whole batch in one launch.
#include <ddpx/compression/orthogonalize_cuda.h>

#include "cuda_check.h"

namespace ddpx {
namespace kernels {
namespace {

constexpr int kThreads = 256;

__device__ double block_sum(double v, double* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? shared[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const double total = shared[0];
  __syncthreads();
  return total;
}

template <typename T>
__global__ void gram_schmidt_kernel(T* data, const int64_t* offsets, const int64_t* rows,
                                    const int64_t* cols, double eps) {
  __shared__ double shared[kThreads / 32];
  T* m = data + offsets[blockIdx.x];
  const int64_t n = rows[blockIdx.x], r = cols[blockIdx.x];
  // Above rank 2, a second pass with epsilon 0 (see orthogonalize.h).
  const int passes = r > 2 ? 2 : 1;
  for (int pass = 0; pass < passes; ++pass, eps = 0.0) {
  for (int64_t i = 0; i < r; ++i) {
    double sq = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sq += double(m[j * r + i]) * m[j * r + i];
    const double norm = sqrt(block_sum(sq, shared));
    const bool zero = norm == 0.0 && eps == 0.0;
    const double denom = norm + eps;
    const T inv = zero ? T(0) : T(1.0 / denom);
    if (isfinite(inv)) {
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m[j * r + i] *= inv;
    } else {
      // A tiny column: 1/norm overflows T (see orthogonalize_cpu.cpp); divide in double.
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m[j * r + i] = T(double(m[j * r + i]) / denom);
    }
    __syncthreads();
    for (int64_t c = i + 1; c < r; ++c) {
      double dot = 0;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += double(m[j * r + i]) * m[j * r + c];
      const T d = T(block_sum(dot, shared));
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m[j * r + c] -= d * m[j * r + i];
    }
    __syncthreads();
  }
  }
}

template <typename T>
__global__ void ef_apply_kernel(T* __restrict__ in, T* __restrict__ err, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T v = err[i] + in[i];
    err[i] = v;
    in[i] = v;
  }
}

template <typename T>
void launch_gs(T* data, const int64_t* offsets, const int64_t* rows, const int64_t* cols,
               int64_t count, double eps, cudaStream_t stream) {
  if (count <= 0) return;
  gram_schmidt_kernel<T><<<static_cast<unsigned>(count), kThreads, 0, stream>>>(data, offsets, rows,
                                                                              cols, eps);
  DDPX_CUDA_CHECK(cudaGetLastError());
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

void orthogonalize_cuda(float* data, const int64_t* offsets, const int64_t* rows,
                        const int64_t* cols, int64_t count, float epsilon, cudaStream_t stream) {
  launch_gs(data, offsets, rows, cols, count, epsilon, stream);
}
void orthogonalize_cuda(double* data, const int64_t* offsets, const int64_t* rows,
                        const int64_t* cols, int64_t count, double epsilon, cudaStream_t stream) {
  launch_gs(data, offsets, rows, cols, count, epsilon, stream);
}
void error_feedback_apply_cuda(float* in, float* err, int64_t n, cudaStream_t stream) {
  launch_ef(in, err, n, stream);
}
void error_feedback_apply_cuda(double* in, double* err, int64_t n, cudaStream_t stream) {
  launch_ef(in, err, n, stream);
}

}  // namespace kernels
}  // namespace ddpx
