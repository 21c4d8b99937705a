#include <ATen/ATen.h>
#include <ddpx/hooks/allreduce_hook.h>

#include "comm/exchange.h"
#include "hooks/hook_utils.h"

namespace ddpx {
namespace hooks {

AllreduceHook::AllreduceHook(ProcessGroupPtr process_group, ExchangeMode exchange)
    : pg_(std::move(process_group)), exchange_(exchange) {
  detail::check_process_group(pg_, name());
}

c10::intrusive_ptr<c10::ivalue::Future> AllreduceHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name(), /*sparse_ok=*/true);
  return comm::allreduce_mean(pg_, buffer, exchange_);
}

CommHookPtr allreduce_hook(ProcessGroupPtr process_group) {
  return std::make_shared<AllreduceHook>(std::move(process_group));
}

}  // namespace hooks
}  // namespace ddpx
