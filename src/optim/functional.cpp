#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/functional.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include "common/compat_internal.h"
#include "ops/elementwise_optim.h"
#include "ops/optim.h"

namespace ddpx {
namespace optim {
namespace {

// Checks that `t` (a gradient or a state tensor of params[i]) can be updated with it.
void check_like(const at::Tensor& param, const at::Tensor& t, const char* op, const char* what,
                size_t i) {
  TORCH_CHECK(t.defined(), op, ": ", what, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", what, "[", i, "] must be dense, got layout ",
              t.layout());
  TORCH_CHECK(t.device() == param.device(), op, ": ", what, "[", i, "] is on ", t.device(),
              " but params[", i, "] is on ", param.device());
  TORCH_CHECK(t.scalar_type() == param.scalar_type(), op, ": ", what, "[", i, "] has dtype ",
              t.scalar_type(), " but params[", i, "] has dtype ", param.scalar_type());
  TORCH_CHECK(t.sizes() == param.sizes(), op, ": ", what, "[", i, "] has shape ", t.sizes(),
              " but params[", i, "] has shape ", param.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, "[", i,
              "] must be contiguous (the kernels update memory in one flat pass)");
}

void check_param(const at::Tensor& p, const char* op, size_t i) {
  TORCH_CHECK(p.defined(), op, ": params[", i, "] is undefined");
  TORCH_CHECK(p.layout() == at::kStrided, op, ": params[", i, "] must be dense, got layout ",
              p.layout());
  TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble, op, ": params[", i,
              "] has dtype ", p.scalar_type(),
              "; only float32 and float64 are supported (keep fp32 master weights for 16-bit "
              "models)");
  TORCH_CHECK(p.device().is_cpu() || p.device().is_cuda(), op, ": params[", i,
              "] must be a CPU or CUDA tensor, got ", p.device());
  TORCH_CHECK(p.is_contiguous(), op, ": params[", i,
              "] must be contiguous (the kernels update memory in one flat pass)");
}

void check_count(size_t n, size_t got, const char* op, const char* what) {
  TORCH_CHECK_VALUE(got == n, op, ": ", what, " has ", got, " entries but params has ", n);
}

}  // namespace

// ---- options --------------------------------------------------------------------------------

void SGDOptions::validate() const {
  // torch.optim.SGD's checks, in its order and with its messages.
  TORCH_CHECK_VALUE(!(lr < 0.0), "Invalid learning rate: ", lr);
  TORCH_CHECK_VALUE(!(momentum < 0.0), "Invalid momentum value: ", momentum);
  TORCH_CHECK_VALUE(!(weight_decay < 0.0), "Invalid weight_decay value: ", weight_decay);
  TORCH_CHECK_VALUE(!(nesterov && (momentum <= 0 || dampening != 0)),
                    "Nesterov momentum requires a momentum and zero dampening");
}

AdamOptions AdamOptions::adamw_defaults() {
  AdamOptions o;
  o.weight_decay = 1e-2;
  o.decoupled_weight_decay = true;
  return o;
}

void AdamOptions::validate() const {
  // torch.optim.Adam's (and AdamW's) checks: `not 0.0 <= x`, so NaN is refused too.
  TORCH_CHECK_VALUE(0.0 <= lr, "Invalid learning rate: ", lr);
  TORCH_CHECK_VALUE(0.0 <= eps, "Invalid epsilon value: ", eps);
  TORCH_CHECK_VALUE(0.0 <= beta1 && beta1 < 1.0, "Invalid beta parameter at index 0: ", beta1);
  TORCH_CHECK_VALUE(0.0 <= beta2 && beta2 < 1.0, "Invalid beta parameter at index 1: ", beta2);
  TORCH_CHECK_VALUE(0.0 <= weight_decay, "Invalid weight_decay value: ", weight_decay);
}

const char* optimizer_kind(const OptimizerOptions& options) {
  return std::visit(
      [](const auto& o) -> const char* {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, SGDOptions>) {
          return "sgd";
        } else if constexpr (std::is_same_v<O, AdamOptions>) {
          return o.decoupled_weight_decay ? "adamw" : "adam";
        } else {
          return O::Traits::kKind;
        }
      },
      options);
}

