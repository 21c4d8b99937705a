// The C++ ZeroRedundancyOptimizer. See include/ddpx/optim/zero.h.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/zero.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace ddpx {
namespace optim {

namespace {

// torch::optim keys its state by the parameter's TensorImpl: as a pointer (torch >= 2.1) or as
// the pointer's text (1.13).
template <typename Key>
Key state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << p.unsafeGetTensorImpl();
    return s.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

using StateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using StateKey = typename StateMap::key_type;

ZeroLayout layout_for(const ProcessGroupPtr& pg, ZeroOptions& options) {
  TORCH_CHECK_VALUE(pg,
                    "ZeroRedundancyOptimizer: process_group is null (this rank is not a "
                    "member of the group)");
  if (options.overlap_with_ddp && options.parameters_as_bucket_view) {
    TORCH_WARN(
        "`parameters_as_bucket_view=True` will be ignored since `overlap_with_ddp=True`; "
        "instead, a different bucketing strategy will be used");
    options.parameters_as_bucket_view = false;
  }
  // Under the balanced partition, bucket views are the layout's flat tensors per group.
  return ZeroLayout(
      pg->getSize(), pg->getRank(), options.partition,
      options.partition == ZeroPartition::kBalanced && options.parameters_as_bucket_view);
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
    const LocalFactory& make_local, ProcessGroupPtr pg, ZeroOptions options)
    : layout_(layout_for(pg, options)) {
  TORCH_CHECK_VALUE(make_local, "ZeroRedundancyOptimizer: make_local is empty");
  for (const auto& group : param_groups) {
    for (const at::Tensor& p : group.params()) {
      TORCH_CHECK_VALUE(p.defined(), "ZeroRedundancyOptimizer: an undefined parameter");
    }
    layout_.add_group(group.params());
  }
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    const at::Tensor& p = layout_.params()[i];
    param_index_.emplace(p.unsafeGetTensorImpl(), i);
    trainable_.push_back(p.requires_grad());
  }
  local_units_ = layout_.local_units(layout_.rank());
  std::vector<torch::optim::OptimizerParamGroup> local_groups;
  for (size_t g = 0; g < param_groups.size(); ++g) {
    std::vector<at::Tensor> mine;
    for (int64_t u : local_units_[g]) mine.push_back(layout_.units()[u]);
    if (param_groups[g].has_options()) {
      local_groups.emplace_back(std::move(mine), param_groups[g].options().clone());
    } else {
      local_groups.emplace_back(std::move(mine));
    }
  }
  std::vector<bool> trainable;
  for (int64_t i : layout_.unit_params()) trainable.push_back(trainable_[static_cast<size_t>(i)]);
  // Under the balanced partition the layout flattened the groups itself: the engine packs
  // nothing.
  ZeroOptions engine = options;
  engine.parameters_as_bucket_view =
      options.parameters_as_bucket_view && options.partition == ZeroPartition::kSortedGreedy;
  shards_ = std::make_unique<ZeroShards>(layout_.units(), layout_.unit_owners(),
                                         std::move(trainable), std::move(pg), engine);
  local_ = make_local(std::move(local_groups));
  TORCH_CHECK_VALUE(local_, "ZeroRedundancyOptimizer: make_local returned no optimizer");
}

at::Tensor ZeroRedundancyOptimizer::step(torch::optim::Optimizer::LossClosure closure) {
  if (shards_->options().overlap_with_ddp) {
    // torch's behaviour: the hook steps; a step() left in the loop would step twice.
    TORCH_WARN("`step()` should not be included in the training loop when `overlap_with_ddp=True`");
    return at::Tensor();
  }
  // The pieces of split parameters hold their gradients' slices for this step only.
  struct Unbind {
    const ZeroLayout& layout;
    ~Unbind() { layout.unbind_piece_grads(); }
  } unbind{layout_};
  const bool split = !layout_.bind_piece_grads().empty();
  last_step_fused_ = false;
  if (!closure && fused_step()) {
    last_step_fused_ = true;
    return at::Tensor();
  }
  at::Tensor loss;
  if (closure && split) {
    // The closure recomputes the parameters' gradients: the pieces take the new ones.
    loss = local_->step([&]() {
      at::Tensor l = closure();
      layout_.bind_piece_grads();
      return l;
    });
  } else {
    loss = local_->step(std::move(closure));
  }
  shards_->exchange();
  return loss;
}

void ZeroRedundancyOptimizer::step_params(const std::vector<at::Tensor>& params,
                                          const std::vector<at::Tensor>& grads) {
  TORCH_CHECK_VALUE(params.size() == grads.size(),
                    "ZeroRedundancyOptimizer::step_params: ", params.size(), " parameters but ",
                    grads.size(), " gradients");
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    // The partition and the exchange were laid out for the trainability at construction.
    TORCH_CHECK(layout_.params()[i].requires_grad() == trainable_[i],
                "ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not support changing "
                "parameter trainability at run time");
  }
  std::vector<at::Tensor> local;
  for (const auto& group : local_->param_groups()) {
    for (const at::Tensor& u : group.params()) local.push_back(u);
  }
  // The local step must see exactly `grads`: the local parameters' own gradients are set aside
  // and put back whatever happens.
  struct Restore {
    std::vector<at::Tensor>& units;
    std::vector<at::Tensor> saved;
    ~Restore() {
      for (size_t i = 0; i < units.size(); ++i) units[i].mutable_grad() = saved[i];
    }
  } restore{local, {}};
  for (at::Tensor& u : local) {
    restore.saved.push_back(u.grad());
    u.mutable_grad() = at::Tensor();
  }
  std::vector<int64_t> subset;
  for (size_t k = 0; k < params.size(); ++k) {
    const at::Tensor& p = params[k];
    const at::Tensor& g = grads[k];
    const auto it = p.defined() ? param_index_.find(p.unsafeGetTensorImpl()) : param_index_.end();
    TORCH_CHECK_VALUE(it != param_index_.end(), "ZeroRedundancyOptimizer::step_params: parameter ",
                      k, " is not one of this optimizer's");
    const size_t index = it->second;
    const auto& pieces = layout_.pieces(index);
    const size_t first = layout_.first_unit(index);
    TORCH_CHECK_VALUE(!p.requires_grad() || (g.defined() && g.numel() == p.numel()),
                      "ZeroRedundancyOptimizer::step_params: the gradient of parameter ", k,
                      " does not match it (", p.sizes(), ")");
    for (size_t j = 0; j < pieces.size(); ++j) {
      const int64_t unit = static_cast<int64_t>(first + j);
      subset.push_back(unit);
      if (!p.requires_grad() || pieces[j].owner != layout_.rank()) continue;
      at::Tensor u = layout_.units()[static_cast<size_t>(unit)];
      u.mutable_grad() = pieces.size() == 1
                             ? g.view_as(p)
                             : g.reshape(-1).slice(0, pieces[j].begin, pieces[j].end);
    }
  }
  last_step_fused_ = fused_step(&subset);
  if (!last_step_fused_) {
    local_->step();
    shards_->exchange(nullptr, subset);
  }
}

