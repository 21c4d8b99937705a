// Parameter averaging: validation, then the bucketed engine with AllreduceMean.
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
  TORCH_CHECK_VALUE(options.bucket_cap_bytes > 0,
                    "average_parameters: bucket_cap_bytes must be positive, got ",
                    options.bucket_cap_bytes);
  if (!process_group) return AverageStats{};
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), "average_parameters: parameter ", i, " is undefined");
    TORCH_CHECK_VALUE(p.layout() == at::kStrided, "average_parameters: parameter ", i,
                      " is not a dense tensor (layout ", p.layout(), ")");
    TORCH_CHECK_VALUE(p.is_floating_point() || p.is_complex(), "average_parameters: parameter ", i,
                      " has dtype ", p.scalar_type(), "; only floating-point values average");
  }
  AverageOptions named = options;
  named.caller = "average_parameters";
  return run_bucketed(params, process_group, AllreduceMean(), named);
}

}  // namespace comm
}  // namespace ddpx
