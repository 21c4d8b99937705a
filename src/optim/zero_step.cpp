// ZeRO's fused shard steps: the shard's update run chunk by chunk inside the exchange. See
// include/ddpx/optim/zero.h.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/optim/zero.h>

#include <unordered_map>
#include <utility>

namespace ddpx {
namespace optim {

namespace {

// Where each stepped parameter sits: shard index -> (group, position) for the entries with a
// gradient. Checks the groups' list sizes and that this rank owns every listed parameter.
template <typename Group>
std::unordered_map<int64_t, std::pair<size_t, size_t>> locate(
    const ZeroShards& shards, const std::vector<Group>& groups,
    const std::vector<const std::vector<at::Tensor>*>& per_param_lists, size_t lists_per_group,
    const char* caller) {
  std::unordered_map<int64_t, std::pair<size_t, size_t>> where;
  const int64_t n = static_cast<int64_t>(shards.params().size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const Group& group = groups[g];
    const size_t count = group.params.size();
    TORCH_CHECK_VALUE(group.grads.size() == count, caller, ": group ", g, " has ", count,
                      " parameters and ", group.grads.size(), " gradients");
    for (size_t l = 0; l < lists_per_group; ++l) {
      const auto* list = per_param_lists[g * lists_per_group + l];
      TORCH_CHECK_VALUE(list->size() == count, caller, ": group ", g, " has ", count,
                        " parameters and a state list of ", list->size());
    }
    for (size_t j = 0; j < count; ++j) {
      const int64_t i = group.params[j];
      TORCH_CHECK_VALUE(i >= 0 && i < n, caller, ": parameter index ", i, " out of range (", n,
                        " parameters)");
      TORCH_CHECK_VALUE(shards.owners()[i] == shards.rank(), caller, ": parameter ", i,
                        " belongs to rank ", shards.owners()[i], ", not to this rank (",
                        shards.rank(), ")");
      if (!group.grads[j].defined()) continue;
      TORCH_CHECK_VALUE(where.emplace(i, std::make_pair(g, j)).second, caller, ": parameter ", i,
                        " listed twice");
    }
  }
  return where;
}

// The positions, per group, of a chunk's parameters that are stepped.
template <typename Where>
std::vector<std::vector<size_t>> picks_of(const std::vector<int64_t>& chunk, const Where& where,
                                          size_t groups) {
  std::vector<std::vector<size_t>> picks(groups);
  for (int64_t i : chunk) {
    const auto it = where.find(i);
    if (it != where.end()) picks[it->second.first].push_back(it->second.second);
  }
  return picks;
}

// The exchange the fused steps run: of every parameter, or of `subset`, which must then hold
// every stepped parameter.
template <typename Where>
ZeroExchangeStats exchange_of(ZeroShards& shards, const Where& where,
                              const ZeroShards::ChunkUpdate& update,
                              const std::vector<int64_t>* subset) {
  if (subset == nullptr) return shards.exchange(update);
  std::vector<char> in(shards.params().size(), 0);
  for (int64_t i : *subset) {
    if (i >= 0 && i < static_cast<int64_t>(in.size())) in[i] = 1;
  }
  for (const auto& entry : where) {
    TORCH_CHECK_VALUE(in[entry.first], "ZeroRedundancyOptimizer.step: parameter ", entry.first,
                      " is stepped but not among the parameters exchanged");
  }
  return shards.exchange(update, *subset);
}

std::vector<at::Tensor> select(const std::vector<at::Tensor>& v, const std::vector<size_t>& at) {
  std::vector<at::Tensor> out;
  out.reserve(at.size());
  for (size_t k : at) out.push_back(v[k]);
  return out;
}

}  // namespace

ZeroExchangeStats step_sgd(ZeroShards& shards, std::vector<ZeroSGDGroup>& groups,
                           const std::vector<int64_t>* subset) {
  std::vector<const std::vector<at::Tensor>*> lists;
  for (const auto& g : groups) {
    g.options.validate();
    lists.push_back(&g.momentum_buffers);
  }
  const auto where = locate(shards, groups, lists, 1, "ZeroRedundancyOptimizer.step (SGD)");
  auto update = [&](const std::vector<int64_t>& chunk) {
    const auto picks = picks_of(chunk, where, groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
      if (picks[g].empty()) continue;
      ZeroSGDGroup& group = groups[g];
      std::vector<at::Tensor> params;
      for (size_t k : picks[g]) params.push_back(shards.params()[group.params[k]].detach());
      std::vector<at::Tensor> bufs = select(group.momentum_buffers, picks[g]);
      sgd_step(params, select(group.grads, picks[g]), bufs, group.options);
      for (size_t k = 0; k < picks[g].size(); ++k) group.momentum_buffers[picks[g][k]] = bufs[k];
    }
  };
  return exchange_of(shards, where, update, subset);
}

ZeroExchangeStats step_adam(ZeroShards& shards, std::vector<ZeroAdamGroup>& groups,
                            const std::vector<int64_t>* subset) {
  std::vector<const std::vector<at::Tensor>*> lists;
  for (const auto& g : groups) {
    g.options.validate();
    lists.push_back(&g.exp_avgs);
    lists.push_back(&g.exp_avg_sqs);
    lists.push_back(&g.steps);
    // Without amsgrad the list may be empty: check it against itself.
    lists.push_back(g.options.amsgrad ? &g.max_exp_avg_sqs : &g.exp_avgs);
  }
  const auto where = locate(shards, groups, lists, 4, "ZeroRedundancyOptimizer.step (Adam)");
  for (const auto& g : groups) {
    for (size_t j = 0; j < g.steps.size(); ++j) {
      TORCH_CHECK_VALUE(!g.grads[j].defined() || (g.steps[j].defined() && g.steps[j].numel() == 1),
                        "ZeroRedundancyOptimizer.step (Adam): state 'step' of parameter ",
                        g.params[j], " must be a one-element tensor");
    }
  }
  auto update = [&](const std::vector<int64_t>& chunk) {
    const auto picks = picks_of(chunk, where, groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
      if (picks[g].empty()) continue;
      ZeroAdamGroup& group = groups[g];
      std::vector<at::Tensor> params;
      std::vector<int64_t> steps;
      for (size_t k : picks[g]) {
        params.push_back(shards.params()[group.params[k]].detach());
        steps.push_back(static_cast<int64_t>(group.steps[k].item<double>()));
      }
      std::vector<at::Tensor> m1 = select(group.exp_avgs, picks[g]);
      std::vector<at::Tensor> m2 = select(group.exp_avg_sqs, picks[g]);
      std::vector<at::Tensor> mx;
      if (group.options.amsgrad) mx = select(group.max_exp_avg_sqs, picks[g]);
      adam_step(params, select(group.grads, picks[g]), m1, m2, mx, steps, group.options);
      for (size_t k = 0; k < picks[g].size(); ++k) {
        const size_t j = picks[g][k];
        group.exp_avgs[j] = m1[k];
        group.exp_avg_sqs[j] = m2[k];
        if (group.options.amsgrad) group.max_exp_avg_sqs[j] = mx[k];
        group.steps[j].fill_(static_cast<double>(steps[k]));
      }
    }
  };
  return exchange_of(shards, where, update, subset);
}

namespace {

bool fits(const at::Tensor& t, const at::Tensor& p) {
  return t.layout() == c10::kStrided && t.scalar_type() == p.scalar_type() &&
         t.device() == p.device() && t.sizes() == p.sizes() && t.is_contiguous();
}

// The parameter and gradient of entry j of a group, if the kernels take them (undefined
// gradient: skipped, fine).
bool entry_supported(const ZeroShards& shards, int64_t index, const at::Tensor& grad) {
  if (!grad.defined()) return true;
  if (index < 0 || index >= static_cast<int64_t>(shards.params().size())) return false;
  const at::Tensor& p = shards.params()[index];
  const auto dtype = p.scalar_type();
  return (dtype == at::kFloat || dtype == at::kDouble) && p.is_contiguous() && fits(grad, p);
}

bool state_supported(const std::vector<at::Tensor>& state, size_t j, const at::Tensor& p) {
  return j >= state.size() || !state[j].defined() || fits(state[j], p);
}

}  // namespace

bool fused_step_supported(const ZeroShards& shards, const std::vector<ZeroSGDGroup>& groups) {
  for (const auto& g : groups) {
    if (g.grads.size() != g.params.size()) return false;
    for (size_t j = 0; j < g.params.size(); ++j) {
      if (!entry_supported(shards, g.params[j], g.grads[j])) return false;
      if (!g.grads[j].defined()) continue;
      if (!state_supported(g.momentum_buffers, j, shards.params()[g.params[j]])) return false;
    }
  }
  return true;
}

bool fused_step_supported(const ZeroShards& shards, const std::vector<ZeroAdamGroup>& groups) {
  for (const auto& g : groups) {
    if (g.grads.size() != g.params.size()) return false;
    for (size_t j = 0; j < g.params.size(); ++j) {
      if (!entry_supported(shards, g.params[j], g.grads[j])) return false;
      if (!g.grads[j].defined()) continue;
      const at::Tensor& p = shards.params()[g.params[j]];
      if (!state_supported(g.exp_avgs, j, p) || !state_supported(g.exp_avg_sqs, j, p) ||
          !state_supported(g.max_exp_avg_sqs, j, p)) {
        return false;
      }
      if (j < g.steps.size() && g.steps[j].defined() && g.steps[j].numel() != 1) return false;
    }
  }
  return true;
}

}  // namespace optim
}  // namespace ddpx
