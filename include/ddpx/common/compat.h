// The differences between the torch versions ddpx builds against (Debian's 1.13 and pip's 2.x)
// that a C++ training program meets: process groups and their backends, GradBucket's
// constructor, Optimizer::zero_grad. What only the library and its tests need (DDP's Reducer,
// the optimizer formulas, c10's warning and memory hooks) is in the private
// src/common/compat_internal.h, which extends this header. Everything else includes one of the two
// instead of testing versions: no version #if appears outside them (library, tests, examples,
// benchmarks). Where an API's shape can be detected (a constructor's arguments), it is detected
// instead of versioned.
#pragma once

#include <c10/util/Exception.h>
#include <ddpx/common/process_group.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <type_traits>
#include <utility>
#include <vector>
// ProcessGroupGloo.hpp declares its class only with USE_C10D_GLOO (as when torch is built), and
// it includes Gloo's own headers, which torch's pip wheels do not ship. CUDA builds of torch
// define USE_C10D_GLOO for every program through their CMake targets, so the macro alone does not
// say that the header compiles: Gloo's headers must be found too (Debian/Ubuntu: libgloo-dev).
#if defined(USE_C10D_GLOO) && defined(__has_include)
#if __has_include(<gloo/algorithm.h>)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
// 1 where this header declares make_gloo_group (torch's ProcessGroupGloo is usable), else 0.
#define DDPX_HAS_GLOO_GROUP 1
#endif
#endif
#ifndef DDPX_HAS_GLOO_GROUP
#define DDPX_HAS_GLOO_GROUP 0
#endif

// True when the torch ddpx compiles against is at least major.minor: the one version test,
// used in this header and src/common/compat_internal.h only.
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

// Name of a process group's default backend object ("gloo", "nccl", "nccl2", ...). In torch 2.x
// a ProcessGroup may wrap several backends, and its own getBackendName() names only its
// BackendType: "custom" for a group made as "nccl2" or "nccl-lazy" (torch 2.15). In 1.13 the
// group is its one backend.
inline std::string backend_name(const c10d::ProcessGroup& pg) {
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  try {
    if (auto backend = pg.getDefaultBackend()) return backend->getBackendName();
  } catch (const c10::Error&) {
  }
#endif
  return pg.getBackendName();
}

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
  return detail::make_grad_bucket_impl(std::integral_constant<bool, kSevenArgs>{}, index,
                                       bucket_count, buffer, offsets, lengths, sizes, parameters);
}

// ---- process groups ----------------------------------------------------------------------

// The class a collective backend derives from: torch 2.x splits a ProcessGroup (the handle
// hooks take) from the Backend(s) it wraps; in 1.13 the backend is the ProcessGroup itself.
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

// Whether a ProcessGroup maps device types to backends (2.x); a 1.13 group is its one backend.
constexpr bool kGroupsMapDevices = DDPX_TORCH_VERSION_AT_LEAST(2, 0);