bool ZeroRedundancyOptimizer::fused_step(const std::vector<int64_t>* subset) {
  if (auto* sgd = dynamic_cast<torch::optim::SGD*>(local_.get())) return fused_sgd(*sgd, subset);
  if (auto* adamw = dynamic_cast<torch::optim::AdamW*>(local_.get())) {
    return fused_adam<torch::optim::AdamW, torch::optim::AdamWParamState>(*adamw, true, subset);
  }
  if (auto* adam = dynamic_cast<torch::optim::Adam*>(local_.get())) {
    return fused_adam<torch::optim::Adam, torch::optim::AdamParamState>(*adam, false, subset);
  }
  return false;
}

bool ZeroRedundancyOptimizer::fused_sgd(torch::optim::SGD& optim,
                                        const std::vector<int64_t>* subset) {
  auto& state = optim.state();
  std::vector<ZeroSGDGroup> groups;
  for (size_t g = 0; g < optim.param_groups().size(); ++g) {
    const auto& group = optim.param_groups()[g];
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    ZeroSGDGroup z;
    z.options.lr = o.lr();
    z.options.momentum = o.momentum();
    z.options.dampening = o.dampening();
    z.options.weight_decay = o.weight_decay();
    z.options.nesterov = o.nesterov();
    for (size_t j = 0; j < group.params().size(); ++j) {
      const at::Tensor& unit = group.params()[j];
      z.params.push_back(local_units_[g][j]);
      z.grads.push_back(unit.grad());
      const auto it = state.find(state_key<StateKey>(unit));
      z.momentum_buffers.push_back(
          it == state.end()
              ? at::Tensor()
              : static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
    }
    groups.push_back(std::move(z));
  }
  if (!fused_step_supported(*shards_, groups)) return false;
  step_sgd(*shards_, groups, subset);
  // torch::optim::SGD keeps a momentum buffer only with momentum, made on the first step.
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].options.momentum == 0) continue;
    const auto& params = optim.param_groups()[g].params();
    for (size_t j = 0; j < params.size(); ++j) {
      if (!groups[g].grads[j].defined()) continue;
      auto& slot = state[state_key<StateKey>(params[j])];
      if (!slot) slot = std::make_unique<torch::optim::SGDParamState>();
      static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer(
          groups[g].momentum_buffers[j]);
    }
  }
  return true;
}

