#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/compress_wrapper.h>

#include "hooks/agreement.h"
#include "hooks/hook_utils.h"
#include "ops/cast.h"

namespace ddpx {
namespace hooks {

CompressWrapper::CompressWrapper(CommHookPtr hook, at::ScalarType dtype)
    : hook_(std::move(hook)), dtype_(dtype) {
  detail::check_compress_dtype(dtype_, "CompressWrapper");
  TORCH_CHECK(hook_ != nullptr, name(), ": hook must be a ddpx hook, got None");
}

std::string CompressWrapper::name() const {
  return dtype_ == at::kHalf ? "fp16_compress_wrapper_hook" : "bf16_compress_wrapper_hook";
}

c10::intrusive_ptr<c10::ivalue::Future> CompressWrapper::runHook(c10d::GradBucket& bucket) {
  at::Tensor original = bucket.getBuffer();
  detail::check_bucket(original, name());
  at::Tensor compressed = ops::scaled_cast(original, dtype_, 1.0);
  bucket.setBuffer(compressed);
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    // The wrapped hook exchanges 16-bit values: its fingerprint names this wrapper.
    const detail::WrappedBy wrapped(name());
    fut = hook_->runHook(bucket);
  } catch (...) {
    bucket.setBuffer(original);
    throw;
  }
  bucket.setBuffer(original);
  // The callback must not own the wrapped hook: it may run last on a communication thread, and a
  // hook can hold the last reference to its ProcessGroup, whose destructor joins that thread.
  return fut->then(
      [original, inner_name = hook_->name()](c10::ivalue::Future& f) {
        at::Tensor result = detail::parse_hook_result(f.value(), inner_name);
        ops::scaled_cast_into(result.contiguous(), original, 1.0);
        return c10::IValue(original);
      },
      c10::TensorType::get());
}

CommHookPtr fp16_compress_wrapper(CommHookPtr hook) {
  return std::make_shared<CompressWrapper>(std::move(hook), at::kHalf);
}

CommHookPtr bf16_compress_wrapper(CommHookPtr hook) {
  return std::make_shared<CompressWrapper>(std::move(hook), at::kBFloat16);
}

}  // namespace hooks
}  // namespace ddpx
