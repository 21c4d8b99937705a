// Torch-free kernels of the elementwise optimizers (ddpx/optim/elementwise/all.h): one tensor's
// update over raw pointers with its traits' element function, the same on CPU and CUDA.
#pragma once

#include <ddpx/optim/elementwise/all.h>

#include <cstdint>

#ifdef DDPX_ELEMENTWISE_CUDA_API
#include <cuda_runtime_api.h>
#endif

namespace ddpx {
namespace kernels {

// One tensor of an update: n contiguous elements each of param, grad and the traits' states, in
// the order of Traits::kStateNames; a state the options do not keep (elementwise::keeps_state) is
// null, and the element update sees it as zero. param and states are updated in place.
template <typename Traits, typename T>
struct ElementwiseTensor {
  T* param = nullptr;
  const T* grad = nullptr;
  T* state[Traits::kStates] = {};
  int64_t n = 0;
};

template <typename Traits, typename T>
using ElementwiseCoeffs = typename Traits::template Coeffs<T>;

// Elements [begin, end) of `t` on the calling thread (0 <= begin <= end <= t.n); disjoint ranges
// may run concurrently. Instantiated for float and double of every elementwise optimizer.
template <typename Traits, typename T>
void elementwise_cpu(const ElementwiseTensor<Traits, T>& t, const ElementwiseCoeffs<Traits, T>& c,
                     int64_t begin, int64_t end);

#ifdef DDPX_ELEMENTWISE_CUDA_API
// All t.n elements, asynchronously on `stream` (device pointers); launch errors are raised as
// std::runtime_error.
template <typename Traits, typename T>
void elementwise_cuda(const ElementwiseTensor<Traits, T>& t, const ElementwiseCoeffs<Traits, T>& c,
                      cudaStream_t stream);
#endif

}  // namespace kernels
}  // namespace ddpx
