// DistributedDataParallel for libtorch's C++ frontend: torch's Python DDP rebuilt on the same
// pieces (parameter verification across ranks, the initial broadcast from rank 0, bucket
// assignment by size, c10d's Reducer with its autograd hooks), so a C++ program trains a
// torch::nn::Module data-parallel with any ddpx hook, as a Python program does with
// torch.nn.parallel.DistributedDataParallel.
//
//   auto pg = ddpx::ddp::init_process_group_from_env("gloo");
//   torch::nn::Sequential net(torch::nn::Linear(64, 32), torch::nn::ReLU(),
//                             torch::nn::Linear(32, 10));
//   ddpx::ddp::DistributedDataParallel ddp(net, pg,
//                                     ddpx::ddp::DDPOptions().bucket_cap_mb(25));
//   ddp.register_comm_hook(ddpx::hooks::powerSGD_hook(state));
//   torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();  // averaged gradients
//   { auto guard = ddp.no_sync(); /* accumulate locally */ }
//
// `net` itself for a module taking one tensor, torch::nn::AnyModule(m) for other forwards (an
// AnyModule cannot hold a Sequential). Any other module, through a std::shared_ptr:
// ddp.prepare_forward(); auto out = net->forward(...); ddp.prepare_backward({out}); backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <ddpx/common/process_group.h>
#include <ddpx/hooks/comm_hook.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <utility>
#include <vector>

namespace c10d {
class Reducer;
class Logger;
}  // namespace c10d

namespace ddpx {
namespace ddp {

// Python DDP's options of the same names and defaults.
class DDPOptions {
 public:
  // Bucket size in MiB. Unset (the default): 25 MiB buckets and a first bucket of 1 MiB, as
  // Python's bucket_cap_mb=None; set: every bucket, the first included, holds up to this much.
  DDPOptions& bucket_cap_mb(double mb) {
    bucket_cap_mb_ = mb;
    return *this;
  }
  const std::optional<double>& bucket_cap_mb() const { return bucket_cap_mb_; }

