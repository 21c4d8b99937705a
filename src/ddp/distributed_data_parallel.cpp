#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <ddpx/comm/bucketed.h>
#include <ddpx/ddp/distributed_data_parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <unordered_set>

#include "comm/digest.h"
#include "common/compat_internal.h"

namespace ddpx {
namespace ddp {
namespace {

// Python DDP's dist._DEFAULT_FIRST_BUCKET_BYTES.
constexpr int64_t kDefaultFirstBucketBytes = 1024 * 1024;
constexpr double kDefaultBucketCapMb = 25.0;
// What Python DDP broadcasts the initial states and buffers in (_sync_module_states).
constexpr int64_t kBroadcastBucketBytes = 250 * 1024 * 1024;

// Python's _DDPSink for static_graph's first iteration: the identity on the outputs, whose
// backward queues Reducer::delay_all_reduce to run when the whole backward pass is done (the
// Reducer reduces nothing itself in that iteration: it is still learning the graph).
// The graph node keeps the Reducer weakly (as Python's _DDPSink keeps DDP): a graph outliving
// its DistributedDataParallel (an output kept, backward called after the DDP object is gone)
// then backpropagates locally instead of calling into a freed Reducer.
struct ReducerRef : torch::CustomClassHolder {
  explicit ReducerRef(std::weak_ptr<c10d::Reducer> r) : reducer(std::move(r)) {}
  std::weak_ptr<c10d::Reducer> reducer;
};

struct DelayAllReduceSink : public torch::autograd::Function<DelayAllReduceSink> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::IValue& reducer) {
    ctx->saved_data["reducer"] = reducer;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto ref =
        c10::static_intrusive_pointer_cast<ReducerRef>(ctx->saved_data["reducer"].toCapsule());
    if (std::shared_ptr<c10d::Reducer> reducer = ref->reducer.lock()) {
      torch::autograd::Engine::get_default_engine().queue_callback(
          [reducer] { reducer->delay_all_reduce(); });
    }
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

DistributedDataParallel::DistributedDataParallel(torch::nn::AnyModule module,
                                                 ProcessGroupPtr process_group, DDPOptions options)
    : any_(std::move(module)), pg_(std::move(process_group)), options_(options) {
  TORCH_CHECK_VALUE(!any_.is_empty(), "DistributedDataParallel: the AnyModule is empty");
  module_ = any_.ptr();
  init();
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 ProcessGroupPtr process_group, DDPOptions options,
                                                 int)
    : module_(std::move(module)), pg_(std::move(process_group)), options_(options) {
  TORCH_CHECK_VALUE(module_ != nullptr, "DistributedDataParallel: the module is null");
  init();
}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::init() {
  TORCH_CHECK_VALUE(pg_,
                    "DistributedDataParallel: process_group is null (this rank is not a "
                    "member of the group)");
  if (options_.bucket_cap_mb()) {
    TORCH_CHECK_VALUE(*options_.bucket_cap_mb() > 0,
                      "DistributedDataParallel: bucket_cap_mb must be positive, got ",
                      *options_.bucket_cap_mb());
  }
  // The parameters to reduce: requires_grad, each tensor once (shared parameters), module order.
  std::unordered_set<const c10::TensorImpl*> seen;
  std::unordered_map<size_t, std::string> names;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    names[params_.size()] = item.key();
    params_.push_back(p);
  }
  TORCH_CHECK_VALUE(!params_.empty(),
                    "DistributedDataParallel is not needed when a module doesn't have any "
                    "parameter that requires a gradient.");
  for (const auto& b : module_->buffers(/*recurse=*/true)) buffers_.push_back(b);

  // The group must take this module's tensors (Python's DDP fails in its first collective with
  // "No backend type associated with device type").
  std::unordered_set<int> device_types;
  for (const at::Tensor& p : params_) {
    if (!device_types.insert(static_cast<int>(p.device().type())).second) continue;
    TORCH_CHECK_VALUE(compat::has_backend_for(*pg_, p.device().type()),
                      "DistributedDataParallel: the process group (", compat::backend_name(*pg_),
                      ") has no backend for ", p.device().type(),
                      " tensors, where this module's parameters are; use a \"gloo\" group for "
                      "CPU parameters, \"nccl\" (or \"gloo\") for CUDA ones");
  }
  if (options_.init_sync()) {
    check_same_parameters();
    // Rank 0's parameters and buffers everywhere (Python's _sync_module_states).
    broadcast(module_states(/*with_buffers=*/true), 0, "DistributedDataParallel");
  }

