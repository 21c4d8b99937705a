// fp16_compress_wrapper / bf16_compress_wrapper: run any ddpx hook on a 16-bit copy of the bucket.
#pragma once

#include <ddpx/hooks/comm_hook.h>

namespace ddpx {
namespace hooks {

// Casts the bucket buffer to `dtype`, runs the wrapped hook on it, and casts the hook's result
// back into the bucket's original buffer and dtype. As in torch, fp16_compress_wrapper(
// allreduce_hook) averages like fp16_compress_hook (the division happens inside the wrapped
// hook). The bucket's buffer is restored once the wrapped hook has been started.
class CompressWrapper final : public CommHook {
 public:
  // `hook`: the wrapped hook (not null); `dtype`: kHalf or kBFloat16.
  CompressWrapper(CommHookPtr hook, at::ScalarType dtype);

  std::string name() const override;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

  // The constructor's arguments.
  const CommHookPtr& wrapped() const { return hook_; }
  at::ScalarType dtype() const { return dtype_; }

 private:
  CommHookPtr hook_;
  at::ScalarType dtype_;
};

// Factories mirroring torch's names.
CommHookPtr fp16_compress_wrapper(CommHookPtr hook);
CommHookPtr bf16_compress_wrapper(CommHookPtr hook);

}  // namespace hooks
}  // namespace ddpx
