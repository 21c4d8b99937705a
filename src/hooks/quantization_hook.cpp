#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/quantization_hook.h>

#include <algorithm>

#include "comm/exchange.h"
#include "hooks/agreement.h"
#include "hooks/hook_utils.h"
#include "ops/quantize.h"

namespace ddpx {
namespace hooks {

QuantizationHook::QuantizationHook(ProcessGroupPtr process_group, int64_t bucket_size)
    : pg_(std::move(process_group)), bucket_size_(bucket_size) {
  detail::check_process_group(pg_, name());
  TORCH_CHECK_VALUE(bucket_size_ >= 0, name(), ": bucket_size must be >= 1, got ", bucket_size_);
}

std::string QuantizationHook::name() const {
  return bucket_size_ == 0 ? "quantization_pertensor_hook" : "quantization_perchannel_hook";
}

c10::intrusive_ptr<c10::ivalue::Future> QuantizationHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name());
  detail::agree_once(agreed_epoch_, pg_, buffer.device(), 0,
                     [&] { return detail::Fingerprint(name()).add("bucket_size", bucket_size_); });
  const int64_t n = buffer.numel();
  // torch pads bucket_size - n % bucket_size zeros: n / bucket_size + 1 channels, always.
  const int64_t channel = bucket_size_ == 0 ? std::max<int64_t>(n, 1) : bucket_size_;
  const int64_t channels = bucket_size_ == 0 ? 1 : n / bucket_size_ + 1;
  comm::RowGather gather(pg_, ops::quantized_row_bytes(n, channels), buffer.options());
  ops::quantize_row_into(buffer, channel, channels, gather.own_row());
  const int64_t rank = pg_->getRank();
  return gather.start(
      [buffer, channel, channels, rank](const at::Tensor& peers, const at::Tensor& own) {
        ops::dequantize_mean_into(peers, own, rank, channel, channels, buffer);
        return buffer;
      });
}

CommHookPtr quantization_pertensor_hook(ProcessGroupPtr process_group) {
  return std::make_shared<QuantizationHook>(std::move(process_group), 0);
}

CommHookPtr quantization_perchannel_hook(ProcessGroupPtr process_group, int64_t bucket_size) {
  TORCH_CHECK_VALUE(bucket_size >= 1,
                    "quantization_perchannel_hook: bucket_size must be >= 1, got ", bucket_size);
  return std::make_shared<QuantizationHook>(std::move(process_group), bucket_size);
}

}  // namespace hooks
}  // namespace ddpx
