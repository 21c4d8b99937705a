#include <c10/util/Exception.h>
#include <ddpx/common/compat.h>
#include <ddpx/optim/post_localsgd_optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace ddpx {
namespace optim {

PostLocalSGDOptimizer::PostLocalSGDOptimizer(std::shared_ptr<torch::optim::Optimizer> optim,
                                             std::shared_ptr<ModelAverager> averager)
    : optim_(std::move(optim)), averager_(std::move(averager)) {
  TORCH_CHECK_VALUE(optim_ != nullptr, "PostLocalSGDOptimizer: optim must not be null");
  TORCH_CHECK_VALUE(averager_ != nullptr, "PostLocalSGDOptimizer: averager must not be null");
}

at::Tensor PostLocalSGDOptimizer::step(torch::optim::Optimizer::LossClosure closure) {
  at::Tensor loss = optim_->step(std::move(closure));
  averager_->average_parameters(optim_->param_groups());
  return loss;
}

void PostLocalSGDOptimizer::zero_grad(bool set_to_none) { compat::zero_grad(*optim_, set_to_none); }

void PostLocalSGDOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& group) {
  optim_->add_param_group(group);
}

std::vector<torch::optim::OptimizerParamGroup>& PostLocalSGDOptimizer::param_groups() {
  return optim_->param_groups();
}

const std::vector<torch::optim::OptimizerParamGroup>& PostLocalSGDOptimizer::param_groups() const {
  return optim_->param_groups();
}

void PostLocalSGDOptimizer::save(torch::serialize::OutputArchive& archive) const {
  optim_->save(archive);
  archive.write(kStepKey, c10::IValue(averager_->step()));
}

void PostLocalSGDOptimizer::load(torch::serialize::InputArchive& archive) {
  optim_->load(archive);
  c10::IValue step;
  if (archive.try_read(kStepKey, step)) {
    TORCH_CHECK_TYPE(step.isInt(), "PostLocalSGDOptimizer.load: '", kStepKey,
                     "' must be an int, got ", step.tagKind());
    averager_->set_step(step.toInt());
  } else {
    TORCH_WARN(
        "Loaded state dict does not contain a step counter for an averager. "
        "Setting step counter to 0.");
    averager_->set_step(0);
  }
}

}  // namespace optim
}  // namespace ddpx
