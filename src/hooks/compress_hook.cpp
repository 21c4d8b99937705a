#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/compress_hook.h>

#include "comm/exchange.h"
#include "hooks/agreement.h"
#include "hooks/hook_utils.h"
#include "ops/cast.h"

namespace ddpx {
namespace hooks {

using comm::cast_gather_sum_into;
using comm::ExchangeMode;
using comm::resolve_exchange_mode;

CompressHook::CompressHook(ProcessGroupPtr process_group, at::ScalarType dtype,
                           ExchangeMode exchange)
    : pg_(std::move(process_group)),
      dtype_(dtype),
      exchange_(exchange),
      scatter_(std::make_shared<comm::ReduceScatterSum>()) {
  detail::check_compress_dtype(dtype_, "CompressHook");
  detail::check_process_group(pg_, name());
}

std::string CompressHook::name() const {
  return dtype_ == at::kHalf ? "fp16_compress_hook" : "bf16_compress_hook";
}

c10::intrusive_ptr<c10::ivalue::Future> CompressHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  try {
    detail::check_bucket(buffer, name());
    detail::agree_once(agreed_epoch_, pg_, buffer.device(), 0, [&] {
      return detail::Fingerprint(name()).add_choice("exchange", static_cast<int64_t>(exchange_),
                                                    detail::exchange_mode_names());
    });
  } catch (...) {
    scatter_->flush();  // the previous bucket's second round goes out in every rank's order
    throw;
  }
  const double inv_world = 1.0 / pg_->getSize();
  // Decided on what travels (dtype_), not on the fp32 bucket: an fp32 bucket on Gloo takes the
  // chunked exchanges below, cast fused into the staging rows, instead of a full-size 16-bit copy
  // that sum_into would then gather unchunked.
  const ExchangeMode mode =
      resolve_exchange_mode(exchange_, *pg_, dtype_, buffer.device(), /*two_rounds=*/true);
  if (mode == ExchangeMode::kReduceScatter) {
    return scatter_->start(pg_, buffer, dtype_, inv_world, buffer, 1.0, bucket.isLast());
  }
  scatter_->flush();
  if (mode != ExchangeMode::kAllgather) {
    at::Tensor compressed = ops::scaled_cast(buffer, dtype_, inv_world);
    return comm::sum_into(pg_, compressed, buffer, 1.0, exchange_);
  }
  // Gather path: compress, gather and sum chunk by chunk, so that casting the next chunk and
  // summing the previous ones overlap the transfers. All chunks' collectives are issued here,
  // in order, so every rank issues the same sequence.
  const int64_t n = buffer.numel();
  const int64_t step = comm::exchange_chunk_length(n);
  if (step >= n) return cast_gather_sum_into(pg_, buffer, dtype_, inv_world, buffer, 1.0);
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> parts(
      c10::FutureType::create(c10::TensorType::get()));
  for (int64_t begin = 0; begin < n; begin += step) {
    const at::Tensor slice = buffer.narrow(0, begin, std::min(step, n - begin));
    parts.push_back(cast_gather_sum_into(pg_, slice, dtype_, inv_world, slice, 1.0));
  }
  return comm::all_done(parts, buffer);
}

CommHookPtr fp16_compress_hook(ProcessGroupPtr process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kHalf);
}

CommHookPtr bf16_compress_hook(ProcessGroupPtr process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kBFloat16);
}

}  // namespace hooks
}  // namespace ddpx