template <typename Options>
void validate_elementwise(const Options& options) {
  options.check([](const auto&... message) { TORCH_CHECK_VALUE(false, message...); });
}

// ---- steps ----------------------------------------------------------------------------------

void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              std::vector<at::Tensor>& momentum_buffers, const SGDOptions& opts) {
  constexpr const char* kOp = "ddpx::optim::sgd_step";
  opts.validate();
  const size_t n = params.size();
  check_count(n, grads.size(), kOp, "grads");
  check_count(n, momentum_buffers.size(), kOp, "momentum_buffers");
  const bool momentum = opts.momentum != 0;
  // Everything is checked before anything is written: a bad entry leaves all tensors as they were.
  for (size_t i = 0; i < n; ++i) {
    check_param(params[i], kOp, i);
    check_like(params[i], grads[i], kOp, "grads", i);
    if (momentum && momentum_buffers[i].defined()) {
      check_like(params[i], momentum_buffers[i], kOp, "momentum_buffers", i);
    }
  }
  kernels::SgdScalars s;
  s.lr = opts.lr;
  s.momentum = opts.momentum;
  s.dampening = opts.dampening;
  s.weight_decay = opts.weight_decay;
  s.nesterov = opts.nesterov;
  s.maximize = opts.maximize;
  std::vector<kernels::SgdScalars> per(n, s);
  std::vector<at::Tensor> bufs(n);
  for (size_t i = 0; i < n; ++i) {
    per[i].init_buffer = momentum && !momentum_buffers[i].defined();
    if (per[i].init_buffer) momentum_buffers[i] = at::empty_like(params[i]);  // written, not read
    if (momentum) bufs[i] = momentum_buffers[i];
  }
  ops::sgd_update_multi(params, grads, bufs, per);
}

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               std::vector<at::Tensor>& exp_avgs, std::vector<at::Tensor>& exp_avg_sqs,
               std::vector<at::Tensor>& max_exp_avg_sqs, std::vector<int64_t>& steps,
               const AdamOptions& opts) {
  const char* kOp =
      opts.decoupled_weight_decay ? "ddpx::optim::adamw_step" : "ddpx::optim::adam_step";
  opts.validate();
  const size_t n = params.size();
  check_count(n, grads.size(), kOp, "grads");
  check_count(n, exp_avgs.size(), kOp, "exp_avgs");
  check_count(n, exp_avg_sqs.size(), kOp, "exp_avg_sqs");
  check_count(n, steps.size(), kOp, "steps");
  if (opts.amsgrad) check_count(n, max_exp_avg_sqs.size(), kOp, "max_exp_avg_sqs");
  for (size_t i = 0; i < n; ++i) {
    check_param(params[i], kOp, i);
    check_like(params[i], grads[i], kOp, "grads", i);
    TORCH_CHECK_VALUE(steps[i] >= 0, kOp, ": steps[", i, "] must be >= 0, got ", steps[i]);
    const bool fresh = !exp_avgs[i].defined() || !exp_avg_sqs[i].defined() ||
                       (opts.amsgrad && !max_exp_avg_sqs[i].defined());
    if (fresh) {
      TORCH_CHECK_VALUE(steps[i] == 0 && !exp_avgs[i].defined() && !exp_avg_sqs[i].defined(), kOp,
                        ": params[", i, "] has part of its state only (step ", steps[i],
                        "); give exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad) or none");
    } else {
      check_like(params[i], exp_avgs[i], kOp, "exp_avgs", i);
      check_like(params[i], exp_avg_sqs[i], kOp, "exp_avg_sqs", i);
      if (opts.amsgrad) check_like(params[i], max_exp_avg_sqs[i], kOp, "max_exp_avg_sqs", i);
    }
  }
  kernels::AdamScalars s;
  s.lr = opts.lr;
  s.beta1 = opts.beta1;
  s.beta2 = opts.beta2;
  s.eps = opts.eps;
  s.weight_decay = opts.weight_decay;
  s.amsgrad = opts.amsgrad;
  s.maximize = opts.maximize;
  s.decoupled_weight_decay = opts.decoupled_weight_decay;
  s.formula =
      compat::kAdamLerpsExpAvg ? kernels::AdamFormula::kTorch2 : kernels::AdamFormula::kTorch1;
  std::vector<kernels::AdamScalars> per(n, s);
  std::vector<at::Tensor> maxes(n);
  for (size_t i = 0; i < n; ++i) {
    if (!exp_avgs[i].defined()) exp_avgs[i] = at::zeros_like(params[i]);
    if (!exp_avg_sqs[i].defined()) exp_avg_sqs[i] = at::zeros_like(params[i]);
    if (opts.amsgrad && !max_exp_avg_sqs[i].defined()) {
      max_exp_avg_sqs[i] = at::zeros_like(params[i]);
    }
    if (opts.amsgrad) maxes[i] = max_exp_avg_sqs[i];
    // torch keeps the step in a float32 tensor and computes the corrections in Python floats.
    steps[i] += 1;
    const double step = static_cast<double>(static_cast<float>(steps[i]));
    const double bias_correction1 = 1 - std::pow(opts.beta1, step);
    const double bias_correction2 = 1 - std::pow(opts.beta2, step);
    per[i].step_size = opts.lr / bias_correction1;
    per[i].bias_correction2_sqrt =
        compat::kAdamLerpsExpAvg ? std::pow(bias_correction2, 0.5) : std::sqrt(bias_correction2);
  }
  ops::adam_update_multi(params, grads, exp_avgs, exp_avg_sqs, maxes, per);
}

