// NCCL process groups for init_process_group (private: built only when torch has CUDA and NCCL's
// header is found, with DDPX_WITH_NCCL defined; see CMakeLists.txt).
#pragma once

#include <ddpx/common/process_group.h>

#include <chrono>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddpx {
namespace detail {

// A ProcessGroupNCCL of `size` ranks over `store` in a ProcessGroup whose CUDA (and default)
// backend it is, as Python's init_process_group("nccl") assembles it.
ProcessGroupPtr make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                std::chrono::milliseconds timeout);

// The number of visible CUDA devices, and making `index` the current one (torchrun's LOCAL_RANK).
int cuda_device_count();
void set_cuda_device(int index);

}  // namespace detail
}  // namespace ddpx
