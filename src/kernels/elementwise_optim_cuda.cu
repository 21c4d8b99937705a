// CUDA kernel of the elementwise optimizers: one grid-stride pass per tensor with the traits'
// element update (the same function as the CPU loop, so the same results).
#define DDPX_ELEMENTWISE_CUDA_API 1
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "elementwise_optim.h"

namespace ddpx {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <typename Traits, typename T>
__global__ void elementwise_kernel(ElementwiseTensor<Traits, T> t, ElementwiseCoeffs<Traits, T> c) {
  constexpr int K = Traits::kStates;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < t.n;
       i += stride) {
    T p = t.param[i];
    T s[K];
    // A state not kept has a null pointer: zero in, not stored (a branch the whole grid takes
    // alike).
    for (int k = 0; k < K; ++k) s[k] = t.state[k] != nullptr ? t.state[k][i] : T(0);
    Traits::element(p, t.grad[i], s, c);
    t.param[i] = p;
    for (int k = 0; k < K; ++k) {
      if (t.state[k] != nullptr) t.state[k][i] = s[k];
    }
  }
}

}  // namespace

template <typename Traits, typename T>
void elementwise_cuda(const ElementwiseTensor<Traits, T>& t, const ElementwiseCoeffs<Traits, T>& c,
                      cudaStream_t stream) {
  if (t.n <= 0) return;
  const int64_t blocks = (t.n + kThreads - 1) / kThreads;
  elementwise_kernel<Traits, T>
      <<<static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0, stream>>>(t, c);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("ddpx ") + Traits::kKind +
                             " kernel launch failed: " + cudaGetErrorString(err));
  }
}

#define DDPX_INSTANTIATE(Name)                                                  \
  template void elementwise_cuda<optim::elementwise::Name, float>(              \
      const ElementwiseTensor<optim::elementwise::Name, float>&,                \
      const ElementwiseCoeffs<optim::elementwise::Name, float>&, cudaStream_t); \
  template void elementwise_cuda<optim::elementwise::Name, double>(             \
      const ElementwiseTensor<optim::elementwise::Name, double>&,               \
      const ElementwiseCoeffs<optim::elementwise::Name, double>&, cudaStream_t);
DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_INSTANTIATE)
#undef DDPX_INSTANTIATE

}  // namespace kernels
}  // namespace ddpx
