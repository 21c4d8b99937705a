#include "hooks/parameter_keys.h"

#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/comm.hpp>

namespace ddpx {
namespace hooks {
namespace detail {

std::vector<int64_t> ParameterKeys::keys_for(const c10d::GradBucket& bucket,
                                             const std::string& hook_name,
                                             const std::string& state_name) {
  const std::vector<at::Tensor> params = bucket.getParameters();
  std::vector<int64_t> keys;
  keys.reserve(params.size());
  for (const auto& p : params) {
    const void* id = p.unsafeGetTensorImpl();
    auto it = key_of_.find(id);
    if (it == key_of_.end()) {
      TORCH_CHECK_VALUE(!saw_full_iteration_, hook_name, ": this ", state_name,
                        " already serves another DDP model (a parameter it has not seen in a "
                        "whole iteration reached the hook); create one state per model, or "
                        "load_state_dict() a checkpoint into a new state");
      const auto key = static_cast<int64_t>(key_of_.size());
      it = key_of_
               .emplace(
                   id, KnownParameter{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()),
                                      key})
               .first;
    }
    keys.push_back(it->second.key);
  }
  return keys;
}

void ParameterKeys::clear() {
  key_of_.clear();
  saw_full_iteration_ = false;
}

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
