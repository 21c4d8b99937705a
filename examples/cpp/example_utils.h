// What the C++ examples share: a Gloo process group for one rank (ranks run as threads over one
// in-memory store in these examples; a real job would use a c10d::TCPStore).
#pragma once

#include <ddpx/common/compat.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddpx_example {

// One rank's Gloo process group of `world` ranks over `store`; returns once all have joined.
inline ddpx::ProcessGroupPtr make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                             int world) {
  // Ranks are threads of one process here: see the note on this function in compat.h.
  ddpx::compat::disable_flight_recorder_for_thread_ranks();
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return ddpx::compat::make_gloo_group(store, rank, world, options);
}

}  // namespace ddpx_example
