// Batched Gram-Schmidt on CUDA: one block per matrix, column by column, block-wide reductions in
// double through shared memory (a step's dot products reduced together, 16 at a time).
// PowerSGD's matrices are tall and thin (rank 1-32), so one block per matrix keeps every
// reduction on-chip and the whole batch in one launch.
#include "cuda_check.h"
#include "orthogonalize_cuda.h"

namespace ddpx {
namespace kernels {
namespace {

constexpr int kThreads = 256;

// Columns whose dot products with column i are reduced together (registers per thread: one
// double each).
constexpr int kDotChunk = 16;

// Block-wide sums of part[0..k) (k <= kDotChunk, the same k on every thread), each reduced the
// same way: warp shuffles, then the warps' sums through shared memory in warp order and one more
// warp shuffle. Every thread of the block must call it; the totals land in tot[0..k), valid
// until the next call.
__device__ void block_sums(double (&part)[kDotChunk], int k, double* red, double* tot) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int t = 0; t < kDotChunk; ++t) {
    if (t < k) {  // k is the same on every thread: the shuffles stay convergent
      double v = part[t];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
      if (lane == 0) red[t * (kThreads / 32) + warp] = v;
    }
  }
  __syncthreads();
  if (warp == 0) {
    for (int t = 0; t < k; ++t) {
      double v = lane < warps ? red[t * (kThreads / 32) + lane] : 0.0;
      for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
      if (lane == 0) tot[t] = v;
    }
  }
  __syncthreads();
}

template <typename T>
__global__ void gram_schmidt_kernel(T* data, const int64_t* offsets, const int64_t* rows,
                                    const int64_t* cols, double eps) {
  __shared__ double red[kDotChunk * (kThreads / 32)];
  __shared__ double tot[kDotChunk];
  T* m = data + offsets[blockIdx.x];
  const int64_t n = rows[blockIdx.x], r = cols[blockIdx.x];
  // Above rank 2, a second pass with epsilon 0 (see orthogonalize.h).
  const int passes = r > 2 ? 2 : 1;
  for (int pass = 0; pass < passes; ++pass, eps = 0.0) {
    for (int64_t i = 0; i < r; ++i) {
      double sq[kDotChunk] = {0.0};
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        sq[0] += double(m[j * r + i]) * m[j * r + i];
      }
      block_sums(sq, 1, red, tot);
      const double norm = sqrt(tot[0]);
      const bool zero = norm == 0.0 && eps == 0.0;
      const double denom = norm + eps;
      const T inv = zero ? T(0) : T(1.0 / denom);
      if (isfinite(inv)) {
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m[j * r + i] *= inv;
      } else {
        // A tiny column: 1/norm overflows T (see orthogonalize_cpu.cpp); divide in double.
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
          m[j * r + i] = T(double(m[j * r + i]) / denom);
        }
      }
      __syncthreads();
      // Every later column loses its projection on column i. The dot products of one step do not
      // depend on each other (column c's update touches only column c), so they are computed in
      // one sweep over the rows and reduced together, kDotChunk at a time: O(r) block reductions
      // per matrix instead of O(r^2) (review finding F1). Each dot keeps its arithmetic: the same
      // per-thread partial sum over the same rows, then the same reduction tree, so the result is
      // bit-identical to reducing the columns one by one.
      for (int64_t c0 = i + 1; c0 < r; c0 += kDotChunk) {
        const int k = static_cast<int>(r - c0 < kDotChunk ? r - c0 : kDotChunk);
        double part[kDotChunk];
#pragma unroll
        for (int t = 0; t < kDotChunk; ++t) part[t] = 0.0;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
          const T* row = m + j * r;
          const double mi = double(row[i]);
#pragma unroll
          for (int t = 0; t < kDotChunk; ++t) {
            if (t < k) part[t] += mi * row[c0 + t];
          }
        }
        block_sums(part, k, red, tot);
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
          T* row = m + j * r;
          const T mi = row[i];
#pragma unroll
          for (int t = 0; t < kDotChunk; ++t) {
            if (t < k) row[c0 + t] -= T(tot[t]) * mi;
          }
        }
        __syncthreads();  // tot[] is rewritten by the next chunk
      }
      __syncthreads();
    }
  }
}

template <typename T>
void launch_gs(T* data, const int64_t* offsets, const int64_t* rows, const int64_t* cols,
               int64_t count, double eps, cudaStream_t stream) {
  if (count <= 0) return;
  gram_schmidt_kernel<T>
      <<<static_cast<unsigned>(count), kThreads, 0, stream>>>(data, offsets, rows, cols, eps);
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
}  // namespace kernels
}  // namespace ddpx
