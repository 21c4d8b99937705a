// hook_with_zero_step / hook_with_zero_step_interleaved. See include/ddpx/hooks/ddp_zero_hook.h.
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/ddp_zero_hook.h>
#include <ddpx/optim/zero.h>

#include <string>
#include <utility>
#include <vector>

#include "hook_utils.h"

namespace ddpx {
namespace hooks {

namespace {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// A bucket whose reduction is in flight: its parameters (DDP's bucket layout: their gradients
// are consecutive slices of the reduced buffer, in this order) and the wrapped hook's future.
struct PendingBucket {
  std::vector<at::Tensor> params;
  FuturePtr future;
};

class ZeroStepHook final : public CommHook {
 public:
  ZeroStepHook(CommHookPtr hook, std::shared_ptr<optim::ZeroRedundancyOptimizer> zero,
               bool interleaved)
      : hook_(std::move(hook)), zero_(std::move(zero)), interleaved_(interleaved) {
    const char* fn = interleaved ? "hook_with_zero_step_interleaved" : "hook_with_zero_step";
    TORCH_CHECK_VALUE(hook_, "ddpx::hooks::", fn, ": hook is null");
    TORCH_CHECK_VALUE(zero_, "ddpx::hooks::", fn, ": zero is null");
    TORCH_CHECK_VALUE(zero_->shards().options().overlap_with_ddp,
                      "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` "
                      "to use this hook properly");
  }

  std::string name() const override {
    return interleaved_ ? "hook_with_zero_interleaved_fn" : "hook_with_zero_fn";
  }

  FuturePtr runHook(c10d::GradBucket& bucket) override {
    FuturePtr fut;
    {
      // Ranks with and without the overlap step exchange differently: the wrapped hook's
      // fingerprint names this wrapper.
      const detail::WrappedBy wrapped(name());
      fut = hook_->runHook(bucket);
    }
    // A backward pass interrupted by an exception left buckets that must not be stepped.
    if (bucket.getIndex() == 0) pending_.clear();
    if (interleaved_) {
      if (!pending_.empty()) step(pending_.front());
      pending_.clear();
      if (bucket.isLast()) {
        step({bucket.getParameters(), fut});
      } else {
        pending_.push_back({bucket.getParameters(), fut});
      }
      return fut;
    }
    pending_.push_back({bucket.getParameters(), fut});
    if (!bucket.isLast()) return fut;
    std::vector<PendingBucket> ready = std::move(pending_);
    pending_.clear();
    for (const PendingBucket& b : ready) step(b);
    return fut;
  }

 private:
  // Waits for the bucket's reduction and steps its parameters with slices of the result.
  void step(const PendingBucket& b) {
    b.future->wait();  // rethrows the reduction's error
    const at::Tensor flat = detail::parse_hook_result(b.future->value(), hook_->name()).reshape(-1);
    std::vector<at::Tensor> grads;
    int64_t offset = 0;
    for (const at::Tensor& p : b.params) {
      const int64_t n = p.numel();
      TORCH_CHECK(offset + n <= flat.numel(), name(), ": the reduced bucket holds ", flat.numel(),
                  " elements, fewer than its parameters");
      grads.push_back(flat.slice(0, offset, offset + n).view(p.sizes()));
      offset += n;
    }
    zero_->step_params(b.params, grads);
  }

  CommHookPtr hook_;
  std::shared_ptr<optim::ZeroRedundancyOptimizer> zero_;
  bool interleaved_;
  // Buckets started but not stepped yet; runHook is called on one thread (DDP's autograd
  // thread), in bucket order.
  std::vector<PendingBucket> pending_;
};

}  // namespace

CommHookPtr hook_with_zero_step(CommHookPtr hook,
                                std::shared_ptr<optim::ZeroRedundancyOptimizer> zero) {
  return std::make_shared<ZeroStepHook>(std::move(hook), std::move(zero), false);
}

CommHookPtr hook_with_zero_step_interleaved(CommHookPtr hook,
                                            std::shared_ptr<optim::ZeroRedundancyOptimizer> zero) {
  return std::make_shared<ZeroStepHook>(std::move(hook), std::move(zero), true);
}

}  // namespace hooks
}  // namespace ddpx
