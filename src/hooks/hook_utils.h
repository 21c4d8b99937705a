// What every hook's runHook and constructor check, and the small futures they return
// (private to the hooks).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ddpx/common/process_group.h>

#include <string>

namespace ddpx {
namespace hooks {
namespace detail {

// Checks what every hook needs of a bucket: dense, contiguous, floating point. Errors name the
// hook and say what to change.
// `sparse_ok`: a sparse bucket (nn.Embedding(sparse=True)) is accepted, as by torch's
// allreduce-based hooks; otherwise it is refused with an error that says what to use.
void check_bucket(const at::Tensor& buffer, const std::string& hook_name, bool sparse_ok = false);

// The tensor a hook's future holds (a Tensor, or a list of one Tensor).
at::Tensor parse_hook_result(const c10::IValue& result, const std::string& hook_name);

// Checks a process group handle given to a hook constructor.
void check_process_group(const ProcessGroupPtr& pg, const std::string& hook_name);

// Checks the 16-bit dtype given to a compression hook or wrapper.
void check_compress_dtype(at::ScalarType dtype, const std::string& who);

// A future that is already complete with `value`.
c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& value);

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
