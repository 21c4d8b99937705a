// The one place where ddpx absorbs differences between the torch versions it builds against
// (Debian's 1.13 and pip's 2.x). Everything else includes this instead of testing versions.
#pragma once

#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/version.h>

#define DDPX_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||               \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace ddpx {
namespace compat {

// "major.minor" of the torch ddpx was compiled against; the Python loader compares it with
// the torch it is imported into.
inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}

// torch 2.x's c10d flight recorder (on by default: TORCH_FR_BUFFER_SIZE=2000) inserts a process
// group's status into a shared map without holding its lock when the group records its first
// collective. A program that runs several ranks as threads of one process, each with its own
// ProcessGroupGloo, can corrupt that map. Seen with torch 2.11: a ddpx CI run hung with every
// rank thread spinning in FlightRecorder::recordWithResetEnabled, and with the recorder forced
// on, 1 of 24 test runs crashed (0 of 24 with it off). Call this before
// creating such process groups: it turns the recorder off unless the user configured it (torch
// reads the setting once, when the recorder is first used). One process per rank (torchrun)
// does not need it. Thread-safe; torch 1.13 has no recorder and ignores the variable.
inline void disable_flight_recorder_for_thread_ranks() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("TORCH_FR_BUFFER_SIZE") == nullptr &&
        std::getenv("TORCH_NCCL_TRACE_BUFFER_SIZE") == nullptr) {
      ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
    }
  });
}

// Backend name of a process group ("gloo", "nccl", ...). In torch 2.x a ProcessGroup may wrap
// several backends; getBackendName() then names the group's default backend.
inline std::string backend_name(const c10d::ProcessGroup& pg) { return pg.getBackendName(); }

namespace detail {
template <typename... Args>
c10d::GradBucket make_grad_bucket_impl(std::true_type, Args&&... args) {
  return c10d::GradBucket(std::forward<Args>(args)...);
}
template <typename... Args>
c10d::GradBucket make_grad_bucket_impl(std::false_type, Args&&... args) {
  return c10d::GradBucket(std::forward<Args>(args)..., c10::nullopt);
}
}  // namespace detail

// Builds a GradBucket over `buffer` holding `grads` laid out back to back, as DDP's Reducer
// does. Used by C++ callers and tests that drive hooks without DDP. `sizes` must outlive the
// bucket (GradBucket stores IntArrayRefs into it).
inline c10d::GradBucket make_grad_bucket(size_t index, size_t bucket_count,
                                         const at::Tensor& buffer,
                                         const std::vector<size_t>& offsets,
                                         const std::vector<size_t>& lengths,
                                         const std::vector<c10::IntArrayRef>& sizes,
                                         const std::vector<at::Tensor>& parameters) {
  // torch >= 2.1 added a required `sparse_grad_indices` argument; detect it by signature.
  constexpr bool kSevenArgs =
      std::is_constructible<c10d::GradBucket, size_t, size_t, const at::Tensor&,
                            const std::vector<size_t>&, const std::vector<size_t>&,
                            const std::vector<c10::IntArrayRef>&,
                            const std::vector<at::Tensor>&>::value;
  return detail::make_grad_bucket_impl(std::integral_constant<bool, kSevenArgs>{}, index, bucket_count,
                               buffer, offsets, lengths, sizes, parameters);
}

}  // namespace compat
}  // namespace ddpx
