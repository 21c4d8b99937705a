// A process group from the environment torchrun gives each process (RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as Python's init_process_group("gloo") with the default
// env:// method builds it: a c10d::TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's own store when
// TORCHELASTIC_USE_AGENT_STORE is "True", else one hosted by rank 0) and the backend over it.
#pragma once

#include <ddpx/common/process_group.h>

#include <chrono>
#include <string>
#include <vector>

namespace ddpx {
namespace ddp {

// Python's default process-group timeout (30 minutes).
constexpr std::chrono::milliseconds kDefaultProcessGroupTimeout{30 * 60 * 1000};

// `backend`: "gloo" (CPU tensors, and CUDA tensors through Gloo), or NCCL (CUDA tensors) in a
// build against a CUDA torch with NCCL's header (from_env then makes GPU LOCAL_RANK current):
// "nccl" as Python's (torch 2.15: its nccl2 class unless TORCH_DIST_USE_NCCL2=0; older torch:
// the classic ProcessGroupNCCL), "nccl-legacy" (the classic class), and on torch 2.15 "nccl2"
// and "nccl-lazy"; any other is a c10::ValueError. A missing or malformed variable (not an integer,
// RANK outside [0, WORLD_SIZE), a port outside 1-65535) is a c10::ValueError naming it. Every
// process of the job must call it; it returns once all have joined (or throws after `timeout`).
ProcessGroupPtr init_process_group_from_env(
    const std::string& backend, std::chrono::milliseconds timeout = kDefaultProcessGroupTimeout);

// The same from explicit values (tests, programs launched otherwise): the store at
// master_addr:master_port, hosted by rank 0 unless use_agent_store.
ProcessGroupPtr init_process_group(const std::string& backend, int rank, int world_size,
                                   const std::string& master_addr, int master_port,
                                   std::chrono::milliseconds timeout = kDefaultProcessGroupTimeout,
                                   bool use_agent_store = false);

// Python's dist.new_group(ranks) for a group made by init_process_group[_from_env]: a Gloo group
// of the listed ranks of `world` (each rank's place in it is its position in the sorted list),
// over the world's store under a name of its own. Every rank of `world` must call it, with the
// same ranks, in the same order as its other new_group calls (the n-th call names the n-th
// group); members return once all members have joined, non-members get a null handle at once.
// c10::ValueError for an empty, repeated or out-of-range rank, or a `world` group not made by
// init_process_group.
ProcessGroupPtr new_group(const ProcessGroupPtr& world, std::vector<int> ranks,
                          std::chrono::milliseconds timeout = kDefaultProcessGroupTimeout);

// Python's dist.new_subgroups(group_size): the world cut into groups of `group_size`
// consecutive ranks (the "intra-node" groups of post-local SGD and the hierarchical averager);
// returns this rank's. Every rank must call it; group_size must divide the world size
// (c10::ValueError otherwise).
ProcessGroupPtr new_subgroups(const ProcessGroupPtr& world, int group_size,
                              std::chrono::milliseconds timeout = kDefaultProcessGroupTimeout);

}  // namespace ddp
}  // namespace ddpx
