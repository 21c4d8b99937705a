// PostLocalSGDOptimizer: torch.distributed.optim.PostLocalSGDOptimizer over a torch::optim
// optimizer. Each step() runs the local optimizer, then the model averager on the optimizer's
// parameter groups.
//
//   auto opt = ddpx::optim::PostLocalSGDOptimizer(
//       std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.01)),
//       std::make_shared<ddpx::optim::PeriodicModelAverager>(4, 100, pg));
//   opt.zero_grad(); loss.backward(); opt.step();
//
// LR schedulers: attach them to optimizer() (the wrapped optimizer owns the parameter groups).
#pragma once

#include <ATen/core/Tensor.h>
#include <ddpx/optim/averagers.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <vector>

namespace ddpx {
namespace optim {

class PostLocalSGDOptimizer {
 public:
  // Both must be non-null (c10::ValueError otherwise).
  PostLocalSGDOptimizer(std::shared_ptr<torch::optim::Optimizer> optim,
                        std::shared_ptr<ModelAverager> averager);

  // The local optimizer's step (with its closure, if any), then averaging. Returns the loss.
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr);
  // torch 2.x's default: gradients set to undefined; false zeroes them.
  void zero_grad(bool set_to_none = true);
  void add_param_group(const torch::optim::OptimizerParamGroup& group);

  // The wrapped optimizer's parameter groups, the same objects (LR schedulers change them).
  std::vector<torch::optim::OptimizerParamGroup>& param_groups();
  const std::vector<torch::optim::OptimizerParamGroup>& param_groups() const;

  // The wrapped optimizer's archive plus the averager's step under kStepKey.
  void save(torch::serialize::OutputArchive& archive) const;
  // Restores save()'s content; without kStepKey it warns and sets the averager's step to 0,
  // as torch.
  void load(torch::serialize::InputArchive& archive);

  // The archive key under which save() stores the averager's step.
  static constexpr const char* kStepKey = "ddpx_post_local_sgd_step";

  // The constructor's arguments.
  const std::shared_ptr<torch::optim::Optimizer>& optimizer() const { return optim_; }
  const std::shared_ptr<ModelAverager>& averager() const { return averager_; }

 private:
  std::shared_ptr<torch::optim::Optimizer> optim_;
  std::shared_ptr<ModelAverager> averager_;
};

}  // namespace optim
}  // namespace ddpx
