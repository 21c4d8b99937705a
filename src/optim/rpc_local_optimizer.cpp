// The owner side of the RPC DistributedOptimizer. See include/ddpx/optim/rpc_local_optimizer.h.
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/rpc_local_optimizer.h>

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>

namespace ddpx {
namespace optim {
namespace {

struct Registry {
  std::mutex mutex;  // guards `optimizers` and `next_id`
  std::unordered_map<int64_t, std::shared_ptr<RpcLocalOptimizer>> optimizers;
  int64_t next_id = 1;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: steps may run during teardown
  return *r;
}

// One step at a time in this process (torch's _LocalOptimizer.global_lock).
std::mutex& step_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}

template <typename F>
std::shared_ptr<RpcLocalOptimizer> wrap(std::string kind, std::shared_ptr<F> f) {
  return std::make_shared<RpcLocalOptimizer>(
      std::move(kind), f->params(), [f](const std::vector<at::Tensor>& g) { f->step(g); },
      [f] { return f->state(); });
}

}  // namespace

RpcLocalOptimizer::RpcLocalOptimizer(std::string kind, std::vector<at::Tensor> params, StepFn step,
                                     StateFn state)
    : kind_(std::move(kind)),
      params_(std::move(params)),
      step_(std::move(step)),
      state_(std::move(state)) {
  for (const at::Tensor& p : params_) {
    const c10::Device d = p.device();
    if (d.is_cpu() || std::find(devices_.begin(), devices_.end(), d) != devices_.end()) continue;
    devices_.push_back(d);
  }
}

void RpcLocalOptimizer::step(const c10::Dict<at::Tensor, at::Tensor>& grads) {
  std::vector<at::Tensor> ordered(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto it = grads.find(params_[i]);
    if (it != grads.end()) ordered[i] = it->value();
  }
  step_(ordered);
  for (const c10::Device& d : devices_) {
    c10::impl::getDeviceGuardImpl(d.type())->getStream(d).synchronize();
  }
}

std::shared_ptr<RpcLocalOptimizer> make_rpc_local_optimizer(std::vector<at::Tensor> params,
                                                            const OptimizerOptions& options) {
  // The functional optimizers' constructors validate the options (torch's ValueErrors).
  const char* kind = optimizer_kind(options);
  return std::visit(
      [&](const auto& o) -> std::shared_ptr<RpcLocalOptimizer> {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, SGDOptions>) {
          return wrap(kind, std::make_shared<FunctionalSGD>(std::move(params), o));
        } else if constexpr (std::is_same_v<O, AdamOptions>) {
          return wrap(kind, std::make_shared<FunctionalAdam>(std::move(params), o));
        } else {  // an elementwise optimizer (ddpx/optim/elementwise/all.h)
          return wrap(kind, std::make_shared<FunctionalElementwise<typename O::Traits>>(
                                std::move(params), o));
        }
      },
      options);
}

int64_t register_rpc_local_optimizer(std::shared_ptr<RpcLocalOptimizer> optimizer) {
  TORCH_CHECK_VALUE(optimizer != nullptr, "register_rpc_local_optimizer: null optimizer");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t id = r.next_id++;
  r.optimizers.emplace(id, std::move(optimizer));
  return id;
}

void unregister_rpc_local_optimizer(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.optimizers.erase(id);
}

std::shared_ptr<RpcLocalOptimizer> rpc_local_optimizer(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.optimizers.find(id);
  TORCH_CHECK_VALUE(it != r.optimizers.end(), "DistributedOptimizer: no local optimizer ", id,
                    " on this worker (it was deleted, or this worker restarted)");
  return it->second;
}

void step_rpc_local_optimizer(int64_t id, const c10::Dict<at::Tensor, at::Tensor>& grads) {
  std::shared_ptr<RpcLocalOptimizer> optimizer = rpc_local_optimizer(id);
  std::lock_guard<std::mutex> lock(step_mutex());
  optimizer->step(grads);
}

}  // namespace optim
}  // namespace ddpx
