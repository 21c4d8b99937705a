// CUDA kernels of the functional optimizers: one fused grid-stride pass per tensor (or, for SGD
// and Adam, per up to kMultiTensors tensors in one launch, multi_tensor.h), with the element
// updates of optim_inl.h (the CPU kernels' own), so a CUDA step equals a CPU step bit
// for bit (nvcc's default IEEE division and sqrt; fma written explicitly).
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "multi_tensor.h"
#include "optim_cuda.h"
#include "optim_inl.h"

namespace ddpx {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < kMaxBlocks ? b : kMaxBlocks);
}

// One tensor's elements first, first + stride, ... below n: the loop every kernel here runs
// (the single-tensor kernels over the whole grid, the multi-tensor ones over a tensor's blocks).
template <typename T>
__device__ __forceinline__ void sgd_span(T* __restrict__ p, const T* __restrict__ g,
                                         T* __restrict__ b, int64_t n,
                                         const detail::SgdCoeffs<T>& c, int64_t first,
                                         int64_t stride) {
  for (int64_t i = first; i < n; i += stride) {
    T pi = p[i];
    T bi = c.has_momentum && !c.init_buffer ? b[i] : T(0);
    detail::sgd_element(pi, g[i], bi, c);
    p[i] = pi;
    if (c.has_momentum) b[i] = bi;
  }
}

template <typename T>
__device__ __forceinline__ void adam_span(T* __restrict__ p, const T* __restrict__ g,
                                          T* __restrict__ m, T* __restrict__ v,
                                          T* __restrict__ vmax, int64_t n,
                                          const detail::AdamCoeffs<T>& c, int64_t first,
                                          int64_t stride) {
  for (int64_t i = first; i < n; i += stride) {
    T pi = p[i];
    T mi = m[i];
    T vi = v[i];
    T vmaxi = c.amsgrad != T(0) ? vmax[i] : T(0);
    detail::adam_element(pi, g[i], mi, vi, vmaxi, c);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (c.amsgrad != T(0)) vmax[i] = vmaxi;
  }
}

template <typename T>
__global__ void sgd_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ b, int64_t n,
                           detail::SgdCoeffs<T> c) {
  sgd_span(p, g, b, n, c, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
           static_cast<int64_t>(gridDim.x) * blockDim.x);
}

