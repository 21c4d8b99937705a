// The owner side of ddpx.optim.DistributedOptimizer (RPC): each worker that owns parameters holds
// one local optimizer per DistributedOptimizer, registered here under an id, and steps it in C++
// with the gradients distributed autograd accumulated in a context (dist_autograd.get_gradients,
// keyed by parameter). A step arrives over RPC as a call to the builtin operator
// aten::_ddpx_rpc_optimizer_step(id, context_id), which torch's RPC agent runs without Python:
// no GIL on the owner (src/python/bind_rpc_optim.cpp).
//
// Concurrent steps on one worker (several trainers, or several DistributedOptimizers) are
// serialized by one lock per process, as torch's _LocalOptimizer.global_lock serializes them:
// a parameter update is never interleaved with another.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <ddpx/optim/functional.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ddpx {
namespace optim {

// One worker's optimizer over its parameters: a functional optimizer and the order of its
// parameters. Built by make_rpc_local_optimizer.
class RpcLocalOptimizer {
 public:
  // The step over the parameters' gradients, and the reader of their optimizer state.
  using StepFn = std::function<void(const std::vector<at::Tensor>&)>;
  using StateFn = std::function<std::vector<ParamState>()>;
  RpcLocalOptimizer(std::string kind, std::vector<at::Tensor> params, StepFn step, StateFn state);

  // One step with the context's gradients: each parameter with an entry in `grads` is updated,
  // the others are skipped (as torch's functional optimizers skip a None gradient). Parameters
  // on a device (CUDA) are updated on its current stream (the RPC agent's stream for the
  // request), and the step returns once that stream is done: the owner's next request runs on
  // another of the agent's streams, with no order to this one, and must see the update.
  void step(const c10::Dict<at::Tensor, at::Tensor>& grads);
  const std::string& kind() const { return kind_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  // The state in torch.optim's per-parameter layout (tests, checkpoints).
  std::vector<ParamState> state() const { return state_(); }

 private:
  std::string kind_;
  std::vector<at::Tensor> params_;
  std::vector<c10::Device> devices_;  // the parameters' devices other than the CPU, once each
  StepFn step_;
  StateFn state_;
};

// One worker's optimizer of the kind `options` stand for (SGDOptions: torch.optim.SGD,
// AdamOptions: Adam or AdamW, AdamaxOptions: Adamax, ...) over `params`. Options torch refuses are
// a c10::ValueError.
std::shared_ptr<RpcLocalOptimizer> make_rpc_local_optimizer(std::vector<at::Tensor> params,
                                                            const OptimizerOptions& options);

// This process's registry: ids are unique within the process and never reused.
int64_t register_rpc_local_optimizer(std::shared_ptr<RpcLocalOptimizer> optimizer);
// Drops `id` (the DistributedOptimizer is gone); unknown ids are ignored (teardown order).
void unregister_rpc_local_optimizer(int64_t id);
// The registered optimizer (c10::ValueError for an unknown id).
std::shared_ptr<RpcLocalOptimizer> rpc_local_optimizer(int64_t id);
// Steps optimizer `id` with `grads` under this process's optimizer lock; what the operator
// aten::_ddpx_rpc_optimizer_step runs.
void step_rpc_local_optimizer(int64_t id, const c10::Dict<at::Tensor, at::Tensor>& grads);

}  // namespace optim
}  // namespace ddpx
