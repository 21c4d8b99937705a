// Parameter averaging: the bucketed engine with AllreduceMean (which validates the tensors).
#include <c10/util/Exception.h>
#include <ddpx/comm/average.h>

namespace ddpx {
namespace comm {

std::vector<at::Tensor> params_with_grad(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  out.reserve(params.size());
  for (const at::Tensor& p : params) {
    if (p.defined() && p.grad().defined()) out.push_back(p);
  }
  return out;
}

AverageStats average_parameters(const std::vector<at::Tensor>& params,
                                const ProcessGroupPtr& process_group,
                                const AverageOptions& options) {
  AverageOptions named = options;
  named.caller = "average_parameters";
  return run_bucketed(params, process_group, AllreduceMean(), named);
}

}  // namespace comm
}  // namespace ddpx
