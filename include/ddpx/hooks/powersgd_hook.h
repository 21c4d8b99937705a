// powerSGD_hook and batched_powerSGD_hook (Vogels et al., NeurIPS 2019), torch's semantics.
#pragma once

#include <ddpx/hooks/comm_hook.h>
#include <ddpx/hooks/powersgd_state.h>

namespace ddpx {
namespace hooks {

// PowerSGD gradient compression. Layer-wise (batched = false, torch's powerSGD_hook): matrices
// worth compressing get rank-r factors P = MQ and Q = M^T P, the rest is allreduced as is, in
// the same collective as the Ps. Batched (torch's batched_powerSGD_hook): the whole bucket as one
// zero-padded square matrix.
//
// Both rounds of every bucket are issued from runHook, never from completion callbacks: round
// one (uncompressed values + Ps) of bucket i, then round two (Qs) of bucket i-1; the last bucket
// finishes both. Collectives thus leave every rank in the same order, whatever the timing (torch's
// Python hook issues round two from callbacks, which can interleave with the next bucket's
// collectives differently on different ranks).
class PowerSGDHook final : public CommHook {
 public:
  // Shares `state` (not null); `batched` selects batched_powerSGD_hook's semantics.
  PowerSGDHook(PowerSGDStatePtr state, bool batched);

  std::string name() const override;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

  // The constructor's arguments.
  const PowerSGDStatePtr& state() const { return state_; }
  bool batched() const { return batched_; }

 private:
  PowerSGDStatePtr state_;
  bool batched_;
};

// Factories mirroring torch's names.
CommHookPtr powerSGD_hook(PowerSGDStatePtr state);
CommHookPtr batched_powerSGD_hook(PowerSGDStatePtr state);

}  // namespace hooks
}  // namespace ddpx
