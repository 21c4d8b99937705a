// NCCL process groups (compiled with USE_C10D_NCCL, only when torch has CUDA and nccl.h is found).
#include "ddp/nccl_group.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
// torch 2.15's in-tree NCCL backend on the torchcomms engine (what Python's "nccl" builds there),
// detected by its header rather than by a version number.
#if __has_include(<torch/csrc/distributed/c10d/nccl2/ProcessGroupNCCL.hpp>)
#include <torch/csrc/distributed/c10d/nccl2/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/nccl2/ProcessGroupNCCLLazy.hpp>
#define DDPX_HAVE_NCCL2 1
#else
#define DDPX_HAVE_NCCL2 0
#endif

namespace ddpx {
namespace detail {

bool is_nccl_backend_name(const std::string& backend) {
  return backend == "nccl" || backend == "nccl2" || backend == "nccl-lazy" ||
         backend == "nccl-legacy";
}

bool nccl2_available() { return DDPX_HAVE_NCCL2 != 0; }

std::string nccl_class_for(const std::string& backend) {
  if (backend == "nccl-legacy") return "nccl";
  if (backend == "nccl2" || backend == "nccl-lazy") return backend;
  TORCH_CHECK_VALUE(backend == "nccl", "not an NCCL backend: '", backend, "'");
  // As Python's _register_builtin_nccl_backend: the new class unless TORCH_DIST_USE_NCCL2=0.
  const char* env = std::getenv("TORCH_DIST_USE_NCCL2");
  const bool legacy = !nccl2_available() || (env != nullptr && std::strcmp(env, "0") == 0);
  return legacy ? "nccl" : "nccl2";
}

ProcessGroupPtr make_nccl_group(const std::string& backend,
                                const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                std::chrono::milliseconds timeout) {
  const std::string cls = nccl_class_for(backend);
  TORCH_CHECK_VALUE(cls == "nccl" || nccl2_available(), "init_process_group: backend '", backend,
                    "' needs torch's nccl2 backend (torch 2.15 or newer), which this torch lacks");
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  c10::intrusive_ptr<c10d::Backend> nccl;
  if (cls == "nccl") {
    nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  }
#if DDPX_HAVE_NCCL2
  else if (cls == "nccl2") {
    nccl = c10::make_intrusive<c10d::nccl2::ProcessGroupNCCL>(store, rank, size, options);
  } else {
    nccl = c10::make_intrusive<c10d::nccl2::ProcessGroupNCCLLazy>(store, rank, size, options);
  }
#endif
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  // "nccl" is the NCCL backend type whichever class serves it; the other names are registered
  // as custom backends, as Python registers them.
  const auto type = backend == "nccl" ? c10d::ProcessGroup::BackendType::NCCL
                                      : c10d::ProcessGroup::BackendType::CUSTOM;
  // nccl2 creates its communicator when the group binds it to a device (setBackend passes the
  // group's bound device on); the classic class takes the current device lazily, as before.
  if (cls != "nccl") {
    pg->setBoundDeviceId(c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device()));
  }
  pg->setDefaultBackend(type);
  pg->setBackend(c10::DeviceType::CUDA, type, nccl);
  return pg;
}

int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }

void set_cuda_device(int index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }

}  // namespace detail
}  // namespace ddpx
