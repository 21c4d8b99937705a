// Keys for the parameters that reach a stateful hook, by first appearance (private to the hooks).
//
// A hook whose memories must survive DDP's bucket rebuild and a restart into a new process keys
// them per parameter, not per bucket: the keys are assigned in the order in which parameters
// first reach the hook (DDP's initial bucket order, the same in every process that builds the
// same model), so a checkpoint's memories find their parameters although the buckets after a
// restart differ from those the checkpoint was taken with.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace c10d {
class GradBucket;
}

namespace ddpx {
namespace hooks {
namespace detail {

class ParameterKeys {
 public:
  // The keys of the bucket's parameters, assigning new ones in first-appearance order. Once a
  // whole iteration was seen (end_of_iteration), a parameter never seen before means a second
  // model: c10::ValueError naming `hook_name` and `state_name`.
  std::vector<int64_t> keys_for(const c10d::GradBucket& bucket, const std::string& hook_name,
                                const std::string& state_name);
  // Called on the last bucket of a backward pass.
  void end_of_iteration() { saw_full_iteration_ = true; }
  // Forgets every parameter (a state loaded into a new process).
  void clear();

 private:
  // Keys by TensorImpl address. The weak reference pins the address: a freed parameter's
  // TensorImpl memory is not released while it is held, so a new model's parameter can never
  // take a known parameter's address and inherit its memories.
  struct KnownParameter {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    int64_t key;
  };
  std::unordered_map<const void*, KnownParameter> key_of_;
  bool saw_full_iteration_ = false;
};

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
