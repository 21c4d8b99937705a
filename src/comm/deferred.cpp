// Deferred second collectives. See src/comm/deferred.h.
#include "comm/deferred.h"

#include <utility>

namespace ddpx {
namespace comm {

void DeferredCollective::run(Step& step) {
  try {
    step.issue();
  } catch (...) {
    step.fail(std::current_exception());
  }
}

void DeferredCollective::flush() {
  if (!pending_) return;
  Step step = std::move(*pending_);
  pending_.reset();
  run(step);
}

void DeferredCollective::submit(Step step, bool last) {
  flush();
  if (last) {
    run(step);
  } else {
    pending_ = std::move(step);
  }
}

}  // namespace comm
}  // namespace ddpx