  // Python's bucket_cap_mb_list: one size limit per bucket in MiB, in the order gradients
  // arrive (the last repeats for further buckets), for the first bucket assignment and the
  // rebuild after the first iteration alike; bucket_cap_mb is then ignored. Needs a torch whose
  // Reducer takes per-bucket limits (2.x; ValueError on 1.13). Empty (the default): unset.
  DDPOptions& bucket_cap_mb_list(std::vector<double> mb) {
    bucket_cap_mb_list_ = std::move(mb);
    return *this;
  }
  const std::vector<double>& bucket_cap_mb_list() const { return bucket_cap_mb_list_; }

// Declares the boolean option `name` (default `default_value`): a chaining setter and a getter.
#define DDPX_DDP_FLAG(name, default_value) \
  DDPOptions& name(bool value) {           \
    name##_ = value;                       \
    return *this;                          \
  }                                        \
  bool name() const { return name##_; }    \
                                           \
 private:                                  \
  bool name##_ = default_value;            \
                                           \
 public:
  DDPX_DDP_FLAG(find_unused_parameters, false)
  DDPX_DDP_FLAG(gradient_as_bucket_view, false)
  DDPX_DDP_FLAG(static_graph, false)
  DDPX_DDP_FLAG(broadcast_buffers, true)
  // false: the constructor neither checks that every rank has the same parameters nor
  // broadcasts rank 0's (Python's init_sync; the caller has made them equal).
  DDPX_DDP_FLAG(init_sync, true)
  // The Reducer options of Python's DDP of the same names, each taken only where the installed
  // torch's Reducer has it (ddpx::compat::kReducerTakes*; set elsewhere: c10::ValueError at
  // construction, naming it): unused parameters' gradients not all-reduced (with
  // find_unused_parameters; torch 2.x), gradients copied into a bucket by one batched copy, and
  // bucket buffers allocated at the first backward (torch 2.15).
  DDPX_DDP_FLAG(skip_all_reduce_unused_params, false)
  DDPX_DDP_FLAG(batched_grad_copy, false)
  DDPX_DDP_FLAG(lazy_bucket_allocation, false)
#undef DDPX_DDP_FLAG

 private:
  std::optional<double> bucket_cap_mb_;
  std::vector<double> bucket_cap_mb_list_;
};

// torch.distributed.algorithms.Join's arguments, for DistributedDataParallel::join.
struct JoinOptions {
  // false: join() just runs the loop (uneven inputs then hang, as without Join).
  bool enable = true;
  // true: once any rank runs out of inputs, every rank raises (c10::Error) instead of shadowing.
  bool throw_on_early_termination = false;
  // true: gradients are divided by the world size even when ranks have joined (their zeros
  // count); false: by the number of ranks still training (the default allreduce only: a comm
  // hook divides as it does, as in torch).
  bool divide_by_initial_world_size = true;
};

class DistributedDataParallel {
 public:
  // Wraps `module` (its forward() is then ddp.forward()) on `process_group`: verifies that every
  // rank has the same parameters (c10::ValueError on every rank otherwise), broadcasts rank 0's
  // parameters and buffers, assigns buckets and builds the Reducer. Every rank must construct it.
  DistributedDataParallel(torch::nn::AnyModule module, ProcessGroupPtr process_group,
                          DDPOptions options = {});
  // A module holder (torch::nn::Sequential, torch::nn::Linear, ...): ddp.forward(x) calls its
  // forward with one tensor (AnyModule cannot hold a Sequential: its forward is a template).
  template <typename ModuleType>
  DistributedDataParallel(torch::nn::ModuleHolder<ModuleType> module, ProcessGroupPtr process_group,
                          DDPOptions options = {})
      : DistributedDataParallel(std::shared_ptr<torch::nn::Module>(module.ptr()),
                                std::move(process_group), options, 0) {
    auto m = module.ptr();
    tensor_forward_ = [m](const at::Tensor& x) -> at::Tensor { return m->forward(x); };
  }
  // Any module, without a forward through DDP: call prepare_forward() and prepare_backward()
  // around your own forward.
  template <typename ModuleType>
  DistributedDataParallel(std::shared_ptr<ModuleType> module, ProcessGroupPtr process_group,
                          DDPOptions options = {})
      : DistributedDataParallel(std::shared_ptr<torch::nn::Module>(std::move(module)),
                                std::move(process_group), options, 0) {}
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // prepare_forward(), the module's forward, prepare_backward() on its output.
  template <typename... Args>
  at::Tensor forward(Args&&... args) {
    check_forward(sizeof...(Args));
    prepare_forward();
    at::Tensor out;
    if (!any_.is_empty()) {
      out = any_.forward(std::forward<Args>(args)...);
    } else {
      if constexpr (sizeof...(Args) == 1) out = tensor_forward_(std::forward<Args>(args)...);
    }
    return prepare_backward({out}).front();
  }
  template <typename... Args>
  at::Tensor operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Before a forward pass: the Reducer's per-iteration set-up (unless in no_sync), its one
  // bucket rebuild after the first iteration, and rank 0's buffers broadcast (broadcast_buffers).
  void prepare_forward();
  // After it, with the outputs the loss is computed from (searched for unused parameters with
  // find_unused_parameters; ignored otherwise). Compute the loss from the tensors it returns:
  // `outputs` themselves, except in static_graph's first iteration, where they pass through
  // the identity whose backward lets the Reducer reduce once the backward pass is done (Python's
  // _DDPSink). Within no_sync() the next backward does not reduce.
  std::vector<at::Tensor> prepare_backward(const std::vector<at::Tensor>& outputs);

