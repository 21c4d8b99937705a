// DiLoCo (Douillard et al., arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512): each
// replica takes sync_every inner steps with its own optimizer, then the outer gradient (the
// global parameters minus the local ones) is averaged over the process group and applied to the
// global parameters by an outer optimizer (SGD, lr 0.7, momentum 0.9, Nesterov by default);
// every replica continues from the new global parameters.
//
//   auto inner = std::make_shared<torch::optim::AdamW>(model->parameters(), ...);
//   ddpx::optim::DiLoCoOptions o;
//   o.sync_every = 32;
//   o.bits = 4;  // the outer gradients quantized with error feedback
//   ddpx::optim::DiLoCo opt(inner, pg, o);
//   for (...) { opt.zero_grad(); loss.backward(); opt.step(); }
//
// Streaming: the parameters are cut into `fragments` contiguous groups of about equal size,
// synchronized at staggered steps (fragment f at steps (f + 1) * H / P + k * H); with
// fragment_sync_delay tau > 0 a fragment's exchange stays in flight through tau more inner steps
// and its outer step is applied then, the local values mixed in by fragment_update_alpha:
// local = alpha * local + (1 - alpha) * global.
//
// DiLoCoSync is the synchronization alone (the schedule, the global parameters, the exchange,
// the mixing), for callers that step the inner and the outer optimizers themselves (ddpx's
// Python DiLoCo, over any torch optimizers); DiLoCo is the whole optimizer, with torch::optim's
// inner optimizer and SGD as the outer one, in C++.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ddpx/common/process_group.h>
#include <ddpx/optim/functional.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace ddpx {
namespace optim {

struct DiLoCoOptions {
  // H: inner steps between two synchronizations of a fragment; >= 1 and >= fragments.
  int64_t sync_every = 0;
  // P: contiguous groups of parameters synchronized at staggered steps; 1 <= P <= parameters.
  int64_t fragments = 1;
  // tau: inner steps a fragment's exchange stays in flight before its outer step; 0 <= tau < H.
  int64_t fragment_sync_delay = 0;
  // alpha in [0, 1]: the share of the local values kept when a fragment takes its new global
  // values (0: the global values alone, DiLoCo's).
  double fragment_update_alpha = 0.0;
  // How outer gradients travel: 32 (fp32, allreduce_hook), 16 (bf16, bf16_compress_hook), or 8,
  // 4, 2, 1 (quantized_hook: a scale per block_size values, error feedback per rank, exchanged
  // reduce-scatter style from three ranks on).
  int64_t bits = 32;
  // Values per scale of the quantized outer gradients (quantized_hook's block_size).
  int64_t block_size = 256;
  // Keep each rank's quantization error and add it to the fragment's next outer gradient.
  bool use_error_feedback = true;
  // Parameters are exchanged in buckets of about this many bytes (whole parameters: one larger
  // than this travels alone), each a GradBucket for the hook.
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;
  // c10::ValueError naming the first option out of range.
  void validate() const;
  // f(name, value) for every option (int64_t, double or bool), in declaration order: what the
  // ranks compare, what a checkpoint records and what a load must match.
  template <typename F>
  void for_each_field(F&& f) const {
    f("sync_every", sync_every), f("fragments", fragments);
    f("fragment_sync_delay", fragment_sync_delay);
    f("fragment_update_alpha", fragment_update_alpha), f("bits", bits);
    f("block_size", block_size), f("use_error_feedback", use_error_feedback);
    f("bucket_cap_bytes", bucket_cap_bytes);
  }
};

class DiLoCoSync {
 public:
  // `params`: the replicated parameters (every rank the same shapes, in the same order); their
  // current values become the global parameters. `process_group` must not be null. Throws
  // c10::ValueError for bad options or parameters.
  DiLoCoSync(std::vector<at::Tensor> params, ProcessGroupPtr process_group, DiLoCoOptions options);
  ~DiLoCoSync();
  DiLoCoSync(const DiLoCoSync&) = delete;
  DiLoCoSync& operator=(const DiLoCoSync&) = delete;

  // Call after every inner step: counts it, starts the exchange of each fragment due to
  // synchronize at this step, and returns the fragments whose outer step is due now (in order);
  // run it for each (outer_sgd_step, or begin_outer / your optimizer's step / end_outer).
  std::vector<int64_t> after_inner_step();

  // A fragment's outer step with any optimizer: begin_outer waits for the fragment's exchange,
  // sets each of its parameters to the global values with the averaged outer gradient as its
  // gradient, and every other parameter's gradient undefined; step an optimizer over the
  // parameters (those without a gradient are skipped); end_outer takes the result as the new
  // global values, mixes the local values in (fragment_update_alpha) and gives every parameter
  // its gradient back.
  void begin_outer(int64_t fragment);
  void end_outer(int64_t fragment);
  // The same with SGD, in C++. momentum_buffers: one entry per parameter (all fragments'), as
  // sgd_step keeps them.
  void outer_sgd_step(int64_t fragment, const SGDOptions& options,
                      std::vector<at::Tensor>& momentum_buffers);

