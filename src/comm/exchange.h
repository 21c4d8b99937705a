// The hooks' reduction primitives (private): sum a tensor over the ranks of a group and write the
// (scaled) sum into an output of any floating dtype, with 16-bit values travelling as
// ExchangeMode says (include/ddpx/comm/exchange_mode.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ddpx/comm/exchange_mode.h>
#include <ddpx/common/process_group.h>

namespace ddpx {
namespace comm {

// Starts the collective and returns a future that completes, with `out`, once
//   out = cast<out.dtype>(scale * sum over ranks of values)
// holds. `values` (contiguous, floating) may be overwritten; `out` has values.numel() elements
// and may be `values` itself. Both stay alive until the future completes. Collectives are
// issued on the calling thread, so their order across ranks is the order of the calls.
c10::intrusive_ptr<c10::ivalue::Future> sum_into(const ProcessGroupPtr& pg,
                                                 const at::Tensor& values, const at::Tensor& out,
                                                 double scale, ExchangeMode mode);

// The gather path of sum_into, fused with the cast: writes cast<wire_dtype>(pre_scale * src)
// straight into a (reused) staging buffer, exchanges it with every rank, and completes once
//   out = cast<out.dtype>(post_scale * sum over ranks of the wire values)
// holds, summed in fp32. `src` and `out` may be the same tensor.
c10::intrusive_ptr<c10::ivalue::Future> cast_gather_sum_into(
    const ProcessGroupPtr& pg, const at::Tensor& src, at::ScalarType wire_dtype, double pre_scale,
    const at::Tensor& out, double post_scale);

// The mean of `tensor` over the group, written back into `tensor`: torch's allreduce_hook
// (divide, then allreduce; bit-identical for fp32/fp64), or for 16-bit values where the mode
// resolves to kAllgather, a gather with the division applied once to the fp32 sum. A sparse
// `tensor` (nn.Embedding(sparse=True)) is divided in place and summed by the backend's sparse
// allreduce, as torch's hook does (Gloo; NCCL has none): the future then holds the new,
// coalesced sum, not `tensor`.
c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(const ProcessGroupPtr& pg,
                                                       const at::Tensor& tensor, ExchangeMode mode);

}  // namespace comm
}  // namespace ddpx
