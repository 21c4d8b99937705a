// Batched Gram-Schmidt on CUDA, two ways (both one launch for the whole batch):
//  * one block per matrix, column by column, block-wide reductions in double through shared
//    memory (a step's dot products reduced together, 16 at a time): for many matrices, or small
//    ones, where the batch fills the GPU;
//  * several blocks per matrix (a "tall" plan), one row per thread held in registers, the blocks
//    of a matrix combining their sums through global memory between grid-wide barriers of a
//    cooperative launch: for a few tall matrices (PowerSGD's P of a large layer, one matrix per
//    bucket), which one block would walk through alone, on one SM.
#include <cooperative_groups.h>

#include <atomic>

#include "cuda_check.h"
#include "cuda_occupancy.h"
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
      // per matrix instead of O(r^2). Each dot keeps its arithmetic: the same
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

// ---- the tall plan --------------------------------------------------------------------------

constexpr int kTallThreads = 128;                // rows per block: one per thread
constexpr int kTallValues = kGsTallMaxCols + 1;  // a step's squared norm, then one dot per column

// Block `b` of a tall launch works on matrix `k`, whose blocks are `first` .. first + blocks - 1
// (the matrices' blocks back to back, ceil(rows / kTallThreads) each).
__device__ void tall_block_of(const int64_t* rows, int64_t count, int64_t b, int64_t& k,
                              int64_t& first, int64_t& blocks) {
  first = 0;
  for (k = 0; k < count; ++k) {
    blocks = (rows[k] + kTallThreads - 1) / kTallThreads;
    if (b < first + blocks) return;
    first += blocks;
  }
}

// Block-wide sums, over the block's rows, of this step's products: value 0 is mi * mi, value t
// (t in [lo, hi), lo >= 1) is mi * row[t - 1], each in double, each reduced the same way (warp
// shuffles, then the warps' sums through shared memory in warp order). The products are formed
// as they are reduced, so no array of them occupies registers. The bounds must be the same on
// every thread of the block. Totals land in tot[] at the same indices, valid until the next call.
template <typename T>
__device__ __forceinline__ void block_sums_tall(T mi, const T (&row)[kGsTallMaxCols], int lo,
                                                int hi, double* red, double* tot) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int kWarps = kTallThreads / 32;
#pragma unroll
  for (int t = 0; t < kTallValues; ++t) {
    if (t == 0 || (t >= lo && t < hi)) {  // uniform over the block: shuffles stay convergent
      double v = double(mi) * (t == 0 ? mi : row[t == 0 ? 0 : t - 1]);
      for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
      if (lane == 0) red[t * kWarps + warp] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x < kTallValues) {
    const int t = threadIdx.x;
    if (t == 0 || (t >= lo && t < hi)) {
      double v = red[t * kWarps];
      for (int w = 1; w < kWarps; ++w) v += red[t * kWarps + w];
      tot[t] = v;
    }
  }
  __syncthreads();
}

// Modified Gram-Schmidt with each step's squared norm and dot products taken in one sweep:
// step i sums |m_i|^2 and <m_i, m_c> (c > i) over the rows, then normalises column i as the
// one-block kernel does (q_i = m_i / (|m_i| + eps), in double for a tiny column, zeros for a zero
// column with eps 0) and takes <q_i, m_c> = <m_i, m_c> / (|m_i| + eps) off each later column.
// Each thread keeps one row in registers (at most kGsTallMaxCols values, indexed by unrolled
// loops only, so they stay in registers); the blocks of a matrix write their sums to `scratch`,
// meet at a grid-wide barrier (one per step, the scratch alternating between two halves), and
// every block then adds its matrix's sums in block order: the same totals in every block.
// Every block runs passes x max_cols steps, idling through those its matrix does not have, since
// a grid barrier needs the whole grid.
template <typename T>
__global__ void __launch_bounds__(kTallThreads, 1)
    gram_schmidt_tall_kernel(T* data, const int64_t* offsets, const int64_t* rows,
                             const int64_t* cols, int64_t count, double eps0, double* scratch,
                             int64_t max_cols, int passes) {
  __shared__ double red[kTallValues * (kTallThreads / 32)];
  __shared__ double tot[kTallValues];
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  int64_t k = 0, first = 0, blocks = 0;
  tall_block_of(rows, count, blockIdx.x, k, first, blocks);
  const int64_t n = rows[k];
  const int r = static_cast<int>(cols[k]);
  const int64_t j = (static_cast<int64_t>(blockIdx.x) - first) * kTallThreads + threadIdx.x;
  const bool mine = j < n;  // threads past the last row hold zeros and write nothing
  T* my_row = data + offsets[k] + j * r;
  T row[kGsTallMaxCols];
#pragma unroll
  for (int c = 0; c < kGsTallMaxCols; ++c) row[c] = mine && c < r ? my_row[c] : T(0);
  const int64_t stride = gridDim.x * static_cast<int64_t>(kTallValues);
  int64_t step = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const double eps = pass == 0 ? eps0 : 0.0;  // above rank 2, a second pass with epsilon 0
    const bool pass_active = pass == 0 || r > 2;
    for (int i = 0; i < max_cols; ++i, ++step) {
      const bool active = pass_active && i < r;  // the same for the whole block
      double* half = scratch + (step % 2) * stride;
      T mi = T(0);
#pragma unroll
      for (int c = 0; c < kGsTallMaxCols; ++c) {
        if (c == i) mi = row[c];
      }
      if (active) {
        block_sums_tall(mi, row, i + 2, r + 1, red, tot);
        if (threadIdx.x < kTallValues) {
          const int t = threadIdx.x;
          if (t == 0 || (t >= i + 2 && t < r + 1)) {
            half[blockIdx.x * static_cast<int64_t>(kTallValues) + t] = tot[t];
          }
        }
      }
      grid.sync();  // every block's sums of this step are in `half`
      if (!active) continue;
      if (threadIdx.x < kTallValues) {
        const int t = threadIdx.x;
        if (t == 0 || (t >= i + 2 && t < r + 1)) {
          double v = 0.0;
          for (int64_t b = first; b < first + blocks; ++b) {
            v += half[b * static_cast<int64_t>(kTallValues) + t];
          }
          tot[t] = v;
        }
      }
      __syncthreads();
      const double norm = sqrt(tot[0]);
      const bool zero = norm == 0.0 && eps == 0.0;
      const double denom = norm + eps;
      const T inv = zero ? T(0) : T(1.0 / denom);
      // A tiny column: 1/norm overflows T (see orthogonalize_cpu.cpp); divide in double.
      const T q = isfinite(inv) ? T(mi * inv) : T(double(mi) / denom);
      // The later columns' coefficients <q_i, m_c> = <m_i, m_c> / (|m_i| + eps), divided once
      // per block rather than by every thread (the same quotients). Only tot[0] was read above,
      // and no thread rewrites it here.
      if (threadIdx.x < kTallValues) {
        const int t = threadIdx.x;
        if (t >= i + 2 && t < r + 1) tot[t] = zero ? 0.0 : tot[t] / denom;
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < kGsTallMaxCols; ++c) {
        if (c == i) row[c] = q;
        if (c > i && c < r) row[c] -= T(tot[1 + c]) * q;
      }
      __syncthreads();  // tot[] is rewritten by the next step
    }
  }
  if (mine) {
#pragma unroll
    for (int c = 0; c < kGsTallMaxCols; ++c) {
      if (c < r) my_row[c] = row[c];
    }
  }
}

