#include <ddpx/hooks/noop_hook.h>

#include "hooks/hook_utils.h"

namespace ddpx {
namespace hooks {

c10::intrusive_ptr<c10::ivalue::Future> NoopHook::runHook(c10d::GradBucket& bucket) {
  return detail::completed_future(bucket.getBuffer());
}

CommHookPtr noop_hook() { return std::make_shared<NoopHook>(); }

}  // namespace hooks
}  // namespace ddpx
