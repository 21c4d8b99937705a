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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

namespace ddpx {
namespace ops {

// An elementwise update of `n` elements of `param`'s tensors: `on_cuda(stream)` on the current
// stream of param's CUDA device, or `on_cpu(begin, end)` over ranges of at least `grain` elements
// split across ATen's intra-op threads. Nothing runs for n == 0. (on_cuda is never called, and
// may be anything callable, in a build without CUDA, where a CUDA parameter is refused.)
template <typename OnCuda, typename OnCpu>
void run_elementwise(const at::Tensor& param, int64_t n, int64_t grain, OnCuda&& on_cuda,
                     OnCpu&& on_cpu) {
  if (n == 0) return;
  if (param.is_cuda()) {
    TORCH_CHECK(kWithCuda,
                "ddpx was built without CUDA support; rebuild with a CUDA-enabled torch");
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(param);
    std::forward<OnCuda>(on_cuda)(launch.stream());
#endif
    return;
  }
  at::parallel_for(0, n, grain, std::forward<OnCpu>(on_cpu));
}

}  // namespace ops
}  // namespace ddpx