// ---- stateful wrappers ----------------------------------------------------------------------

namespace {

// The parameters whose gradient is defined, with their indices.
std::vector<size_t> stepped_indices(const std::vector<at::Tensor>& params,
                                    const std::vector<at::Tensor>& grads, const char* op) {
  check_count(params.size(), grads.size(), op, "grads");
  std::vector<size_t> idx;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) idx.push_back(i);
  }
  return idx;
}

template <typename T>
std::vector<T> pick(const std::vector<T>& v, const std::vector<size_t>& idx) {
  std::vector<T> out;
  out.reserve(idx.size());
  for (size_t i : idx) out.push_back(v[i]);
  return out;
}

template <typename T>
void put(std::vector<T>& v, const std::vector<size_t>& idx, const std::vector<T>& picked) {
  for (size_t k = 0; k < idx.size(); ++k) v[idx[k]] = picked[k];
}

// A loaded state tensor, as the parameter's dtype, device and layout (torch's load_state_dict
// casts state to the parameter the same way).
at::Tensor state_like(const at::Tensor& param, const ParamState& st, const char* key,
                      const char* op, size_t i) {
  auto it = st.find(key);
  if (it == st.end() || !it->second.defined()) return at::Tensor();
  const at::Tensor& t = it->second;
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), op, ": state[", i, "][\"", key, "\"] has shape ",
                    t.sizes(), " but the parameter has shape ", param.sizes());
  return t.to(param.device(), param.scalar_type(), /*non_blocking=*/false, /*copy=*/true)
      .contiguous();
}

}  // namespace

FunctionalSGD::FunctionalSGD(std::vector<at::Tensor> params, SGDOptions opts)
    : params_(std::move(params)), opts_(opts), momentum_buffers_(params_.size()) {
  opts_.validate();
  for (size_t i = 0; i < params_.size(); ++i) check_param(params_[i], "FunctionalSGD", i);
}

void FunctionalSGD::step(const std::vector<at::Tensor>& grads) {
  const auto idx = stepped_indices(params_, grads, "FunctionalSGD.step");
  std::vector<at::Tensor> bufs = pick(momentum_buffers_, idx);
  sgd_step(pick(params_, idx), pick(grads, idx), bufs, opts_);
  put(momentum_buffers_, idx, bufs);
}

