// A process group from the environment torchrun gives each process (RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as Python's init_process_group("gloo") with the default
// env:// method builds it: a c10d::TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's own store when
// TORCHELASTIC_USE_AGENT_STORE is "True", else one hosted by rank 0) and the backend over it.
#pragma once

#include <ddpx/common/process_group.h>

#include <chrono>
#include <string>

namespace ddpx {

// Python's default process-group timeout (30 minutes).
constexpr std::chrono::milliseconds kDefaultProcessGroupTimeout{30 * 60 * 1000};

// `backend`: "gloo" (CPU tensors, and CUDA tensors through Gloo) is supported; any other is a
// c10::ValueError. A missing or malformed variable (not an integer, RANK outside
// [0, WORLD_SIZE), a port outside 1-65535) is a c10::ValueError naming it. Every process of the
// job must call it; it returns once all have joined (or throws after `timeout`).
ProcessGroupPtr init_process_group_from_env(
    const std::string& backend, std::chrono::milliseconds timeout = kDefaultProcessGroupTimeout);

// The same from explicit values (tests, programs launched otherwise): the store at
// master_addr:master_port, hosted by rank 0 unless use_agent_store.
ProcessGroupPtr init_process_group(const std::string& backend, int rank, int world_size,
                                   const std::string& master_addr, int master_port,
                                   std::chrono::milliseconds timeout = kDefaultProcessGroupTimeout,
                                   bool use_agent_store = false);

}  // namespace ddpx