  // Buckets by size, as Python DDP assigns them, in reverse (the order gradients arrive).
  // bucket_cap_mb_list: its limits, for this assignment and the Reducer's rebuild, the largest
  // as the cap (Python's _BucketCapacityConfig).
  const std::vector<double>& per_bucket_mb = options_.bucket_cap_mb_list();
  std::vector<int64_t> per_bucket_bytes;
  for (size_t i = 0; i < per_bucket_mb.size(); ++i) {
    TORCH_CHECK_VALUE(per_bucket_mb[i] > 0, "DistributedDataParallel: bucket_cap_mb_list[", i,
                      "] must be positive, got ", per_bucket_mb[i]);
    per_bucket_bytes.push_back(static_cast<int64_t>(per_bucket_mb[i] * 1024 * 1024));
  }
  const bool default_cap = !options_.bucket_cap_mb().has_value() && per_bucket_bytes.empty();
  const auto cap = per_bucket_bytes.empty()
                       ? static_cast<int64_t>(
                             options_.bucket_cap_mb().value_or(kDefaultBucketCapMb) * 1024 * 1024)
                       : *std::max_element(per_bucket_bytes.begin(), per_bucket_bytes.end());
  std::vector<size_t> limits;
  if (!per_bucket_bytes.empty()) {
    limits.assign(per_bucket_bytes.begin(), per_bucket_bytes.end());
  } else {
    if (default_cap) limits.push_back(static_cast<size_t>(kDefaultFirstBucketBytes));
    limits.push_back(static_cast<size_t>(cap));
  }
  const std::vector<bool> sparse(params_.size(), false);
  auto assignment = c10d::compute_bucket_assignment_by_size(params_, limits, sparse);
  auto bucket_indices = std::get<0>(assignment);
  auto per_bucket_limits = std::get<1>(assignment);
  std::reverse(bucket_indices.begin(), bucket_indices.end());
  std::reverse(per_bucket_limits.begin(), per_bucket_limits.end());

