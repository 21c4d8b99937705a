#include <ddpx/hooks/allreduce_hook.h>

#include <ATen/ATen.h>

namespace ddpx {
namespace hooks {

AllreduceHook::AllreduceHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                             ExchangeMode exchange)
    : pg_(std::move(process_group)), exchange_(exchange) {
  detail::check_process_group(pg_, name());
}

c10::intrusive_ptr<c10::ivalue::Future> AllreduceHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name());
  const double inv_world = 1.0 / pg_->getSize();
  if (resolve_exchange_mode(exchange_, *pg_, buffer) == ExchangeMode::kAllgather) {
    // The division happens on the fp32 sum: one rounding instead of two.
    return sum_into(pg_, buffer, buffer, inv_world, ExchangeMode::kAllgather);
  }
  // Same operations, in the same order, as torch's allreduce_hook: divide, then sum.
  buffer.div_(pg_->getSize());
  return sum_into(pg_, buffer, buffer, 1.0, ExchangeMode::kAllreduce);
}

CommHookPtr allreduce_hook(c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  return std::make_shared<AllreduceHook>(std::move(process_group));
}

}  // namespace hooks
}  // namespace ddpx
