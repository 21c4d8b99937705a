// noop_hook: returns the bucket unchanged, with no communication (headroom analysis only).
#pragma once

#include <ddpx/hooks/comm_hook.h>

namespace ddpx {
namespace hooks {

// Returns an already-completed future holding the bucket's own buffer. Gradients are NOT
// synchronised: use it only to measure how much time communication costs.
class NoopHook final : public CommHook {
 public:
  std::string name() const override { return "noop_hook"; }
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
};

// Factory mirroring torch's name.
CommHookPtr noop_hook();

}  // namespace hooks
}  // namespace ddpx
