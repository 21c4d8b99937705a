// Functional optimizers: SGD, Adam, AdamW and the elementwise optimizers (Adadelta, Adagrad,
// Adamax, RAdam, RMSprop, Rprop) as fused multi-tensor steps over a
// list of tensors (one call updates a whole shard), for the overlapped ZeRO step and the
// distributed optimizers. Results follow torch.optim's single-tensor implementation (foreach=False,
// torch's CPU default) of the torch ddpx was built against, operation by operation, with
// IEEE-rounded fma, division and sqrt: equal to torch 1.13's bit for bit; within 1 ulp per step of
// pip's torch 2.x, whose CPU sqrt is not correctly rounded (about 20% of float32 results 1 ulp
// off), which stays below 1e-6 relative over 100 steps (tests/python/test_functional_optim.py;
// measured max 2.1e-7 fp32 Adam and Adagrad, 5.1e-7 RMSprop, 4e-16 fp64; only where a problem
// amplifies torch's own rounding noise is it more: centered RMSprop with alpha 0.3, momentum and
// weight decay reaches 5e-6 fp32, as torch 2.x does against itself with an exact sqrt). CUDA
// tensors run the same element function in a CUDA kernel, so a CUDA step equals a CPU step.
//
// Tensors: float32 or float64 (float16/bfloat16 parameters are refused: keep fp32 master
// weights), dense and contiguous, a parameter's gradient and state of its dtype, device and
// shape. Work runs on the calling thread and ATen's intra-op pool on CPU, and on the device's
// current stream on CUDA (asynchronous, like torch's own ops). Not thread-safe for the same
// tensors; distinct tensor sets may be stepped concurrently.
#pragma once

#include <ATen/core/Tensor.h>
#include <ddpx/optim/elementwise/all.h>

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace ddpx {
namespace optim {

// torch.optim.SGD's hyper-parameters; validate() raises torch's ValueErrors.
struct SGDOptions {
  double lr = 1e-3;         // >= 0
  double momentum = 0;      // >= 0; 0: no momentum buffer
  double dampening = 0;     // applied from the second step on
  double weight_decay = 0;  // >= 0; L2 penalty added to the gradient
  bool nesterov = false;    // needs momentum > 0 and dampening == 0
  bool maximize = false;    // ascend instead of descend
  // Raises torch's ValueError (c10::ValueError) naming an argument out of range.
  void validate() const;
  // Calls f(name, field) for every field, named as torch's constructor argument.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("momentum", momentum), f("dampening", dampening);
    f("weight_decay", weight_decay), f("nesterov", nesterov), f("maximize", maximize);
  }
};

// torch.optim.Adam's hyper-parameters, AdamW's with decoupled_weight_decay (torch 2.x's AdamW is
// Adam with that argument set); validate() raises torch's ValueErrors.
struct AdamOptions {
  double lr = 1e-3;         // >= 0
  double beta1 = 0.9;       // in [0, 1)
  double beta2 = 0.999;     // in [0, 1)
  double eps = 1e-8;        // >= 0
  double weight_decay = 0;  // >= 0; L2 on the gradient, or with decoupling param *= 1 - lr * wd
  bool amsgrad = false;     // keep and use the running maximum of exp_avg_sq
  bool maximize = false;    // ascend instead of descend
  bool decoupled_weight_decay = false;  // AdamW's decay
  // torch.optim.AdamW's defaults: those above with weight_decay = 1e-2, decoupled.
  static AdamOptions adamw_defaults();
  // Raises torch's ValueError (c10::ValueError) naming an argument out of range.
  void validate() const;
  // f(name, field) for every field; torch's betas as beta1 and beta2.
  template <typename F>
  void for_each_field(F&& f) {
    f("lr", lr), f("beta1", beta1), f("beta2", beta2), f("eps", eps);
    f("weight_decay", weight_decay), f("amsgrad", amsgrad), f("maximize", maximize);
    f("decoupled_weight_decay", decoupled_weight_decay);
  }
};

// Every elementwise optimizer's options in ddpx::optim too: AdadeltaOptions, AdagradOptions,
// AdamaxOptions, RAdamOptions, RMSpropOptions, RpropOptions (torch.optim.Adadelta's, ...;
// elementwise/adadelta.h, ...).
#define DDPX_ELEMENTWISE_OPTIONS_NAME(Name) using elementwise::Name##Options;
DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_ELEMENTWISE_OPTIONS_NAME)
#undef DDPX_ELEMENTWISE_OPTIONS_NAME