std::atomic<bool> refuse_cooperative{false};

template <typename T>
cudaError_t launch_gs(T* data, const int64_t* offsets, const int64_t* rows, const int64_t* cols,
                      int64_t count, double eps, cudaStream_t stream, const GsPlan& plan,
                      double* scratch) {
  if (count <= 0) return cudaSuccess;
  cudaError_t refused = cudaSuccess;
  if (plan.tall_blocks > 0 && scratch != nullptr) {
    int passes = plan.passes;
    int64_t max_cols = plan.max_cols;
    void* args[] = {&data, &offsets, &rows, &cols, &count, &eps, &scratch, &max_cols, &passes};
    const unsigned blocks = refuse_cooperative.load(std::memory_order_relaxed)
                                ? 0u
                                : static_cast<unsigned>(plan.tall_blocks);
    refused =
        cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&gram_schmidt_tall_kernel<T>),
                                    dim3(blocks), dim3(kTallThreads), args, 0, stream);
    if (refused == cudaSuccess) return cudaSuccess;
    // Refused at launch, so nothing ran: whatever the reason (the plan no longer fits, another
    // device current, MPS or a virtualised GPU refusing cooperative launches), one block per
    // matrix computes the same. The refusal is cleared first; an error that survives clearing
    // is sticky (the context is broken) and is reported as it is.
    (void)cudaGetLastError();
    if (cudaPeekAtLastError() != cudaSuccess) DDPX_CUDA_CHECK(refused);
  }
  gram_schmidt_kernel<T>
      <<<static_cast<unsigned>(count), kThreads, 0, stream>>>(data, offsets, rows, cols, eps);
  DDPX_CUDA_CHECK(cudaGetLastError());
  return refused;
}

template <typename T>
GsPlan plan_for(const int64_t* rows, const int64_t* cols, int64_t count, int64_t min_rows) {
  GsPlan plan;
  int64_t blocks = 0, longest = 0, widest = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (cols[k] > kGsTallMaxCols) return plan;
    blocks += (rows[k] + kTallThreads - 1) / kTallThreads;
    longest = rows[k] > longest ? rows[k] : longest;
    widest = cols[k] > widest ? cols[k] : widest;
  }
  if (count == 0 || longest < min_rows || widest == 0) return plan;
  if (device_attribute<cudaDevAttrCooperativeLaunch>() == 0 ||
      blocks > resident_blocks<gram_schmidt_tall_kernel<T>, kTallThreads>() / 2) {
    return plan;
  }
  plan.tall_blocks = blocks;
  plan.max_cols = widest;
  plan.passes = widest > 2 ? 2 : 1;
  return plan;
}

}  // namespace

GsPlan plan_orthogonalize_cuda(const int64_t* rows, const int64_t* cols, int64_t count,
                               bool is_double, int64_t min_rows) {
  return is_double ? plan_for<double>(rows, cols, count, min_rows)
                   : plan_for<float>(rows, cols, count, min_rows);
}

int64_t orthogonalize_cuda_scratch(const GsPlan& plan) {
  return plan.tall_blocks > 0 ? 2 * plan.tall_blocks * kTallValues : 0;
}

cudaError_t orthogonalize_cuda(float* data, const int64_t* offsets, const int64_t* rows,
                               const int64_t* cols, int64_t count, float epsilon,
                               cudaStream_t stream, const GsPlan& plan, double* scratch) {
  return launch_gs(data, offsets, rows, cols, count, epsilon, stream, plan, scratch);
}
cudaError_t orthogonalize_cuda(double* data, const int64_t* offsets, const int64_t* rows,
                               const int64_t* cols, int64_t count, double epsilon,
                               cudaStream_t stream, const GsPlan& plan, double* scratch) {
  return launch_gs(data, offsets, rows, cols, count, epsilon, stream, plan, scratch);
}

void refuse_cooperative_launches_for_testing(bool refuse) {
  refuse_cooperative.store(refuse, std::memory_order_relaxed);
}
}  // namespace kernels
}  // namespace ddpx