// The ProcessGroup over one Gloo `backend` of `rank` in `size` ranks, as torch builds it for
// dist.new_group(backend="gloo"): a 2.x ProcessGroup wrapping it as its Gloo backend for the
// `devices` (Python's: CPU and CUDA tensors), or in 1.13 the backend itself.
inline ProcessGroupPtr process_group_of(c10::intrusive_ptr<Backend> backend,
                                        const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int size,
                                        const std::vector<c10::DeviceType>& devices = {
                                            c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  for (c10::DeviceType type : devices) {
    pg->setBackend(type, c10d::ProcessGroup::BackendType::GLOO, backend);
  }
  return pg;
#else
  (void)store;
  (void)rank;
  (void)size;
  (void)devices;
  return backend;
#endif
}

#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
// The backend `pg` maps to tensors on `type`, or null when it has none (torch 2.x).
// getBackend is a lookup that caches what it finds, hence not const in torch's header.
inline c10::intrusive_ptr<c10d::Backend> backend_for(const c10d::ProcessGroup& pg,
                                                     c10::DeviceType type) {
  try {
    return const_cast<c10d::ProcessGroup&>(pg).getBackend(type);
  } catch (const c10::Error&) {
    return {};
  }
}
#endif

// Whether `pg` has a backend for tensors on `type` (always true in 1.13: its group is one backend,
// which takes whatever tensors it supports).
inline bool has_backend_for(const c10d::ProcessGroup& pg, c10::DeviceType type) {
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  return backend_for(pg, type) != nullptr;
#else
  (void)pg;
  (void)type;
  return true;
#endif
}

// Name of the backend `pg` runs collectives on `type` tensors with: in torch 2.x the one mapped to
// that device type, which in a group of several (init_process_group("cpu:gloo,cuda:nccl")) need
// not be the default; the default when none is mapped; in 1.13 the group's.
inline std::string backend_name(const c10d::ProcessGroup& pg, c10::DeviceType type) {
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  if (auto backend = backend_for(pg, type)) return backend->getBackendName();
#else
  (void)type;
#endif
  return pg.getBackendName();
}

// The collective library a process group runs one device type's tensors on. NCCL comes as three
// classes: torch's classic c10d::ProcessGroupNCCL (named "nccl"; in torch 2.15 what "nccl" builds
// only with TORCH_DIST_USE_NCCL2=0, or "nccl-legacy"), 2.15's c10d::nccl2::ProcessGroupNCCL
// ("nccl2": what "nccl" builds there by default) and its lazy variant ("nccl-lazy"). They share
// no C++ base beyond c10d::Backend, and TORCH_DISTRIBUTED_DEBUG=DETAIL wraps any backend in a
// wrapper that forwards its name: the kind is read from the backend's name, never from a cast.
enum class BackendKind { kNone, kGloo, kNccl, kNccl2, kNcclLazy, kOther };

// The kind a backend named `name` is ("gloo", "nccl", "nccl2", "nccl-lazy"; "" is kNone).
inline BackendKind backend_kind_of(const std::string& name) {
  if (name.empty()) return BackendKind::kNone;
  if (name == "gloo") return BackendKind::kGloo;
  if (name == "nccl") return BackendKind::kNccl;
  if (name == "nccl2") return BackendKind::kNccl2;
  if (name == "nccl-lazy") return BackendKind::kNcclLazy;
  return BackendKind::kOther;
}

// Whether `kind` is NCCL, of any of its classes.
constexpr bool is_nccl(BackendKind kind) {
  return kind == BackendKind::kNccl || kind == BackendKind::kNccl2 ||
         kind == BackendKind::kNcclLazy;
}

// The kind of backend `pg` runs `type` tensors on (kNone: it has none for them).
inline BackendKind backend_kind(const c10d::ProcessGroup& pg, c10::DeviceType type) {
  if (!has_backend_for(pg, type)) return BackendKind::kNone;
  return backend_kind_of(backend_name(pg, type));
}

// Whether collectives of `pg` take CPU tensors: a 2.x group with a CPU backend (Gloo, or the CPU
// half of "cpu:gloo,cuda:nccl"), a 1.13 Gloo (or MPI) group, not NCCL.
inline bool takes_cpu_tensors(const c10d::ProcessGroup& pg) {
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  return has_backend_for(pg, c10::DeviceType::CPU);
#else
  const std::string name = pg.getBackendName();
  return name == "gloo" || name == "mpi";
#endif
}

#if DDPX_HAS_GLOO_GROUP
// A Gloo process group for `rank` of `size` over `store` (construction is a rendezvous: every
// rank must construct its group concurrently). Ranks that are threads of one process should call
// disable_flight_recorder_for_thread_ranks() first.
inline ProcessGroupPtr make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options) {
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, std::move(options));
  return process_group_of(c10::static_intrusive_pointer_cast<Backend>(gloo), store, rank, size);
}
#endif

// ---- optimizers -----------------------------------------------------------------------------

// Optimizer::zero_grad(set_to_none): 2.x's default drops the gradients; 1.13's zero_grad() only
// zeroes them, so set_to_none is done here by hand there.
inline void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none) {
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  optimizer.zero_grad(set_to_none);
#else
  if (!set_to_none) {
    optimizer.zero_grad();
    return;
  }
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.mutable_grad().defined()) p.mutable_grad() = at::Tensor();
    }
  }
#endif
}

}  // namespace compat
}  // namespace ddpx