// The hyper-parameters of any optimizer with a C++ form: the type says which (AdamOptions with
// decoupled_weight_decay is AdamW; the elementwise optimizers' options after the two).
using OptimizerOptions = elementwise::detail::VariantWithOptions<SGDOptions, AdamOptions>;

// The torch.optim class `options` stand for, in lower case: "sgd", "adam", "adamw", or an
// elementwise optimizer's Traits::kKind ("adagrad", "rmsprop", ...).
const char* optimizer_kind(const OptimizerOptions& options);

// Raises torch's ValueError (c10::ValueError) for the first value of an elementwise optimizer's
// options that torch's constructor refuses.
template <typename Options>
void validate_elementwise(const Options& options);

// One SGD step of every params[i] with grads[i]. momentum_buffers must have params.size()
// entries; with momentum, an undefined entry is created on this step as torch does (a copy of
// the gradient after weight decay, no dampening), and the vector then holds it.
void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              std::vector<at::Tensor>& momentum_buffers, const SGDOptions& opts);

// One Adam step (AdamW's with opts.decoupled_weight_decay) of every params[i] with grads[i].
// exp_avgs, exp_avg_sqs and steps must have params.size() entries, max_exp_avg_sqs too with
// amsgrad (it may be empty otherwise). Undefined state entries are created as zeros, as torch
// does on a parameter's first step (their step must then be 0). steps[i] counts params[i]'s
// steps, as torch's state["step"]; this call increments it before using it.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               std::vector<at::Tensor>& exp_avgs, std::vector<at::Tensor>& exp_avg_sqs,
               std::vector<at::Tensor>& max_exp_avg_sqs, std::vector<int64_t>& steps,
               const AdamOptions& opts);

// One step of an elementwise optimizer (ddpx/optim/elementwise/all.h) of every params[i] with
// grads[i] (dense gradients only): states[k][i] is params[i]'s state Traits::kStateNames[k].
// Every states[k] of a state the options keep (elementwise::keeps_state) has params.size()
// entries; undefined entries are created as Traits::initial_state, as torch does on a
// parameter's first step (Adagrad: in its constructor), whose step must then be 0. The list of
// a state not kept is ignored (it may be empty). steps[i] counts params[i]'s steps, as torch's
// state["step"]; this call increments it before using it.
template <typename Traits>
void elementwise_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      std::vector<std::vector<at::Tensor>>& states, std::vector<int64_t>& steps,
                      const typename Traits::Options& opts);

// elementwise_step's checks alone: raises what it would raise for these arguments (c10 errors
// with its messages), and changes nothing. ZeRO asks it for every parameter group before stepping
// any, so that a group the kernels cannot take sends the whole step to torch's optimizer.
template <typename Traits>
void elementwise_check(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<std::vector<at::Tensor>>& states,
                       const std::vector<int64_t>& steps, const typename Traits::Options& opts);

// One parameter's state in torch.optim's state_dict layout: "momentum_buffer" (SGD), or
// "step" (a 0-dim float32 tensor, as torch stores it) with "exp_avg", "exp_avg_sq" and, with
// amsgrad, "max_exp_avg_sq" (Adam, AdamW); for an elementwise optimizer "step" with the states
// its options keep, under Traits::kStateNames. Empty for a parameter never stepped (Adagrad:
// never empty, torch creates its state in the constructor).
using ParamState = std::map<std::string, at::Tensor>;