  compat::ReducerArgs args;
  args.params = params_;
  args.bucket_indices = std::move(bucket_indices);
  args.per_bucket_size_limits = std::move(per_bucket_limits);
  args.process_group = pg_;
  args.expect_sparse_gradients = sparse;
  args.bucket_bytes_cap = cap;
  args.find_unused_parameters = options_.find_unused_parameters();
  args.gradient_as_bucket_view = options_.gradient_as_bucket_view();
  args.param_names = std::move(names);
  args.first_bucket_bytes_cap = default_cap ? kDefaultFirstBucketBytes : cap;
  args.bucket_bytes_cap_list = std::move(per_bucket_bytes);
  args.skip_all_reduce_unused_params = options_.skip_all_reduce_unused_params();
  args.batched_grad_copy = options_.batched_grad_copy();
  args.lazy_bucket_allocation = options_.lazy_bucket_allocation();
  reducer_ = compat::make_reducer(std::move(args));
  logger_ = std::make_shared<c10d::Logger>(reducer_);
  reducer_->set_logger(logger_);
  if (options_.static_graph()) reducer_->set_static_graph();
}

// Every rank holds the same parameters (count, shapes, strides, dtypes, device types): one
// digest, its minimum and maximum over the ranks compared (as comm::run_bucketed's agreement
// check does, which does not cover strides), so a mismatch is a ValueError on every
// rank (torch's verify_params_across_processes raises on the ranks that differ from rank 0 only,
// and rank 0 then waits in the next collective).
void DistributedDataParallel::check_same_parameters() {
  comm::Digest digest;
  digest.mix(static_cast<int64_t>(params_.size()));
  for (const at::Tensor& p : params_) {
    digest.mix(p.dim());
    for (int64_t s : p.sizes()) digest.mix(s);
    for (int64_t s : p.strides()) digest.mix(s);
    digest.mix(static_cast<int64_t>(p.scalar_type()));
    digest.mix(static_cast<int64_t>(p.device().type()));
  }
  // On the parameters' device: NCCL takes CUDA tensors only (Gloo takes either).
  if (comm::all_ranks_agree({digest.value()}, pg_, params_.front().device()).front()) return;
  std::ostringstream mine;
  for (size_t i = 0; i < params_.size() && i < 8; ++i) {
    mine << (i ? ", " : "") << params_[i].sizes() << " " << params_[i].scalar_type();
  }
  if (params_.size() > 8) mine << ", ...";
  TORCH_CHECK_VALUE(false,
                    "DistributedDataParallel: the ranks' modules have different parameters "
                    "(count, shapes, strides, dtypes or devices); rank ",
                    pg_->getRank(), " has ", params_.size(), ": ", mine.str(),
                    ". Build the same model on every rank.");
}

at::Tensor DistributedDataParallel::sink(const at::Tensor& output) {
  if (!options_.static_graph() || delay_all_reduce_enqueued_ || !output.requires_grad()) {
    return output;
  }
  delay_all_reduce_enqueued_ = true;
  return DelayAllReduceSink::apply(
      output, c10::IValue::make_capsule(c10::make_intrusive<ReducerRef>(reducer_)));
}

void DistributedDataParallel::check_forward(size_t args) const {
  TORCH_CHECK_VALUE(!any_.is_empty() || (tensor_forward_ && args == 1),
                    "DistributedDataParallel.forward: ",
                    tensor_forward_ ? "this module's forward takes one tensor here (wrap it in a "
                                      "torch::nn::AnyModule for other arguments)"
                                    : "built from a module without a forward DDP can call; call "
                                      "prepare_forward() and prepare_backward(outputs) around "
                                      "the module's own forward");
}

void DistributedDataParallel::prepare_forward() {
  const bool grad = at::GradMode::is_enabled();
  if (grad && require_backward_grad_sync_) reducer_->prepare_for_forward();
  if (join_.enabled) {
    join_.pending.clear();  // last iteration's flags: done, or held by the group until they are
    // Tells the joined ranks' loop that this rank still trains (Join.notify_join_context); the
    // sum is the number of ranks still training, which the Reducer divides by unless
    // divide_by_initial_world_size.
    auto notify = join_all_reduce(join_flag(1));
    if (join_.options.throw_on_early_termination) {
      TORCH_CHECK(join_sum(0) == 0,
                  "Detected at least one rank that exhausted inputs. Throwing across all ranks.");
    }
    reducer_->set_forward_pass_work_handle(notify, join_.options.divide_by_initial_world_size);
  }
  // Once, after the first iteration: buckets in the order gradients actually arrived.
  if (grad) reducer_->rebuild_buckets();
  // From rank 0, or under join from the highest rank still training (rank 0 may have joined
  // with stale buffers).
  if (will_sync_buffers()) {
    broadcast(buffers_, join_.enabled ? join_common_rank(true) : 0,
              "DistributedDataParallel (broadcast_buffers)");
  }
  if (join_.enabled) {
    // Whether this iteration's backward reduces, for the joined ranks to shadow it or not.
    join_.pending.push_back(join_all_reduce(join_flag(require_backward_grad_sync_ ? 1 : 0)));
  }
}

bool DistributedDataParallel::will_sync_buffers() const {
  return options_.broadcast_buffers() && require_forward_param_sync_ && !buffers_.empty() &&
         pg_->getSize() > 1;
}

// Broadcasts `tensors` from `src` in Python DDP's broadcast buckets.
void DistributedDataParallel::broadcast(const std::vector<at::Tensor>& tensors, int64_t src,
                                        const char* caller) {
  comm::BucketOptions bo;
  bo.bucket_cap_bytes = kBroadcastBucketBytes;
  bo.caller = caller;
  at::NoGradGuard no_grad;
  comm::run_bucketed(tensors, pg_, comm::Broadcast(src), bo);
}

// Every parameter (those without requires_grad too), then the buffers: what Python's
// _sync_module_states broadcasts.
std::vector<at::Tensor> DistributedDataParallel::module_states(bool with_buffers) const {
  std::vector<at::Tensor> states;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    states.push_back(item.value());
  }
  if (with_buffers) states.insert(states.end(), buffers_.begin(), buffers_.end());
  return states;
}

at::Tensor DistributedDataParallel::join_flag(double value) const {
  return at::full({1}, value, at::TensorOptions(at::kFloat).device(params_.front().device()));
}

c10::intrusive_ptr<c10d::Work> DistributedDataParallel::join_all_reduce(at::Tensor t,
                                                                        c10d::ReduceOp op) {
  std::vector<at::Tensor> tensors{std::move(t)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  return pg_->allreduce(tensors, opts);
}

float DistributedDataParallel::join_sum(double value) {
  at::Tensor flag = join_flag(value);
  join_all_reduce(flag)->wait();
  return flag.item<float>();
}

int64_t DistributedDataParallel::join_common_rank(bool candidate) {
  at::Tensor rank = join_flag(candidate ? pg_->getRank() : -1).to(at::kLong);
  join_all_reduce(rank, c10d::ReduceOp::MAX)->wait();
  const int64_t common = rank.item<int64_t>();
  TORCH_CHECK(common >= 0, "DistributedDataParallel.join: no rank qualified as the common rank");
  return common;
}

void DistributedDataParallel::join(const std::function<void()>& loop, JoinOptions options) {
  TORCH_CHECK_VALUE(static_cast<bool>(loop), "DistributedDataParallel.join: empty loop");
  if (!options.enable) {
    loop();
    return;
  }
  TORCH_CHECK_VALUE(!join_.enabled, "DistributedDataParallel.join: already inside join()");
  struct Reset {
    JoinState& state;
    ~Reset() { state = JoinState{}; }
  } reset{join_};
  join_.enabled = true;
  join_.options = options;
  loop();  // an exception leaves at once, as from torch's Join
  // Shadow the ranks still training, one iteration per loop, until the count is 0.
  bool last_joiner = true;
  for (int64_t i = 0;; ++i) {
    if (join_sum(0) == 0) break;  // no rank still training
    if (options.throw_on_early_termination) {
      join_sum(1);  // tells the training ranks, whose forward raises
      TORCH_CHECK(false, "Rank ", pg_->getRank(), " exhausted all inputs.");
    }
    if (i == 1000) {
      TORCH_WARN("DistributedDataParallel.join: rank ", pg_->getRank(),
                 " has at least 1000 fewer inputs than other ranks still training; this skew "
                 "costs the others time.");
    }
    join_shadow_iteration();
    last_joiner = false;
  }
  join_sync_final_model(last_joiner);
}

// Python DDP's _DDPJoinHook.main_hook: the collectives a training rank issues in one
// iteration, in its order, with zeros for gradients.
void DistributedDataParallel::join_shadow_iteration() {
  join_.pending.clear();
  reducer_->rebuild_buckets();
  if (will_sync_buffers()) {
    broadcast(buffers_, join_common_rank(false), "DistributedDataParallel (broadcast_buffers)");
  }
  const bool reduces = join_sum(0) != 0;
  // The next iteration syncs buffers only after one that reduced, as on the training ranks.
  require_forward_param_sync_ = reduces;
  if (!reduces) return;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  for (c10d::GradBucket& bucket : reducer_->get_grad_buckets(/*return_zero_tensors=*/true)) {
    futures.push_back(reducer_->run_comm_hook(bucket));
  }
  for (auto& f : futures) f->wait();
  if (options_.find_unused_parameters()) {
    join_.pending.push_back(join_all_reduce(reducer_->get_local_used_map_on_device()));
  }
  reducer_->push_rebuilt_params_for_all_indices();
}

// Python DDP's _sync_final_model: the last rank to join (the highest, if several) has trained
// on every iteration; its parameters (and buffers, with broadcast_buffers) go everywhere.
void DistributedDataParallel::join_sync_final_model(bool last_joiner) {
  broadcast(module_states(options_.broadcast_buffers()), join_common_rank(last_joiner),
            "DistributedDataParallel.join");
  for (auto& w : join_.pending) w->wait();
}

std::vector<at::Tensor> DistributedDataParallel::prepare_backward(
    const std::vector<at::Tensor>& outputs) {
  if (!at::GradMode::is_enabled() || !require_backward_grad_sync_) {
    require_forward_param_sync_ = false;
    return outputs;
  }
  require_forward_param_sync_ = true;
  if (options_.find_unused_parameters() && !options_.static_graph()) {
    reducer_->prepare_for_backward(outputs);
  } else {
    reducer_->prepare_for_backward({});
  }
  if (!options_.static_graph() || delay_all_reduce_enqueued_) return outputs;
  std::vector<at::Tensor> out;
  for (const at::Tensor& o : outputs) out.push_back(o.defined() ? sink(o) : o);
  return out;
}

void DistributedDataParallel::register_comm_hook(hooks::CommHookPtr hook) {
  TORCH_CHECK_VALUE(hook != nullptr, "DistributedDataParallel.register_comm_hook: null hook");
  reducer_->register_comm_hook(std::make_unique<hooks::SharedCommHook>(std::move(hook)));
}

void DistributedDataParallel::register_builtin_comm_hook(c10d::BuiltinCommHookType type) {
  reducer_->register_builtin_comm_hook(type);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(&ddp), previous_(ddp.require_backward_grad_sync_) {
  ddp.require_backward_grad_sync_ = false;
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : ddp_(other.ddp_), previous_(other.previous_) {
  other.ddp_ = nullptr;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (ddp_ != nullptr) ddp_->require_backward_grad_sync_ = previous_;
}

}  // namespace ddp
}  // namespace ddpx
