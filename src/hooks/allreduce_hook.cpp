#include <ATen/ATen.h>
#include <ddpx/hooks/allreduce_hook.h>

#include "comm/exchange.h"
#include "hooks/agreement.h"
#include "hooks/hook_utils.h"

namespace ddpx {
namespace hooks {

using comm::ExchangeMode;
using comm::resolve_exchange_mode;

AllreduceHook::AllreduceHook(ProcessGroupPtr process_group, ExchangeMode exchange)
    : pg_(std::move(process_group)),
      exchange_(exchange),
      scatter_(std::make_shared<comm::ReduceScatterSum>()) {
  detail::check_process_group(pg_, name());
}

c10::intrusive_ptr<c10::ivalue::Future> AllreduceHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  try {
    detail::check_bucket(buffer, name(), /*sparse_ok=*/true);
    detail::agree_once(agreed_epoch_, pg_, buffer.device(), 0, [&] {
      return detail::Fingerprint(name()).add_choice("exchange", static_cast<int64_t>(exchange_),
                                                    detail::exchange_mode_names());
    });
  } catch (...) {
    scatter_->flush();  // the previous bucket's second round goes out in every rank's order
    throw;
  }
  if (!buffer.is_sparse() &&
      resolve_exchange_mode(exchange_, *pg_, buffer.scalar_type(), buffer.device(),
                            /*two_rounds=*/true) == ExchangeMode::kReduceScatter) {
    // The mean's closed form of the gather path: sum in fp32, times 1/W, one rounding.
    return scatter_->start(pg_, buffer, buffer.scalar_type(), 1.0, buffer, 1.0 / pg_->getSize(),
                           bucket.isLast());
  }
  scatter_->flush();
  return comm::allreduce_mean(pg_, buffer, exchange_);
}

CommHookPtr allreduce_hook(ProcessGroupPtr process_group) {
  return std::make_shared<AllreduceHook>(std::move(process_group));
}

}  // namespace hooks
}  // namespace ddpx
