#include <c10/util/Exception.h>
#include <ddpx/optim/averagers.h>
#include <torch/optim/optimizer.h>

namespace ddpx {
namespace optim {

using comm::AverageOptions;
using comm::AverageStats;
using comm::params_with_grad;

namespace {
const char* kPeriodOneAdvice =
    "no need to use model averaging because the communication cost of all-reducing parameters "
    "will be no less than the cost of all-reducing gradients by DistributedDataParallel in the "
    "backward pass. Therefore, only DistributedDataParallel should be used for this case.";

void check_warmup(const char* who, int64_t warmup_steps) {
  TORCH_CHECK_VALUE(warmup_steps >= 0, who,
                    ": Arg ``warmup_steps`` must be a non-negative number, got ", warmup_steps);
}
}  // namespace

ModelAverager::ModelAverager(ProcessGroupPtr process_group, AverageOptions options)
    : process_group_(std::move(process_group)), options_(options) {
  set_options(options);
}

void ModelAverager::set_step(int64_t step) {
  TORCH_CHECK_VALUE(step >= 0, "ModelAverager: step must be >= 0, got ", step);
  step_ = step;
}

void ModelAverager::set_options(const AverageOptions& options) {
  TORCH_CHECK_VALUE(options.bucket_cap_bytes > 0,
                    "ModelAverager: bucket_cap_bytes must be positive, got ",
                    options.bucket_cap_bytes);
  options_ = options;
}

void ModelAverager::average_parameters(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<at::Tensor> params;
  for (const auto& group : groups) {
    params.insert(params.end(), group.params().begin(), group.params().end());
  }
  average_parameters(params);
}

void ModelAverager::average_with(const std::vector<at::Tensor>& params,
                                 const ProcessGroupPtr& group) {
  last_stats_ = comm::average_parameters(params_with_grad(params), group, options_);
}

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps,
                                             ProcessGroupPtr process_group, AverageOptions options)
    : ModelAverager(std::move(process_group), options),
      period_(period),
      warmup_steps_(warmup_steps) {
  check_warmup("PeriodicModelAverager", warmup_steps);
  TORCH_CHECK_VALUE(period >= 1,
                    "PeriodicModelAverager: Arg ``period`` must be a positive value, got ", period);
  if (period == 1) {
    TORCH_WARN("When period is 1, ", kPeriodOneAdvice);
  }
}

void PeriodicModelAverager::set_period(int64_t period) {
  TORCH_CHECK_VALUE(period >= 1,
                    "PeriodicModelAverager: Arg ``period`` must be a positive value, got ", period);
  period_ = period;
}

void PeriodicModelAverager::set_warmup_steps(int64_t warmup_steps) {
  check_warmup("PeriodicModelAverager", warmup_steps);
  warmup_steps_ = warmup_steps;
}

void PeriodicModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  last_stats_ = AverageStats{};
  if (step_ >= warmup_steps_ && (step_ - warmup_steps_) % period_ == 0) {
    average_with(params, process_group_);
  }
  ++step_;
}

HierarchicalModelAverager::HierarchicalModelAverager(
    std::vector<std::pair<int64_t, ProcessGroupPtr>> period_groups, int64_t warmup_steps,
    ProcessGroupPtr process_group, AverageOptions options)
    : ModelAverager(std::move(process_group), options),
      period_groups_(std::move(period_groups)),
      warmup_steps_(warmup_steps) {
  const char* who = "HierarchicalModelAverager";
  TORCH_CHECK_VALUE(!period_groups_.empty(), who,
                    ": Arg ``period_group_size_dict`` must not be empty.");
  for (const auto& entry : period_groups_) {
    TORCH_CHECK_VALUE(entry.first >= 1, who,
                      ": every period in arg ``period_group_size_dict`` must be a positive value, "
                      "got ",
                      entry.first);
  }
  for (size_t i = 0; i < period_groups_.size(); ++i) {
    for (size_t j = i + 1; j < period_groups_.size(); ++j) {
      TORCH_CHECK_VALUE(period_groups_[i].first != period_groups_[j].first, who, ": period ",
                        period_groups_[i].first, " appears twice");
    }
  }
  TORCH_CHECK_TYPE(process_group_, who, ": process_group must be a ProcessGroup, got null");
  const ProcessGroupPtr& top = period_groups_.back().second;
  const int64_t overall = process_group_->getSize();
  TORCH_CHECK_VALUE(top && top->getSize() == overall, who,
                    ": the last group of the hierarchy must span the whole process_group (",
                    overall, " ranks), got ",
                    top ? std::to_string(top->getSize()) + " ranks" : std::string("no group"));
  if (period_groups_.back().first == 1) {
    TORCH_WARN("When the maximum period in arg ``period_group_size_dict`` is 1, ",
               kPeriodOneAdvice);
  }
  check_warmup(who, warmup_steps);
}

void HierarchicalModelAverager::set_warmup_steps(int64_t warmup_steps) {
  check_warmup("HierarchicalModelAverager", warmup_steps);
  warmup_steps_ = warmup_steps;
}

int64_t HierarchicalModelAverager::group_index_for_step(int64_t step) const {
  for (int64_t i = static_cast<int64_t>(period_groups_.size()) - 1; i >= 0; --i) {
    if (step % period_groups_[i].first == 0) return i;
  }
  return -1;
}

void HierarchicalModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  last_stats_ = AverageStats{};
  if (step_ >= warmup_steps_) {
    const int64_t index = group_index_for_step(step_);
    // A null group: this rank is not a member of that level's subgroup.
    if (index >= 0) average_with(params, period_groups_[index].second);
  }
  ++step_;
}

}  // namespace optim
}  // namespace ddpx
