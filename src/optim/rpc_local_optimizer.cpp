// The owner side of the RPC DistributedOptimizer. See include/ddpx/optim/rpc_local_optimizer.h.
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/rpc_local_optimizer.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>

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

// Reads the arguments one by one and refuses any left over (a misspelt or unsupported one).
class ArgReader {
 public:
  ArgReader(const std::string& kind, const OptimizerArgs& args) : kind_(kind), left_(args) {}
  void operator()(const std::string& name, double& out) {
    auto it = left_.find(name);
    if (it == left_.end()) return;
    out = it->second;
    left_.erase(it);
  }
  void operator()(const std::string& name, bool& out) {
    double v = out ? 1 : 0;
    (*this)(name, v);
    TORCH_CHECK_VALUE(v == 0 || v == 1, "DistributedOptimizer (", kind_, "): ", name,
                      " must be a boolean, got ", v);
    out = v != 0;
  }
  void done() const {
    TORCH_CHECK_VALUE(left_.empty(), "DistributedOptimizer (", kind_, "): unsupported argument '",
                      left_.empty() ? "" : left_.begin()->first, "' for the C++ optimizer");
  }

 private:
  std::string kind_;
  OptimizerArgs left_;
};

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

std::shared_ptr<RpcLocalOptimizer> make_rpc_local_optimizer(const std::string& kind,
                                                            std::vector<at::Tensor> params,
                                                            const OptimizerArgs& args) {
  // Options start from torch's defaults (SGD: lr 1e-3, torch's own since 2.x; 1.13 requires
  // it and the Python class always passes it), take `args` field by field and refuse the rest.
  auto build = [&](auto options, auto make) {
    ArgReader read(kind, args);
    options.for_each_field(read);
    read.done();
    options.validate();
    return wrap(kind, make(std::move(params), options));
  };
  if (kind == "sgd") {
    return build(SGDOptions(), [](std::vector<at::Tensor> p, const SGDOptions& o) {
      return std::make_shared<FunctionalSGD>(std::move(p), o);
    });
  }
  if (kind == "adam" || kind == "adamw") {
    const bool adamw = kind == "adamw";
    return build(adamw ? AdamOptions::adamw_defaults() : AdamOptions(),
                 [adamw](std::vector<at::Tensor> p, const AdamOptions& o) {
                   return std::make_shared<FunctionalAdam>(std::move(p), o, adamw);
                 });
  }
  if (kind == "adagrad") {
    return build(AdagradOptions(), [](std::vector<at::Tensor> p, const AdagradOptions& o) {
      return std::make_shared<FunctionalAdagrad>(std::move(p), o);
    });
  }
  if (kind == "rmsprop") {
    return build(RMSpropOptions(), [](std::vector<at::Tensor> p, const RMSpropOptions& o) {
      return std::make_shared<FunctionalRMSprop>(std::move(p), o);
    });
  }
  TORCH_CHECK_VALUE(false, "DistributedOptimizer: no C++ optimizer '", kind,
                    "' (sgd, adam, adamw, adagrad, rmsprop)");
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
