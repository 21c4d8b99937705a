// quantization_pertensor_hook / quantization_perchannel_hook: torch's uint8 min-max quantization
// hooks, with the same results bit for bit and one collective per bucket instead of two.
#pragma once

#include <ddpx/hooks/comm_hook.h>

#include <cstdint>

namespace ddpx {
namespace hooks {

// Quantizes the bucket to uint8 with torch.ao.quantization's MinMaxObserver parameters (per
// tensor, or per channel of `bucket_size` values of the bucket padded with zeros, as torch pads:
// a whole channel of zeros more when the length is a multiple), gathers every rank's parameters
// and values, and writes the mean of the dequantized values, summed in fp32 in rank order, back
// into the bucket's own buffer and dtype: what torch's hooks return, bit for bit, for fp32, fp64,
// fp16 and bf16 buckets on CPU (torch returns fp32, which DDP casts into the gradients).
//
// Torch gathers the parameters first and the values from that collective's callback. A rank
// quantizes with its own parameters, which it knows locally, so here one row of bytes per rank
// carries both (kernels/quantize.h), in one all-to-all issued from runHook; the callback only
// dequantizes and sums. A non-finite gradient makes its channel's scale NaN, so the channel's
// mean is NaN on every rank (torch's hook gives NaN there too), never a silently finite value.
// Thread-safety: as any hook, runHook is called from DDP's autograd thread; the object keeps
// no per-bucket state.
class QuantizationHook final : public CommHook {
 public:
  // bucket_size 0: per tensor (one channel, no padding); >= 1: per channel.
  QuantizationHook(ProcessGroupPtr process_group, int64_t bucket_size);

  std::string name() const override;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

  // The constructor's arguments.
  const ProcessGroupPtr& process_group() const { return pg_; }
  int64_t bucket_size() const { return bucket_size_; }

 private:
  ProcessGroupPtr pg_;
  int64_t bucket_size_;
};

// Factories mirroring torch's names and defaults.
CommHookPtr quantization_pertensor_hook(ProcessGroupPtr process_group);
CommHookPtr quantization_perchannel_hook(ProcessGroupPtr process_group, int64_t bucket_size = 512);

}  // namespace hooks
}  // namespace ddpx