template <typename T>
__global__ void adam_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                            T* __restrict__ v, T* __restrict__ vmax, int64_t n,
                            detail::AdamCoeffs<T> c) {
  adam_span(p, g, m, v, vmax, n, c, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
            static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// A multi-tensor launch's parameter block: up to kMultiTensors tensors, their coefficients and
// which blocks work on which tensor (plan_blocks).
template <typename T>
struct SgdMulti {
  T* p[kMultiTensors];
  const T* g[kMultiTensors];
  T* b[kMultiTensors];
  int64_t n[kMultiTensors];
  detail::SgdCoeffs<T> c[kMultiTensors];
  int block_start[kMultiTensors + 1];
  int count;
};

template <typename T>
struct AdamMulti {
  T* p[kMultiTensors];
  const T* g[kMultiTensors];
  T* m[kMultiTensors];
  T* v[kMultiTensors];
  T* vmax[kMultiTensors];
  int64_t n[kMultiTensors];
  detail::AdamCoeffs<T> c[kMultiTensors];
  int block_start[kMultiTensors + 1];
  int count;
};

static_assert(sizeof(AdamMulti<double>) <= 4000, "kernel parameters are limited to 4 KiB");

// Block b of a multi-tensor launch: its tensor k, and a grid-stride loop over k's elements with
// k's share of the blocks; the element updates are the single-tensor kernels'.
template <typename T>
__global__ void sgd_multi_kernel(SgdMulti<T> a) {
  const int k = tensor_of_block(a.block_start, a.count, blockIdx.x);
  const int64_t first = a.block_start[k];
  const int64_t blocks = a.block_start[k + 1] - first;
  sgd_span(a.p[k], a.g[k], a.b[k], a.n[k], a.c[k],
           (blockIdx.x - first) * static_cast<int64_t>(blockDim.x) + threadIdx.x,
           blocks * blockDim.x);
}

template <typename T>
__global__ void adam_multi_kernel(AdamMulti<T> a) {
  const int k = tensor_of_block(a.block_start, a.count, blockIdx.x);
  const int64_t first = a.block_start[k];
  const int64_t blocks = a.block_start[k + 1] - first;
  adam_span(a.p[k], a.g[k], a.m[k], a.v[k], a.vmax[k], a.n[k], a.c[k],
            (blockIdx.x - first) * static_cast<int64_t>(blockDim.x) + threadIdx.x,
            blocks * blockDim.x);
}

template <typename T>
void launch_sgd_multi(const SgdTensor* t, const SgdScalars* s, int64_t count, cudaStream_t stream) {
  for (int64_t base = 0; base < count; base += kMultiTensors) {
    SgdMulti<T> a{};
    a.count = static_cast<int>(count - base < kMultiTensors ? count - base : kMultiTensors);
    for (int j = 0; j < a.count; ++j) {
      const SgdTensor& tj = t[base + j];
      a.p[j] = static_cast<T*>(tj.param);
      a.g[j] = static_cast<const T*>(tj.grad);
      a.b[j] = static_cast<T*>(tj.buf);
      a.n[j] = tj.n > 0 ? tj.n : 0;
      a.c[j] = detail::sgd_coeffs<T>(s[base + j]);
    }
    const int64_t blocks =
        plan_blocks(a.n, a.count, kThreads, kMultiMaxBlocksPerTensor, a.block_start);
    if (blocks == 0) continue;
    sgd_multi_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
    DDPX_CUDA_CHECK(cudaGetLastError());
  }
}

template <typename T>
void launch_adam_multi(const AdamTensor* t, const AdamScalars* s, int64_t count,
                       cudaStream_t stream) {
  for (int64_t base = 0; base < count; base += kMultiTensors) {
    AdamMulti<T> a{};
    a.count = static_cast<int>(count - base < kMultiTensors ? count - base : kMultiTensors);
    for (int j = 0; j < a.count; ++j) {
      const AdamTensor& tj = t[base + j];
      a.p[j] = static_cast<T*>(tj.param);
      a.g[j] = static_cast<const T*>(tj.grad);
      a.m[j] = static_cast<T*>(tj.exp_avg);
      a.v[j] = static_cast<T*>(tj.exp_avg_sq);
      a.vmax[j] = static_cast<T*>(tj.max_exp_avg_sq);
      a.n[j] = tj.n > 0 ? tj.n : 0;
      a.c[j] = detail::adam_coeffs<T>(s[base + j]);
    }
    const int64_t blocks =
        plan_blocks(a.n, a.count, kThreads, kMultiMaxBlocksPerTensor, a.block_start);
    if (blocks == 0) continue;
    adam_multi_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
    DDPX_CUDA_CHECK(cudaGetLastError());
  }
}

template <typename T>
void launch_sgd(const SgdTensor& t, const SgdScalars& s, cudaStream_t stream) {
  sgd_kernel<T><<<blocks_for(t.n), kThreads, 0, stream>>>(
      static_cast<T*>(t.param), static_cast<const T*>(t.grad), static_cast<T*>(t.buf), t.n,
      detail::sgd_coeffs<T>(s));
  DDPX_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_adam(const AdamTensor& t, const AdamScalars& s, cudaStream_t stream) {
  adam_kernel<T><<<blocks_for(t.n), kThreads, 0, stream>>>(
      static_cast<T*>(t.param), static_cast<const T*>(t.grad), static_cast<T*>(t.exp_avg),
      static_cast<T*>(t.exp_avg_sq), static_cast<T*>(t.max_exp_avg_sq), t.n,
      detail::adam_coeffs<T>(s));
  DDPX_CUDA_CHECK(cudaGetLastError());
}

[[noreturn]] void bad_dtype(DType t, const char* op) {
  throw std::invalid_argument(std::string("ddpx ") + op + ": unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)) + " (float32 and float64 only)");
}

}  // namespace

void sgd_cuda(const SgdTensor& t, DType dtype, const SgdScalars& s, cudaStream_t stream) {
  if (t.n <= 0) return;
  if (s.momentum != 0 && t.buf == nullptr) {
    throw std::invalid_argument("ddpx sgd_cuda: momentum needs a buffer");
  }
  switch (dtype) {
    case DType::kFloat32:
      return launch_sgd<float>(t, s, stream);
    case DType::kFloat64:
      return launch_sgd<double>(t, s, stream);
    default:
      bad_dtype(dtype, "sgd_cuda");
  }
}

void adam_cuda(const AdamTensor& t, DType dtype, const AdamScalars& s, cudaStream_t stream) {
  if (t.n <= 0) return;
  if (s.amsgrad && t.max_exp_avg_sq == nullptr) {
    throw std::invalid_argument("ddpx adam_cuda: amsgrad needs max_exp_avg_sq");
  }
  switch (dtype) {
    case DType::kFloat32:
      return launch_adam<float>(t, s, stream);
    case DType::kFloat64:
      return launch_adam<double>(t, s, stream);
    default:
      bad_dtype(dtype, "adam_cuda");
  }
}

void sgd_cuda_multi(const SgdTensor* t, const SgdScalars* s, int64_t count, DType dtype,
                    cudaStream_t stream) {
  for (int64_t i = 0; i < count; ++i) {
    if (t[i].n > 0 && s[i].momentum != 0 && t[i].buf == nullptr) {
      throw std::invalid_argument("ddpx sgd_cuda_multi: momentum needs a buffer (tensor " +
                                  std::to_string(i) + ")");
    }
  }
  switch (dtype) {
    case DType::kFloat32:
      return launch_sgd_multi<float>(t, s, count, stream);
    case DType::kFloat64:
      return launch_sgd_multi<double>(t, s, count, stream);
    default:
      bad_dtype(dtype, "sgd_cuda_multi");
  }
}

void adam_cuda_multi(const AdamTensor* t, const AdamScalars* s, int64_t count, DType dtype,
                     cudaStream_t stream) {
  for (int64_t i = 0; i < count; ++i) {
    if (t[i].n > 0 && s[i].amsgrad && t[i].max_exp_avg_sq == nullptr) {
      throw std::invalid_argument("ddpx adam_cuda_multi: amsgrad needs max_exp_avg_sq (tensor " +
                                  std::to_string(i) + ")");
    }
  }
  switch (dtype) {
    case DType::kFloat32:
      return launch_adam_multi<float>(t, s, count, stream);
    case DType::kFloat64:
      return launch_adam_multi<double>(t, s, count, stream);
    default:
      bad_dtype(dtype, "adam_cuda_multi");
  }
}

}  // namespace kernels
}  // namespace ddpx