  // Inner steps counted so far.
  int64_t step() const { return step_; }
  const DiLoCoOptions& options() const { return options_; }
  const ProcessGroupPtr& process_group() const { return pg_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  // Parameter index ranges [begin, end) of the fragments.
  std::vector<std::pair<int64_t, int64_t>> fragment_ranges() const;
  // The step of fragment f's first synchronization ((f + 1) * H / P; then every H steps).
  int64_t first_sync_step(int64_t fragment) const;
  // The global parameters (the values after the last outer step of each fragment).
  const std::vector<at::Tensor>& global_params() const { return global_; }
  // Fragments whose exchange has started and whose outer step has not run.
  std::vector<int64_t> pending() const;
  // Bytes of the messages this rank has made of outer gradients so far: values times 4 (fp32)
  // or 2 (bf16), quantized the blocks' codes and scales. (What crosses the wire per message:
  // its size on 2 ranks, 2 (W - 1) / W of it reduce-scatter style.)
  int64_t message_bytes() const { return message_bytes_; }

  // {"format", the options, "step", "rank", "world_size", "global": {parameter index: tensor},
  // "pending": {fragment: {"due", "outer_gradient"}} (their exchanges waited for first: an
  // averaged outer gradient resumes bit for bit), "quantized": {fragment: quantized state}}.
  c10::impl::GenericDict state_dict();
  // Restores state_dict()'s content. The residuals are one rank's own: saved by another rank or
  // at another world size, a c10::ValueError unless `allow_reshard` (then they restart from
  // zero, with a warning). Options must match (c10::ValueError naming the option).
  void load_state_dict(const c10::impl::GenericDict& state, bool allow_reshard = false);

 private:
  struct Fragment;
  void start_exchange(Fragment& f);
  void wait_exchange(Fragment& f);
  void check_fragment(int64_t fragment) const;

  std::vector<at::Tensor> params_;
  ProcessGroupPtr pg_;
  DiLoCoOptions options_;
  std::vector<at::Tensor> global_;
  std::vector<std::unique_ptr<Fragment>> fragments_;
  int64_t step_ = 0;
  int64_t message_bytes_ = 0;
  bool agreed_ = false;
  // The fragment between begin_outer and end_outer: its local values and every gradient.
  int64_t open_ = -1;
  std::vector<at::Tensor> open_local_, open_grads_;
};

// DiLoCo over a torch::optim inner optimizer, SGD as the outer optimizer (lr 0.7, momentum 0.9,
// Nesterov by default), both in C++.
class DiLoCo {
 public:
  // `inner` must not be null; its parameters (all groups, in order) are synchronized.
  DiLoCo(std::shared_ptr<torch::optim::Optimizer> inner, ProcessGroupPtr process_group,
         DiLoCoOptions options, SGDOptions outer = default_outer());
  // DiLoCo's outer optimizer: SGD with lr 0.7, momentum 0.9, Nesterov.
  static SGDOptions default_outer();

  // The inner step (with its closure, if any), then the outer steps due. Returns the loss.
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr);
  void zero_grad(bool set_to_none = true);
  // The inner optimizer's parameter groups, the same objects (LR schedulers change them).
  std::vector<torch::optim::OptimizerParamGroup>& param_groups();

  // The inner optimizer's archive, the outer momentum buffers and the synchronization's state
  // (DiLoCoSync::state_dict) under kStateKey.
  void save(torch::serialize::OutputArchive& archive);
  void load(torch::serialize::InputArchive& archive, bool allow_reshard = false);
  static constexpr const char* kStateKey = "ddpx_diloco";

  // The inner optimizer (the constructor's), and the synchronization it drives.
  torch::optim::Optimizer& inner() { return *inner_; }
  DiLoCoSync& sync() { return *sync_; }
  // The outer SGD's hyper-parameters, read at every outer step (validated when set).
  const SGDOptions& outer_options() const { return outer_; }
  void set_outer_options(const SGDOptions& outer);
  // The outer SGD's momentum buffers, one per parameter (undefined before its first step).
  std::vector<at::Tensor>& momentum_buffers() { return momentum_; }

 private:
  std::shared_ptr<torch::optim::Optimizer> inner_;
  std::unique_ptr<DiLoCoSync> sync_;
  SGDOptions outer_;
  std::vector<at::Tensor> momentum_;
};

}  // namespace optim
}  // namespace ddpx
