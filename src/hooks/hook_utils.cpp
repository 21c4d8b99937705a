#include "hooks/hook_utils.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace ddpx {
namespace hooks {

namespace detail {

at::Tensor parse_hook_result(const c10::IValue& result, const std::string& hook_name) {
  if (result.isTensor()) return result.toTensor();
  if (result.isTensorList()) {
    auto list = result.toTensorList();
    TORCH_CHECK(list.size() == 1, hook_name, ": expected a future holding one tensor, got ",
                list.size());
    return list.get(0);
  }
  if (result.isList()) {
    auto list = result.toListRef();
    TORCH_CHECK(list.size() == 1 && list[0].isTensor(), hook_name,
                ": expected a future holding one tensor");
    return list[0].toTensor();
  }
  TORCH_CHECK(false, hook_name, ": expected the hook's future to hold a Tensor, got ",
              result.tagKind());
}

void check_bucket(const at::Tensor& buffer, const std::string& hook_name, bool sparse_ok) {
  TORCH_CHECK(buffer.defined(), hook_name, ": the bucket has no gradient buffer");
  TORCH_CHECK(sparse_ok || !buffer.is_sparse(), hook_name,
              ": sparse gradients cannot be compressed (DDP gives sparse buckets for "
              "nn.Embedding(sparse=True)); use dense gradients, or allreduce_hook / "
              "post_localSGD_hook, which average sparse buckets as torch's do");
  TORCH_CHECK(buffer.is_floating_point(), hook_name,
              ": the bucket must hold floating-point gradients, got dtype ", buffer.scalar_type());
  TORCH_CHECK(buffer.is_sparse() || buffer.is_contiguous(), hook_name,
              ": the bucket buffer must be contiguous");
}

void check_process_group(const ProcessGroupPtr& pg, const std::string& hook_name) {
  TORCH_CHECK(pg, hook_name,
              ": process_group must be a torch.distributed ProcessGroup, got None (pass the "
              "group, or None from Python to use the default group)");
}

void check_compress_dtype(at::ScalarType dtype, const std::string& who) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, who,
              ": dtype must be torch.float16 or torch.bfloat16, got ", dtype);
}

c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& value) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  fut->markCompleted(c10::IValue(value));
  return fut;
}

}  // namespace detail

}  // namespace hooks
}  // namespace ddpx
