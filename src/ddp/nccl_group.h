// NCCL process groups for init_process_group (private: built only when torch has CUDA and NCCL's
// header is found, with DDPX_WITH_NCCL defined; see CMakeLists.txt).
#pragma once

#include <ddpx/common/process_group.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddpx {
namespace detail {

// The NCCL backends init_process_group knows, by the names Python's init_process_group takes:
// "nccl" (torch 2.15: the nccl2 class unless TORCH_DIST_USE_NCCL2=0, as in Python; older torch:
// the classic ProcessGroupNCCL), "nccl2", "nccl-lazy" (torch 2.15) and "nccl-legacy".
bool is_nccl_backend_name(const std::string& backend);

// Whether this torch has the nccl2 backend classes (torch 2.15).
bool nccl2_available();

// The class `backend` builds here, as its backend name: "nccl" (classic), "nccl2", "nccl-lazy".
// ValueError for a name that is not one of is_nccl_backend_name's.
std::string nccl_class_for(const std::string& backend);

// An NCCL backend `backend` of `size` ranks over `store` in a ProcessGroup whose CUDA (and
// default) backend it is, as Python's init_process_group assembles it. nccl2 classes are bound to
// the current CUDA device.
ProcessGroupPtr make_nccl_group(const std::string& backend,
                                const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                std::chrono::milliseconds timeout);

// The number of visible CUDA devices, and making `index` the current one (torchrun's LOCAL_RANK).
int cuda_device_count();
void set_cuda_device(int index);

}  // namespace detail
}  // namespace ddpx
