// What the C++ examples share: a Gloo process group for one rank (ranks run as threads over one
// in-memory store in these examples; a real job would use a c10d::TCPStore).
#pragma once

#include <ddpx/common/compat.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddpx_example {

// One rank's Gloo process group of `world` ranks over `store`; returns once all have joined.
inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world) {
  // Ranks are threads of one process here: see the note on this function in compat.h.
  ddpx::compat::disable_flight_recorder_for_thread_ranks();
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  auto backend = c10::static_intrusive_pointer_cast<c10d::Backend>(
      c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options));
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  return pg;
#else
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
#endif
}

}  // namespace ddpx_example
