// The process-group handle every ddpx API takes: one spelling, ddpx::ProcessGroupPtr.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ddpx {

// A reference-counted c10d::ProcessGroup (what torch.distributed's ProcessGroup wraps). APIs
// document what a null handle means for them ("not a member", or an error).
using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

}  // namespace ddpx
