// Parameter averaging over a process group with bounded extra memory: the primitive under the
// model averagers (torch's model_averaging.utils.average_parameters), a client of the bucketed
// engine (comm/bucketed.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ddpx/comm/bucketed.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <vector>

namespace ddpx {
namespace comm {

// Options and statistics of average_parameters: those of the bucketed engine it runs on.
using AverageOptions = BucketOptions;
using AverageStats = BucketStats;

// Replaces every tensor of `params` with its mean over `process_group`, in place, with torch's
// arithmetic: the values are promoted to the tensors' common dtype (as torch.cat promotes),
// divided by the group size, summed by the group's allreduce and cast back to each tensor's
// dtype (run_bucketed with AllreduceMean).
//
// Unlike torch, which flattens every parameter into one buffer (extra memory = the whole
// model), the extra memory is bounded by about two buckets (see run_bucketed). 16-bit tensors
// on CPU or on a Gloo group are averaged in fp32 (backend_sums_natively()).
//
// Parameters may share memory (listed twice, views of one another): each element is averaged
// once, from its original values (see run_bucketed). A null process_group means "this rank is not a
// member": nothing happens. Every member rank must pass tensors of the same shapes, dtypes and
// order; ranks that do not all raise c10::ValueError. Throws c10::ValueError naming the
// tensor's index for an undefined, sparse or non-floating tensor. Blocks until done.
AverageStats average_parameters(const std::vector<at::Tensor>& params,
                                const ProcessGroupPtr& process_group,
                                const AverageOptions& options = {});

// The tensors of `params` that have a gradient (torch's get_params_to_average).
std::vector<at::Tensor> params_with_grad(const std::vector<at::Tensor>& params);

}  // namespace comm
}  // namespace ddpx