// An SGD over a fixed list of parameters, holding their state (ZeRO's shard, an RPC worker's
// parameters). Shares the parameters' storage: step() updates them in place.
class FunctionalSGD {
 public:
  // Validates `opts` (c10::ValueError as torch's); shares the storage of `params`.
  FunctionalSGD(std::vector<at::Tensor> params, SGDOptions opts);
  // Steps every parameter whose gradient is defined (grads.size() == params().size()); an
  // undefined gradient skips its parameter, as torch skips a parameter whose .grad is None.
  void step(const std::vector<at::Tensor>& grads);
  const std::vector<at::Tensor>& params() const { return params_; }
  const SGDOptions& options() const { return opts_; }
  // state()[i] is params()[i]'s state; load_state() takes the same (copied into this
  // optimizer's tensors' dtype and device).
  std::vector<ParamState> state() const;
  void load_state(const std::vector<ParamState>& state);

 private:
  std::vector<at::Tensor> params_;
  SGDOptions opts_;
  std::vector<at::Tensor> momentum_buffers_;
  std::vector<bool> stepped_;
};

// Adam or AdamW (opts.decoupled_weight_decay) over a fixed list of parameters; as FunctionalSGD.
class FunctionalAdam {
 public:
  // Validates `opts`; shares the storage of `params`. step() as FunctionalSGD's; params() and
  // options() are the constructor's; state() / load_state() copy each parameter's state in
  // torch.optim's layout.
  FunctionalAdam(std::vector<at::Tensor> params, AdamOptions opts);
  void step(const std::vector<at::Tensor>& grads);
  const std::vector<at::Tensor>& params() const { return params_; }
  const AdamOptions& options() const { return opts_; }
  std::vector<ParamState> state() const;
  void load_state(const std::vector<ParamState>& state);

 private:
  std::vector<at::Tensor> params_;
  AdamOptions opts_;
  std::vector<at::Tensor> exp_avgs_;
  std::vector<at::Tensor> exp_avg_sqs_;
  std::vector<at::Tensor> max_exp_avg_sqs_;
  std::vector<int64_t> steps_;
};

// An elementwise optimizer (Traits from ddpx/optim/elementwise/all.h) over a fixed list of
// parameters; as FunctionalSGD. Its state is "step" (a 0-dim float32 tensor, as torch stores it)
// and the Traits::kStateNames its options keep, created on a parameter's first step, or in the
// constructor where torch's constructor creates it (Adagrad: state() then lists every parameter
// from the start, and load_state() gives an empty entry the constructor's fresh state).
template <typename Traits>
class FunctionalElementwise {
 public:
  using Options = typename Traits::Options;  // its hyper-parameters
  // Validates `opts` (c10::ValueError as torch's); shares the storage of `params`.
  FunctionalElementwise(std::vector<at::Tensor> params, Options opts);
  void step(const std::vector<at::Tensor>& grads);
  const std::vector<at::Tensor>& params() const { return params_; }
  const Options& options() const { return opts_; }
  std::vector<ParamState> state() const;
  void load_state(const std::vector<ParamState>& state);

 private:
  // Fills params_[i]'s states in `states` as torch makes them (Traits::initial_state).
  void fresh_state(size_t i, std::vector<std::vector<at::Tensor>>& states) const;

  std::vector<at::Tensor> params_;
  Options opts_;
  std::vector<std::vector<at::Tensor>> states_;  // [k][i]: params_[i]'s state kStateNames[k]
  std::vector<int64_t> steps_;
};

// Every elementwise optimizer's functional class: FunctionalAdadelta, FunctionalAdagrad,
// FunctionalAdamax, FunctionalRAdam, FunctionalRMSprop, FunctionalRprop (torch.optim.Adadelta,
// ...).
#define DDPX_FUNCTIONAL_ELEMENTWISE_NAME(Name) \
  using Functional##Name = FunctionalElementwise<elementwise::Name>;
DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_FUNCTIONAL_ELEMENTWISE_NAME)
#undef DDPX_FUNCTIONAL_ELEMENTWISE_NAME

}  // namespace optim
}  // namespace ddpx
