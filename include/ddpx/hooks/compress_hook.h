// fp16_compress_hook / bf16_compress_hook: average the bucket with 16-bit values on the wire.
#pragma once

#include <ddpx/comm/exchange_mode.h>
#include <ddpx/hooks/comm_hook.h>

#include <memory>

namespace ddpx {
namespace comm {
class ReduceScatterSum;
}  // namespace comm

namespace hooks {

// Casts the bucket to `dtype` (float16 or bfloat16) *after* dividing by the group size, in one
// fused pass (no fp16 overflow from the division coming late), exchanges the 16-bit values and
// writes the decompressed mean back into the bucket's own buffer and dtype.
//
// On Gloo (and for CPU tensors) the 16-bit values are summed by ddpx in fp32, which works for
// bfloat16 too (torch 1.13's Gloo refuses bf16 allreduce) and is faster than Gloo's scalar
// 16-bit summation: on 2 ranks gathered (comm::ExchangeMode::kAllgather), on 3 or more
// reduce-scattered and gathered back (kReduceScatter, a ring's byte count; its second collective
// goes out from the next bucket's runHook, or at once for the last bucket). On NCCL the 16-bit
// allreduce.
class CompressHook final : public CommHook {
 public:
  // `dtype` must be kHalf or kBFloat16 (refused otherwise); `process_group` not null.
  CompressHook(ProcessGroupPtr process_group, at::ScalarType dtype,
               comm::ExchangeMode exchange = comm::ExchangeMode::kAuto);

  std::string name() const override;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

  // The constructor's arguments.
  at::ScalarType dtype() const { return dtype_; }
  const ProcessGroupPtr& process_group() const { return pg_; }
  comm::ExchangeMode exchange() const { return exchange_; }

 private:
  ProcessGroupPtr pg_;
  at::ScalarType dtype_;
  comm::ExchangeMode exchange_;
  std::shared_ptr<comm::ReduceScatterSum> scatter_;  // kReduceScatter's deferred second round
};

// Factories mirroring torch's names.
CommHookPtr fp16_compress_hook(ProcessGroupPtr process_group);
CommHookPtr bf16_compress_hook(ProcessGroupPtr process_group);

}  // namespace hooks
}  // namespace ddpx