std::vector<ParamState> FunctionalSGD::state() const {
  std::vector<ParamState> out(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (momentum_buffers_[i].defined()) out[i]["momentum_buffer"] = momentum_buffers_[i];
  }
  return out;
}

void FunctionalSGD::load_state(const std::vector<ParamState>& state) {
  check_count(params_.size(), state.size(), "FunctionalSGD.load_state", "state");
  std::vector<at::Tensor> bufs(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    bufs[i] = state_like(params_[i], state[i], "momentum_buffer", "FunctionalSGD.load_state", i);
  }
  momentum_buffers_ = std::move(bufs);
}

FunctionalAdam::FunctionalAdam(std::vector<at::Tensor> params, AdamOptions opts)
    : params_(std::move(params)),
      opts_(opts),
      exp_avgs_(params_.size()),
      exp_avg_sqs_(params_.size()),
      max_exp_avg_sqs_(params_.size()),
      steps_(params_.size(), 0) {
  opts_.validate();
  for (size_t i = 0; i < params_.size(); ++i) check_param(params_[i], "FunctionalAdam", i);
}

void FunctionalAdam::step(const std::vector<at::Tensor>& grads) {
  const auto idx = stepped_indices(params_, grads, "FunctionalAdam.step");
  std::vector<at::Tensor> m = pick(exp_avgs_, idx), v = pick(exp_avg_sqs_, idx),
                          vmax = pick(max_exp_avg_sqs_, idx);
  std::vector<int64_t> steps = pick(steps_, idx);
  adam_step(pick(params_, idx), pick(grads, idx), m, v, vmax, steps, opts_);
  put(exp_avgs_, idx, m);
  put(exp_avg_sqs_, idx, v);
  put(max_exp_avg_sqs_, idx, vmax);
  put(steps_, idx, steps);
}

std::vector<ParamState> FunctionalAdam::state() const {
  std::vector<ParamState> out(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!exp_avgs_[i].defined()) continue;
    out[i]["step"] = at::scalar_tensor(static_cast<double>(steps_[i]), at::kFloat);
    out[i]["exp_avg"] = exp_avgs_[i];
    out[i]["exp_avg_sq"] = exp_avg_sqs_[i];
    if (opts_.amsgrad) out[i]["max_exp_avg_sq"] = max_exp_avg_sqs_[i];
  }
  return out;
}

void FunctionalAdam::load_state(const std::vector<ParamState>& state) {
  constexpr const char* kOp = "FunctionalAdam.load_state";
  check_count(params_.size(), state.size(), kOp, "state");
  std::vector<at::Tensor> m(params_.size()), v(params_.size()), vmax(params_.size());
  std::vector<int64_t> steps(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamState& st = state[i];
    if (st.empty()) continue;
    auto step = st.find("step");
    TORCH_CHECK_VALUE(step != st.end() && step->second.defined() && step->second.numel() == 1, kOp,
                      ": state[", i, "] has no \"step\"");
    steps[i] = static_cast<int64_t>(step->second.item<double>());
    m[i] = state_like(params_[i], st, "exp_avg", kOp, i);
    v[i] = state_like(params_[i], st, "exp_avg_sq", kOp, i);
    TORCH_CHECK_VALUE(m[i].defined() && v[i].defined(), kOp, ": state[", i,
                      "] needs \"exp_avg\" and \"exp_avg_sq\"");
    vmax[i] = state_like(params_[i], st, "max_exp_avg_sq", kOp, i);
    TORCH_CHECK_VALUE(!opts_.amsgrad || vmax[i].defined(), kOp, ": state[", i,
                      "] needs \"max_exp_avg_sq\" with amsgrad");
  }
  exp_avgs_ = std::move(m);
  exp_avg_sqs_ = std::move(v);
  max_exp_avg_sqs_ = std::move(vmax);
  steps_ = std::move(steps);
}