  // A ddpx hook (any ddpx::hooks::CommHookPtr) in the Reducer; once only (c10::Error from the
  // Reducer on a second call).
  void register_comm_hook(hooks::CommHookPtr hook);
  // torch's built-in C++ hooks (c10d::BuiltinCommHookType::ALLREDUCE / FP16_COMPRESS).
  void register_builtin_comm_hook(c10d::BuiltinCommHookType type);

  // Gradient accumulation: while the guard lives, backward passes accumulate locally and do not
  // communicate (Python's `with ddp.no_sync():`).
  class NoSyncGuard {
   public:
    // Turns gradient synchronisation off until destruction, then restores what it was; movable,
    // not copyable.
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    DistributedDataParallel* ddp_;
    bool previous_;
  };
  // A guard that turns synchronisation off while it lives (see NoSyncGuard).
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // Uneven inputs (Python's `with Join([ddp], ...)`, torch.distributed.algorithms.join): runs
  // `loop`, this rank's training over its own inputs, which may be fewer than another rank's.
  // Every forward in it tells the other ranks this one is still training; once `loop` returns,
  // this rank shadows the others' collectives (their buffer broadcasts and gradient
  // all-reduces, contributing zeros) until every rank has finished, and then every rank takes
  // the parameters (and buffers, with broadcast_buffers) of the last rank to finish. Every
  // rank must call it. An exception from `loop` propagates at once, without shadowing (as in
  // torch). Forwards after it are plain again.
  void join(const std::function<void()>& loop, JoinOptions options = {});

  // The wrapped module (DDP shares it; it is not copied).
  torch::nn::Module& module() { return *module_; }
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return module_; }
  // The parameters DDP reduces: the module's with requires_grad, each once, in module order.
  const std::vector<at::Tensor>& parameters() const { return params_; }
  const ProcessGroupPtr& process_group() const { return pg_; }
  const DDPOptions& options() const { return options_; }
  c10d::Reducer& reducer() { return *reducer_; }

 private:
  // The constructor the others delegate to (the int tells it from the templates).
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr process_group,
                          DDPOptions options, int);
  void init();
  void check_forward(size_t args) const;
  void check_same_parameters();
  at::Tensor sink(const at::Tensor& output);
  bool will_sync_buffers() const;
  void broadcast(const std::vector<at::Tensor>& tensors, int64_t src, const char* caller);
  std::vector<at::Tensor> module_states(bool with_buffers) const;
  // Join's counters and flags: one float on the parameters' device, as torch's Join and DDP
  // make them (every rank's matching collective takes the same dtype and size).
  at::Tensor join_flag(double value) const;
  c10::intrusive_ptr<c10d::Work> join_all_reduce(at::Tensor t,
                                                 c10d::ReduceOp op = c10d::ReduceOp::SUM);
  float join_sum(double value);  // all-reduces join_flag(value), waits, returns the sum
  // The highest rank for which `candidate` holds (Python DDP's _find_common_rank).
  int64_t join_common_rank(bool candidate);
  void join_shadow_iteration();                  // a joined rank's side of one iteration
  void join_sync_final_model(bool last_joiner);  // the last joiner's state everywhere

  struct JoinState {
    bool enabled = false;
    JoinOptions options;
    // This iteration's collectives torch does not wait for (the backward-sync flag, the
    // used-parameter map); a work left behind is kept alive by its group.
    std::vector<c10::intrusive_ptr<c10d::Work>> pending;
  };
  JoinState join_;

  torch::nn::AnyModule any_;
  std::function<at::Tensor(const at::Tensor&)> tensor_forward_;
  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroupPtr pg_;
  DDPOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> buffers_;
  std::shared_ptr<c10d::Reducer> reducer_;
  std::shared_ptr<c10d::Logger> logger_;
  bool require_backward_grad_sync_ = true;
  bool require_forward_param_sync_ = true;
  bool delay_all_reduce_enqueued_ = false;
};

}  // namespace ddp
}  // namespace ddpx
