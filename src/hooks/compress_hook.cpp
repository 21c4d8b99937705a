#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/compress_hook.h>

#include "comm/exchange.h"
#include "hooks/hook_utils.h"
#include "ops/cast.h"

namespace ddpx {
namespace hooks {
using comm::cast_gather_sum_into;

namespace {
// Chunking of the gather path: about 1M elements (2 MiB of 16-bit values) per chunk, at most 8.
constexpr int64_t kChunkElements = 1 << 20;
constexpr int64_t kMaxChunks = 8;

// A future on `buffer`'s device that completes with `buffer` once every chunk's future has.
// Not c10::collectAll(...)->then(...): collectAll's future has no devices, and neither would its
// then(), so on CUDA DDP's wait would not order the autograd stream after the chunks' sum
// kernels, which run on pool streams (review finding B2). Here the completing thread's current
// stream first waits on every chunk (Future::wait() on a CUDA future), and markCompleted then
// records the result's events on that stream, after those waits.
c10::intrusive_ptr<c10::ivalue::Future> all_chunks_done(
    const c10::List<c10::intrusive_ptr<c10::ivalue::Future>>& parts, const at::Tensor& buffer) {
  std::vector<c10::Device> devices;
  if (!buffer.device().is_cpu()) devices.push_back(buffer.device());
  auto result = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), devices);
  c10::collectAll(parts)->addCallback([parts, result, buffer](c10::ivalue::Future& all) {
    if (all.hasError()) {
      result->setError(all.exception_ptr());
      return;
    }
    try {
      for (size_t i = 0; i < parts.size(); ++i) {
        const c10::intrusive_ptr<c10::ivalue::Future> fut = parts.get(i);
        fut->wait();   // on CUDA: the current stream waits on the chunk's events
        fut->value();  // rethrows a failed chunk
      }
      result->markCompleted(c10::IValue(buffer));
    } catch (...) {
      result->setError(std::current_exception());
    }
  });
  return result;
}
}  // namespace

CompressHook::CompressHook(ProcessGroupPtr process_group, at::ScalarType dtype,
                           ExchangeMode exchange)
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
  // Decided on what travels (dtype_), not on the fp32 bucket: an fp32 bucket on Gloo takes the
  // chunked gather below, cast fused into the staging rows, instead of a full-size 16-bit copy
  // that sum_into would then gather unchunked (review finding P2).
  if (resolve_exchange_mode(exchange_, *pg_, dtype_, buffer.device()) != ExchangeMode::kAllgather) {
    at::Tensor compressed = ops::scaled_cast(buffer, dtype_, inv_world);
    return comm::sum_into(pg_, compressed, buffer, 1.0, exchange_);
  }
  // Gather path: compress, gather and sum chunk by chunk, so that casting the next chunk and
  // summing the previous ones overlap the transfers. All chunks' collectives are issued here,
  // in order, so every rank issues the same sequence.
  const int64_t n = buffer.numel();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, n / kChunkElements));
  // Chunk starts on multiples of 64 elements (128 bytes of 16-bit values, 256 of fp32): the
  // cast kernels take their vector path only on aligned pointers (review F2).
  const int64_t step = ((n + chunks - 1) / chunks + 63) / 64 * 64;
  if (chunks == 1) return cast_gather_sum_into(pg_, buffer, dtype_, inv_world, buffer, 1.0);
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> parts(
      c10::FutureType::create(c10::TensorType::get()));
  for (int64_t begin = 0; begin < n; begin += step) {
    const at::Tensor slice = buffer.narrow(0, begin, std::min(step, n - begin));
    parts.push_back(cast_gather_sum_into(pg_, slice, dtype_, inv_world, slice, 1.0));
  }
  return all_chunks_done(parts, buffer);
}

CommHookPtr fp16_compress_hook(ProcessGroupPtr process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kHalf);
}

CommHookPtr bf16_compress_hook(ProcessGroupPtr process_group) {
  return std::make_shared<CompressHook>(std::move(process_group), at::kBFloat16);
}

}  // namespace hooks
}  // namespace ddpx
