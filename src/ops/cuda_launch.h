// What every CUDA launch of the ATen layer needs: a guard for the tensor's device and that
// device's current stream (never the default stream by accident: the inputs were queued on the
// current one, which need not be the default).
#pragma once

namespace ddpx {
namespace ops {
// Whether this build has ddpx's CUDA kernels (torch with CUDA and a matching nvcc).
#ifdef DDPX_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif
}  // namespace ops
}  // namespace ddpx

#ifdef DDPX_WITH_CUDA
// Not ATen/cuda/CUDAContext.h: it pulls in the cuBLAS/cuSPARSE/cuSOLVER headers.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace ddpx {
namespace ops {

class CudaLaunch {
 public:
  explicit CudaLaunch(const at::Tensor& t)
      : guard_(t.device()), stream_(c10::cuda::getCurrentCUDAStream(t.device().index())) {}
  cudaStream_t stream() const { return stream_.stream(); }

 private:
  c10::cuda::CUDAGuard guard_;
  c10::cuda::CUDAStream stream_;
};

}  // namespace ops
}  // namespace ddpx
#endif  // DDPX_WITH_CUDA
