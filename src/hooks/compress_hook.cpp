#include <ddpx/hooks/compress_hook.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <ddpx/compression/cast.h>

namespace ddpx {
namespace hooks {

CompressHook::CompressHook(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                           at::ScalarType dtype, ExchangeMode exchange)
    : pg_(std::move(process_group)), dtype_(dtype), exchange_(exchange) {
  detail::check_compress_dtype(dtype_, "CompressHook");
  detail::check_process_group(pg_, name());
}

std::string CompressHook::name() const {
  return dtype_ == at::kHalf ? "fp16_compress_hook" : "bf16_compress_hook";
}

c10::intrusive_ptr<c10::ivalue::Future> CompressHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name());
  at::Tensor compressed = scaled_cast(buffer, dtype_, 1.0 / pg_->getSize());
  return sum_into(pg_, compressed, buffer, 1.0, exchange_);
}

CommHookPtr fp16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kHalf);
}

CommHookPtr bf16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kBFloat16);
}

}  // namespace hooks
}  // namespace ddpx
