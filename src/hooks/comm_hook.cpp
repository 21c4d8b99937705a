#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/comm_hook.h>

#include "hooks/hook_utils.h"

namespace ddpx {
namespace hooks {

at::Tensor CommHook::parseHookResult(const c10::IValue& result) {
  return detail::parse_hook_result(result, name());
}

SharedCommHook::SharedCommHook(CommHookPtr hook) : hook_(std::move(hook)) {
  TORCH_CHECK(hook_ != nullptr, "SharedCommHook: hook must not be null");
}

c10::intrusive_ptr<c10::ivalue::Future> SharedCommHook::runHook(c10d::GradBucket& bucket) {
  return hook_->runHook(bucket);
}

at::Tensor SharedCommHook::parseHookResult(const c10::IValue& result) {
  return hook_->parseHookResult(result);
}

}  // namespace hooks
}  // namespace ddpx