namespace {

// A loaded "step": a one-element tensor (torch's 0-dim float32, or what a Python number became).
int64_t step_of(const ParamState& st, const char* op, size_t i) {
  auto step = st.find("step");
  TORCH_CHECK_VALUE(step != st.end() && step->second.defined() && step->second.numel() == 1, op,
                    ": state[", i, "] has no \"step\"");
  const double value = step->second.item<double>();
  TORCH_CHECK_VALUE(value >= 0 && value == std::floor(value), op, ": state[", i,
                    "][\"step\"] must be a whole number >= 0, got ", value);
  return static_cast<int64_t>(value);
}

at::Tensor step_tensor(int64_t step) {
  return at::scalar_tensor(static_cast<double>(step), at::kFloat);
}

}  // namespace

// ---- the elementwise optimizers ---------------------------------------------------------------

template <typename Traits>
void elementwise_check(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<std::vector<at::Tensor>>& states,
                       const std::vector<int64_t>& steps, const typename Traits::Options& opts) {
  const std::string op = std::string("ddpx::optim::") + Traits::kKind + "_step";
  const char* kOp = op.c_str();
  constexpr int K = Traits::kStates;
  validate_elementwise(opts);
  const size_t n = params.size();
  check_count(n, grads.size(), kOp, "grads");
  check_count(n, steps.size(), kOp, "steps");
  TORCH_CHECK_VALUE(states.size() == static_cast<size_t>(K), kOp, ": states has ", states.size(),
                    " lists but ", Traits::kName, " keeps ", K);
  // The states these options keep; the others' lists are not read.
  std::vector<int> kept;
  for (int k = 0; k < K; ++k) {
    if (!elementwise::keeps_state<Traits>(k, opts)) continue;
    kept.push_back(k);
    check_count(n, states[k].size(), kOp, Traits::kStateNames[k]);
  }
  const int all = static_cast<int>(kept.size());
  for (size_t i = 0; i < n; ++i) {
    check_param(params[i], kOp, i);
    check_like(params[i], grads[i], kOp, "grads", i);  // a sparse gradient fails here
    TORCH_CHECK_VALUE(steps[i] >= 0, kOp, ": steps[", i, "] must be >= 0, got ", steps[i]);
    int defined = 0;
    for (int k : kept) defined += states[k][i].defined() ? 1 : 0;
    TORCH_CHECK_VALUE(defined == 0 || defined == all, kOp, ": params[", i,
                      "] has part of its state only; give all of it or none");
    TORCH_CHECK_VALUE(defined == all || steps[i] == 0, kOp, ": params[", i, "] has step ", steps[i],
                      " but no state");
    for (int k : kept) {
      if (defined == all) check_like(params[i], states[k][i], kOp, Traits::kStateNames[k], i);
    }
  }
}

template <typename Traits>
void elementwise_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      std::vector<std::vector<at::Tensor>>& states, std::vector<int64_t>& steps,
                      const typename Traits::Options& opts) {
  // Everything is checked before anything is written.
  elementwise_check<Traits>(params, grads, states, steps, opts);
  constexpr int K = Traits::kStates;
  const size_t n = params.size();
  std::vector<at::Tensor> tensor_states(K);  // undefined where a state is not kept
  for (size_t i = 0; i < n; ++i) {
    for (int k = 0; k < K; ++k) {
      if (!elementwise::keeps_state<Traits>(k, opts)) continue;
      if (!states[k][i].defined()) {
        states[k][i] = at::full_like(params[i], Traits::initial_state(k, opts));
      }
      tensor_states[k] = states[k][i];
    }
    ++steps[i];
    ops::elementwise_update<Traits>(params[i], grads[i], tensor_states, opts, steps[i]);
  }
}

