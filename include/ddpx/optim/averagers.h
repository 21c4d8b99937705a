// Model averagers: torch's model_averaging.averagers.PeriodicModelAverager and
// hierarchical_model_averager.HierarchicalModelAverager, native.
//
//   auto averager = std::make_shared<ddpx::optim::PeriodicModelAverager>(/*period=*/4,
//                                                                  /*warmup_steps=*/100, pg);
//   for (...) { loss.backward(); optimizer.step(); averager->average_parameters(params); }
#pragma once

#include <ATen/core/Tensor.h>
#include <ddpx/comm/average.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace torch {
namespace optim {
class OptimizerParamGroup;
}
}  // namespace torch

namespace ddpx {
namespace optim {

// Base class: a step counter and the overall process group.
class ModelAverager {
 public:
  // `process_group`: the group to average over; null means this rank is not a member (averaging
  // is then a no-op; C++ has no "default group": Python passes WORLD for None).
  explicit ModelAverager(ProcessGroupPtr process_group, comm::AverageOptions options = {});
  virtual ~ModelAverager() = default;

  // Averages the tensors of `params` that have a gradient (parameters without one are skipped,
  // as torch's), if this step calls for it, then counts the step.
  virtual void average_parameters(const std::vector<at::Tensor>& params) = 0;
  // The same over the parameters of optimizer parameter groups.
  void average_parameters(const std::vector<torch::optim::OptimizerParamGroup>& groups);

  // Steps counted so far (one per average_parameters call), settable to resume a job; the group
  // and the averaging options the constructor took (options settable between steps).
  int64_t step() const { return step_; }
  void set_step(int64_t step);
  const ProcessGroupPtr& process_group() const { return process_group_; }
  const comm::AverageOptions& options() const { return options_; }
  void set_options(const comm::AverageOptions& options);

  // What the last averaging call did (zeros if it did not average).
  const comm::AverageStats& last_stats() const { return last_stats_; }

 protected:
  void average_with(const std::vector<at::Tensor>& params, const ProcessGroupPtr& group);

  ProcessGroupPtr process_group_;
  comm::AverageOptions options_;
  int64_t step_ = 0;
  comm::AverageStats last_stats_;
};

// Averages over the process group every `period` steps once `warmup_steps` steps have passed
// (at steps warmup, warmup + period, ...). period < 1 and warmup_steps < 0 throw
// c10::ValueError; period == 1 warns (DDP alone costs the same), as torch. A null process_group
// (this rank is not a member) makes averaging a no-op while the steps are still counted.
class PeriodicModelAverager final : public ModelAverager {
 public:
  // Validates as torch's constructor (c10::ValueError naming the argument).
  PeriodicModelAverager(int64_t period, int64_t warmup_steps, ProcessGroupPtr process_group,
                        comm::AverageOptions options = {});

  void average_parameters(const std::vector<at::Tensor>& params) override;
  // The parameter-group overload of the base class, still visible beside the override.
  using ModelAverager::average_parameters;

  // The constructor's arguments.
  int64_t period() const { return period_; }
  int64_t warmup_steps() const { return warmup_steps_; }
  // Settable mid-run, as torch's attributes are (a schedule that changes the period): the next
  // average_parameters call uses the new values. period < 1 and warmup_steps < 0 throw
  // c10::ValueError.
  void set_period(int64_t period);
  void set_warmup_steps(int64_t warmup_steps);

 private:
  int64_t period_;
  int64_t warmup_steps_;
};

// Hierarchical SGD: groups of increasing size average at increasing periods; at a step after
// warm-up only the group of the largest period dividing the step averages.
//
// `period_groups` lists (period, group) pairs in hierarchy order (torch's ordered dict, with the
// subgroups already created: C++ has no new_subgroups()); a group is null on a rank that is not a
// member. Throws c10::ValueError when the list is empty, a period is < 1, warmup_steps < 0, or
// the last group's size is not the size of `process_group` (which must not be null), or a period
// appears twice; warns when the largest period is 1.
class HierarchicalModelAverager final : public ModelAverager {
 public:
  // Validates as torch's constructor (c10::ValueError naming what is wrong).
  HierarchicalModelAverager(std::vector<std::pair<int64_t, ProcessGroupPtr>> period_groups,
                            int64_t warmup_steps, ProcessGroupPtr process_group,
                            comm::AverageOptions options = {});

  void average_parameters(const std::vector<at::Tensor>& params) override;
  // The parameter-group overload of the base class, still visible beside the override.
  using ModelAverager::average_parameters;

  // The constructor's arguments.
  const std::vector<std::pair<int64_t, ProcessGroupPtr>>& period_groups() const {
    return period_groups_;
  }
  int64_t warmup_steps() const { return warmup_steps_; }
  // Settable mid-run, as torch's attribute is; < 0 throws c10::ValueError.
  void set_warmup_steps(int64_t warmup_steps);

  // Index into period_groups() of the group that averages at `step`, or -1 for none (ignores
  // the warm-up).
  int64_t group_index_for_step(int64_t step) const;

 private:
  std::vector<std::pair<int64_t, ProcessGroupPtr>> period_groups_;
  int64_t warmup_steps_;
};

}  // namespace optim

}  // namespace ddpx