template <typename Optim, typename State>
bool ZeroRedundancyOptimizer::fused_adam(Optim& optim, bool decoupled,
                                         const std::vector<int64_t>* subset) {
  using Options = std::conditional_t<std::is_same_v<Optim, torch::optim::AdamW>,
                                     torch::optim::AdamWOptions, torch::optim::AdamOptions>;
  auto& state = optim.state();
  std::vector<ZeroAdamGroup> groups;
  for (size_t g = 0; g < optim.param_groups().size(); ++g) {
    const auto& group = optim.param_groups()[g];
    const auto& o = static_cast<const Options&>(group.options());
    ZeroAdamGroup z;
    z.options.lr = o.lr();
    z.options.beta1 = std::get<0>(o.betas());
    z.options.beta2 = std::get<1>(o.betas());
    z.options.eps = o.eps();
    z.options.weight_decay = o.weight_decay();
    z.options.amsgrad = o.amsgrad();
    z.options.decoupled_weight_decay = decoupled;
    for (size_t j = 0; j < group.params().size(); ++j) {
      const at::Tensor& unit = group.params()[j];
      const at::Tensor& grad = unit.grad();
      z.params.push_back(local_units_[g][j]);
      z.grads.push_back(grad);
      const auto it = state.find(state_key<StateKey>(unit));
      if (!grad.defined() || it == state.end()) {
        // No state yet: zeros, as torch::optim::Adam makes them (made for real below).
        const at::Tensor zeros =
            grad.defined() ? at::zeros_like(unit, at::MemoryFormat::Preserve) : at::Tensor();
        z.exp_avgs.push_back(zeros);
        z.exp_avg_sqs.push_back(grad.defined() ? at::zeros_like(zeros) : at::Tensor());
        z.max_exp_avg_sqs.push_back(grad.defined() && o.amsgrad() ? at::zeros_like(zeros)
                                                                  : at::Tensor());
        z.steps.push_back(grad.defined() ? at::zeros({}, at::kDouble) : at::Tensor());
        continue;
      }
      auto& s = static_cast<State&>(*it->second);
      z.exp_avgs.push_back(s.exp_avg());
      z.exp_avg_sqs.push_back(s.exp_avg_sq());
      z.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      z.steps.push_back(at::full({}, static_cast<double>(s.step()), at::kDouble));
    }
    if (!o.amsgrad()) z.max_exp_avg_sqs.clear();
    groups.push_back(std::move(z));
  }
  if (!fused_step_supported(*shards_, groups)) return false;
  step_adam(*shards_, groups, subset);
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = optim.param_groups()[g].params();
    for (size_t j = 0; j < params.size(); ++j) {
      if (!groups[g].grads[j].defined()) continue;
      auto& slot = state[state_key<StateKey>(params[j])];
      if (!slot) {
        auto fresh = std::make_unique<State>();
        fresh->exp_avg(groups[g].exp_avgs[j]);
        fresh->exp_avg_sq(groups[g].exp_avg_sqs[j]);
        if (groups[g].options.amsgrad) fresh->max_exp_avg_sq(groups[g].max_exp_avg_sqs[j]);
        slot = std::move(fresh);
      }
      static_cast<State&>(*slot).step(groups[g].steps[j].template item<int64_t>());
    }
  }
  return true;
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (const at::Tensor& p : layout_.params()) {
    at::Tensor& grad = const_cast<at::Tensor&>(p).mutable_grad();
    if (!grad.defined()) continue;
    if (set_to_none) {
      grad = at::Tensor();
    } else {
      grad = grad.detach();
      grad.zero_();
    }
  }
}

}  // namespace optim
}  // namespace ddpx
