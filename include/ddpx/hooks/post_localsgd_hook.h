// post_localSGD_hook and its state: torch's PostLocalSGDState / post_localSGD_hook, native.
//
// Until `start_localSGD_iter` the hook averages gradients over `process_group` (global
// allreduce, bit-identical to allreduce_hook); from then on it averages them within `subgroup`
// only (e.g. the ranks of one machine), or not at all when `post_local_gradient_allreduce` is
// false. A model averager (ddpx::optim::PeriodicModelAverager,
// ddpx::optim::HierarchicalModelAverager) then averages the *parameters* globally every few steps
// after the optimizer step.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ddpx/hooks/comm_hook.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace ddpx {
namespace hooks {

class PostLocalSGDState {
 public:
  // Receives each of torch's info lines, on the thread that logs it.
  using Logger = std::function<void(const std::string&)>;

  // `process_group`: the global group (must not be null). `subgroup`: the group used after
  // start_localSGD_iter; it may be null only if post_local_gradient_allreduce is false (C++ has no
  // new_subgroups(); the Python class creates the intra-node subgroups when given None).
  // `logger` receives torch's info lines; null means c10's LOG(INFO).
  // Throws c10::ValueError for start_localSGD_iter < 0, c10::TypeError for a null process_group.
  PostLocalSGDState(ProcessGroupPtr process_group, ProcessGroupPtr subgroup,
                    int64_t start_localSGD_iter, bool post_local_gradient_allreduce = true,
                    Logger logger = nullptr);

  // The constructor's arguments, readable and settable as torch's attributes.
  const ProcessGroupPtr& process_group() const { return process_group_; }
  void set_process_group(ProcessGroupPtr pg);
  const ProcessGroupPtr& subgroup() const { return subgroup_; }
  void set_subgroup(ProcessGroupPtr pg);

  // The schedule, readable and settable: when local SGD starts, and whether gradients are still
  // averaged within `subgroup` after that.
  int64_t start_localSGD_iter() const { return start_localSGD_iter_; }
  void set_start_localSGD_iter(int64_t value);
  bool post_local_gradient_allreduce() const { return post_local_gradient_allreduce_; }
  void set_post_local_gradient_allreduce(bool value);

  // Iterations counted so far (stops counting at start_localSGD_iter, as torch's).
  int64_t iter() const { return iter_; }
  void set_iter(int64_t value);
  // Counts the changes that every rank must make alike (the setters, load_state_dict): the hook
  // checks again, at its next bucket, that the ranks agree on the schedule and the iteration.
  uint64_t epoch() const { return epoch_; }

  // Counts one iteration when the bucket is the last of a step (bucket 0), and logs once when
  // local SGD starts. Called by the hook in the global phase only, as torch's.
  void maybe_increase_iter(bool bucket_is_last);

  // True once gradients are no longer averaged globally.
  bool local_phase() const { return iter_ >= start_localSGD_iter_; }

  // {"iter", "start_localSGD_iter", "post_local_gradient_allreduce"}: what a resumed job needs
  // (process groups are not serialisable).
  c10::impl::GenericDict state_dict() const;
  // Restores state_dict(); checks the keys and types, names what is wrong.
  void load_state_dict(const c10::impl::GenericDict& dict);

  // The logger (null: c10's LOG(INFO)), and a line sent to it.
  void set_logger(Logger logger) { logger_ = std::move(logger); }
  void log(const std::string& line) const;

 private:
  ProcessGroupPtr process_group_;
  ProcessGroupPtr subgroup_;
  int64_t start_localSGD_iter_;
  bool post_local_gradient_allreduce_;
  int64_t iter_ = 0;
  uint64_t epoch_ = 0;
  Logger logger_;
};

// The hook. Collectives are issued from runHook (DDP's autograd thread), in bucket order.
class PostLocalSGDHook final : public CommHook {
 public:
  // Shares `state` (not null) with its other users, e.g. the Python state and the averagers.
  explicit PostLocalSGDHook(std::shared_ptr<PostLocalSGDState> state);

  std::string name() const override { return "post_localSGD_hook"; }
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

  // The state given to the constructor.
  const std::shared_ptr<PostLocalSGDState>& state() const { return state_; }

 private:
  std::shared_ptr<PostLocalSGDState> state_;
};

// Factory mirroring torch's name.
CommHookPtr post_localSGD_hook(std::shared_ptr<PostLocalSGDState> state);

}  // namespace hooks
}  // namespace ddpx
