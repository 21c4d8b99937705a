// The one place where ddpx absorbs differences between the torch versions it builds against
// (Debian's 1.13 and pip's 2.x). Everything else includes this instead of testing versions.
#pragma once

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
