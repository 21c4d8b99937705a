// CUDA kernels of the functional optimizers: one fused grid-stride pass per tensor, with the
// element updates of optim_inl.h (the CPU kernels' own), so a CUDA step equals a CPU step bit
// for bit (nvcc's default IEEE division and sqrt; fma written explicitly).
#include <stdexcept>
#include <string>

#include "cuda_check.h"
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

template <typename T>
__global__ void sgd_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ b, int64_t n,
                           detail::SgdCoeffs<T> c) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    T pi = p[i];
    T bi = c.has_momentum && !c.init_buffer ? b[i] : T(0);
    detail::sgd_element(pi, g[i], bi, c);
    p[i] = pi;
    if (c.has_momentum) b[i] = bi;
  }
}

template <typename T>
__global__ void adam_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                            T* __restrict__ v, T* __restrict__ vmax, int64_t n,
                            detail::AdamCoeffs<T> c) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
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

}  // namespace kernels
}  // namespace ddpx
