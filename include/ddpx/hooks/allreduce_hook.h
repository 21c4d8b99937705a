// allreduce_hook: the mean of the bucket over the group, as torch's default_hooks.allreduce_hook.
#pragma once

#include <ddpx/comm/exchange_mode.h>
#include <ddpx/hooks/comm_hook.h>

#include <memory>

namespace ddpx {
namespace comm {
class ReduceScatterSum;
}  // namespace comm

namespace hooks {

// For fp32/fp64 buckets: divides by the group size and allreduces, exactly as torch's
// allreduce_hook (bit-identical results). For 16-bit buckets (e.g. inside fp16_compress_wrapper)
// the exchange mode applies: on Gloo/CPU the 16-bit values are summed in fp32, gathered on 2
// ranks, reduce-scattered and gathered back on 3 or more (see CompressHook); the same result.
class AllreduceHook final : public CommHook {
 public:
  // `process_group` must not be null; `exchange` decides how 16-bit buckets travel.
  explicit AllreduceHook(ProcessGroupPtr process_group,
                         comm::ExchangeMode exchange = comm::ExchangeMode::kAuto);

  std::string name() const override { return "allreduce_hook"; }
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

  // The constructor's arguments.
  const ProcessGroupPtr& process_group() const { return pg_; }
  comm::ExchangeMode exchange() const { return exchange_; }

 private:
  ProcessGroupPtr pg_;
  comm::ExchangeMode exchange_;
  std::shared_ptr<comm::ReduceScatterSum> scatter_;  // kReduceScatter's deferred second round
};

// Factory mirroring torch's name.
CommHookPtr allreduce_hook(ProcessGroupPtr process_group);

}  // namespace hooks
}  // namespace ddpx
