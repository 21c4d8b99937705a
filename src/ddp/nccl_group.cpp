// NCCL process groups (compiled with USE_C10D_NCCL, only when torch has CUDA and nccl.h is found).
#include "ddp/nccl_group.h"

#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace ddpx {
namespace detail {

ProcessGroupPtr make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL,
                 c10::static_intrusive_pointer_cast<c10d::Backend>(nccl));
  return pg;
}

int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }

void set_cuda_device(int index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }

}  // namespace detail
}  // namespace ddpx
