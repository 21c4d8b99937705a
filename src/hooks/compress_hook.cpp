#include <ddpx/hooks/compress_hook.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <ddpx/compression/cast.h>

namespace ddpx {
namespace hooks {
namespace {
// Chunking of the gather path: about 1M elements (2 MiB of 16-bit values) per chunk, at most 8.
constexpr int64_t kChunkElements = 1 << 20;
constexpr int64_t kMaxChunks = 8;
}  // namespace

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
  const double inv_world = 1.0 / pg_->getSize();
  if (resolve_exchange_mode(exchange_, *pg_, buffer) != ExchangeMode::kAllgather) {
    at::Tensor compressed = scaled_cast(buffer, dtype_, inv_world);
    return sum_into(pg_, compressed, buffer, 1.0, exchange_);
  }
  // Gather path: compress, gather and sum chunk by chunk, so that casting the next chunk and
  // summing the previous ones overlap the transfers. All chunks' collectives are issued here,
  // in order, so every rank issues the same sequence.
  const int64_t n = buffer.numel();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, n / kChunkElements));
  const int64_t step = (n + chunks - 1) / chunks;
  if (chunks == 1) return cast_gather_sum_into(pg_, buffer, dtype_, inv_world, buffer, 1.0);
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> parts(
      c10::FutureType::create(c10::TensorType::get()));
  for (int64_t begin = 0; begin < n; begin += step) {
    const at::Tensor slice = buffer.narrow(0, begin, std::min(step, n - begin));
    parts.push_back(cast_gather_sum_into(pg_, slice, dtype_, inv_world, slice, 1.0));
  }
  return c10::collectAll(parts)->then(
      [buffer](c10::ivalue::Future& all) {
        for (const auto& part : all.value().toList()) part.get().toFuture()->value();  // rethrow
        return c10::IValue(buffer);
      },
      c10::TensorType::get());
}

CommHookPtr fp16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kHalf);
}

CommHookPtr bf16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kBFloat16);
}

}  // namespace hooks
}  // namespace ddpx
