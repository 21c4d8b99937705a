// Agreement across ranks by digest (private): a 64-bit FNV-1a over int64 words, the same on every
// process (std::hash need not be), and one all-reduce that tells whether every rank of a group
// holds the same digests. Used where ranks must agree before they issue collectives (a mismatch
// would hang or mix data): run_bucketed's plan (comm/bucketed.cpp) and DistributedDataParallel's
// parameters (ddp/distributed_data_parallel.cpp).
#pragma once

#include <c10/core/Device.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <vector>

namespace ddpx {
namespace comm {

class Digest {
 public:
  void mix(int64_t v) {
    h_ ^= static_cast<uint64_t>(v);
    h_ *= 1099511628211ull;
  }
  // Non-negative, so that -value() is representable too.
  int64_t value() const { return static_cast<int64_t>(h_ >> 2); }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

// Where all_ranks_agree's all-reduce runs.
enum class AgreeOn {
  // On the host when the group takes CPU tensors (Gloo: no GPU work, no wait on the GPU), else
  // as kDevice (NCCL takes device tensors only).
  kAuto,
  kHost,
  // On `device`, on a side stream: uploaded from pinned memory, read back into pinned memory,
  // and only that stream waited for. The host does not wait for the work queued on the current
  // stream (a pageable upload or .cpu() would drain the GPU queue at every averaging step); it
  // waits for the group's earlier collectives and for the other ranks.
  kDevice,
};

// For each digest, whether every rank of `pg` passed the same value: one all-reduce (MAX) of
// [d, -d, ...], as max(d) == -max(-d) exactly when min(d) == max(d), in a tensor on the host or
// on `device` as `where` says. Every rank must call it with as many digests. Blocks until the
// answer is known. Not cached: a rank whose tensors changed while the others' had not would
// issue this collective against their data collectives, a hang where this gives an error.
std::vector<bool> all_ranks_agree(const std::vector<int64_t>& digests, const ProcessGroupPtr& pg,
                                  const c10::Device& device, AgreeOn where = AgreeOn::kAuto);

}  // namespace comm
}  // namespace ddpx
