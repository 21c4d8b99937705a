// Parameter averaging over a process group with bounded extra memory: the primitive under the
// model averagers (torch's model_averaging.utils.average_parameters).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ddpx {

// DDP's default bucket size.
constexpr int64_t kDefaultAverageBucketBytes = 25 * 1024 * 1024;

struct AverageOptions {
  // Small parameters are packed into staging buckets of at most this many bytes (at most two
  // in flight: one being exchanged while the next is packed). Must be positive.
  int64_t bucket_cap_bytes = kDefaultAverageBucketBytes;
};

// What one call did (for tests and benchmarks).
struct AverageStats {
  int64_t tensors = 0;           // parameters averaged
  int64_t collectives = 0;       // allreduce calls issued
  int64_t inplace_tensors = 0;   // parameters reduced in their own storage (no copy)
  int64_t staged_tensors = 0;    // parameters packed into a staging bucket
  int64_t staging_bytes = 0;     // bytes of staging buffers allocated (all devices)
};

// Replaces every tensor of `params` with its mean over `process_group`, in place (the tensors
// keep their storage; autograd is not recorded), with torch's arithmetic: the values are
// promoted to the tensors' common dtype (as torch.cat promotes), divided by the group size,
// summed by the group's allreduce and cast back to each tensor's dtype.
//
// Unlike torch, which flattens every parameter into one buffer (extra memory = the whole
// model), the extra memory is bounded by about two buckets: contiguous tensors of the common
// dtype and at least a quarter bucket are reduced in their own storage (so are non-contiguous
// but dense ones, e.g. channels_last, in memory order, when every rank lays them out alike:
// checked with one tiny collective, as DDP checks parameter strides); the others are packed
// into reused staging buckets (a tensor larger than a bucket travels in bucket-sized chunks; a
// non-contiguous, non-dense one larger than a bucket goes through a contiguous copy of itself that lives
// only while its chunks are in flight, one such copy at a time). 16-bit tensors on CPU or on a
// Gloo group are averaged in fp32 (Gloo's 16-bit sums are scalar, and wrong for fp16). Tensors
// stay on their own device, each device with its own buckets. At most ~2 buckets of
// collectives are in flight at any time.
//
// A null process_group means "this rank is not a member": nothing happens. Every member rank
// must pass tensors of the same shapes, dtypes and order. Blocks until done.
AverageStats average_parameters(const std::vector<at::Tensor>& params,
                                const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
                                const AverageOptions& options = {});

// The tensors of `params` that have a gradient (torch's get_params_to_average).
std::vector<at::Tensor> params_with_grad(const std::vector<at::Tensor>& params);

}  // namespace ddpx