template <typename Traits>
FunctionalElementwise<Traits>::FunctionalElementwise(std::vector<at::Tensor> params, Options opts)
    : params_(std::move(params)),
      opts_(opts),
      states_(Traits::kStates, std::vector<at::Tensor>(params_.size())),
      steps_(params_.size(), 0) {
  validate_elementwise(opts_);
  const std::string op = std::string("Functional") + Traits::kName;
  for (size_t i = 0; i < params_.size(); ++i) check_param(params_[i], op.c_str(), i);
  if (elementwise::StateFromConstructor<Traits>::value) {
    for (size_t i = 0; i < params_.size(); ++i) fresh_state(i, states_);
  }
}

template <typename Traits>
void FunctionalElementwise<Traits>::fresh_state(
    size_t i, std::vector<std::vector<at::Tensor>>& states) const {
  for (int k = 0; k < Traits::kStates; ++k) {
    if (elementwise::keeps_state<Traits>(k, opts_)) {
      states[k][i] = at::full_like(params_[i], Traits::initial_state(k, opts_));
    }
  }
}

template <typename Traits>
void FunctionalElementwise<Traits>::step(const std::vector<at::Tensor>& grads) {
  const std::string op = std::string("Functional") + Traits::kName + ".step";
  const auto idx = stepped_indices(params_, grads, op.c_str());
  std::vector<std::vector<at::Tensor>> states;
  for (const auto& s : states_) states.push_back(pick(s, idx));
  std::vector<int64_t> steps = pick(steps_, idx);
  elementwise_step<Traits>(pick(params_, idx), pick(grads, idx), states, steps, opts_);
  for (int k = 0; k < Traits::kStates; ++k) put(states_[k], idx, states[k]);
  put(steps_, idx, steps);
}

template <typename Traits>
std::vector<ParamState> FunctionalElementwise<Traits>::state() const {
  std::vector<ParamState> out(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!states_[0][i].defined()) continue;  // state 0 is always kept
    out[i]["step"] = step_tensor(steps_[i]);
    for (int k = 0; k < Traits::kStates; ++k) {
      if (states_[k][i].defined()) out[i][Traits::kStateNames[k]] = states_[k][i];
    }
  }
  return out;
}

template <typename Traits>
void FunctionalElementwise<Traits>::load_state(const std::vector<ParamState>& state) {
  const std::string op = std::string("Functional") + Traits::kName + ".load_state";
  const char* kOp = op.c_str();
  check_count(params_.size(), state.size(), kOp, "state");
  const size_t n = params_.size();
  std::vector<std::vector<at::Tensor>> states(Traits::kStates, std::vector<at::Tensor>(n));
  std::vector<int64_t> steps(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const ParamState& st = state[i];
    if (st.empty()) {
      if (elementwise::StateFromConstructor<Traits>::value) fresh_state(i, states);
      continue;
    }
    steps[i] = step_of(st, kOp, i);
    for (int k = 0; k < Traits::kStates; ++k) {
      if (!elementwise::keeps_state<Traits>(k, opts_)) continue;
      states[k][i] = state_like(params_[i], st, Traits::kStateNames[k], kOp, i);
      TORCH_CHECK_VALUE(states[k][i].defined(), kOp, ": state[", i, "] needs \"",
                        Traits::kStateNames[k], "\"");
    }
  }
  states_ = std::move(states);
  steps_ = std::move(steps);
}

#define DDPX_INSTANTIATE(Name)                                                  \
  template void validate_elementwise<elementwise::Name::Options>(               \
      const elementwise::Name::Options&);                                       \
  template void elementwise_step<elementwise::Name>(                            \
      const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,           \
      std::vector<std::vector<at::Tensor>>&, std::vector<int64_t>&,             \
      const elementwise::Name::Options&);                                       \
  template void elementwise_check<elementwise::Name>(                           \
      const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,           \
      const std::vector<std::vector<at::Tensor>>&, const std::vector<int64_t>&, \
      const elementwise::Name::Options&);                                       \
  template class FunctionalElementwise<elementwise::Name>;
DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_INSTANTIATE)
#undef DDPX_INSTANTIATE

}  // namespace optim
}  // namespace ddpx
