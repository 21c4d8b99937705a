// The reduction primitive under the default hooks: sum a tensor over the ranks of a group and
// write the (scaled) sum into an output of any floating dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ddpx {
namespace hooks {

// How 16-bit values travel between ranks.
enum class ExchangeMode {
  // kAllgather for 16-bit tensors on CPU or on a Gloo group, kAllreduce otherwise.
  kAuto = 0,
  // The backend's allreduce in the values' own dtype. Fast on NCCL. Avoid it for 16-bit values on
  // Gloo: Gloo sums fp16 element by element in scalar code, and wrongly (gloo/types.h's
  // float16::operator= skips an assignment when the new bits equal the old bits read as an
  // integer: 43712 + (-0.0530396) gives -0.0530396), and torch 1.13's Gloo refuses bf16.
  kAllreduce = 1,
  // Gather every rank's raw 16-bit values (an equal-split all-to-all of this rank's values, into
  // reused buffers), then sum the world_size rows locally in fp32 with vectorised code. Sends (world_size - 1) * numel * 2 bytes per rank: no more than an fp32
  // ring allreduce (2 * (world_size - 1) / world_size * numel * 4) up to 4 ranks, half of it
  // on 2 ranks; and no 16-bit rounding of partial sums.
  kAllgather = 2,
};

// Parses "auto" / "allreduce" / "allgather".
ExchangeMode parse_exchange_mode(const std::string& name);
const char* exchange_mode_name(ExchangeMode mode);

// The mode kAuto resolves to for values of `wire_dtype` (the dtype that travels) on `device`,
// exchanged over `pg`.
ExchangeMode resolve_exchange_mode(ExchangeMode mode, const c10d::ProcessGroup& pg,
                                   at::ScalarType wire_dtype, const c10::Device& device);
// The same for `values` travelling in their own dtype.
ExchangeMode resolve_exchange_mode(ExchangeMode mode, const c10d::ProcessGroup& pg,
                                   const at::Tensor& values);

// Starts the collective and returns a future that completes, with `out`, once
//   out = cast<out.dtype>(scale * sum over ranks of values)
// holds. `values` (contiguous, floating) may be overwritten; `out` has values.numel() elements
// and may be `values` itself. Both stay alive until the future completes. Collectives are
// issued on the calling thread, so their order across ranks is the order of the calls.
c10::intrusive_ptr<c10::ivalue::Future> sum_into(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                 const at::Tensor& values, const at::Tensor& out,
                                                 double scale, ExchangeMode mode);

// The gather path of sum_into, fused with the cast: writes cast<wire_dtype>(pre_scale * src)
// straight into a (reused) staging buffer, exchanges it with every rank, and completes once
//   out = cast<out.dtype>(post_scale * sum over ranks of the wire values)
// holds, summed in fp32. `src` and `out` may be the same tensor.
c10::intrusive_ptr<c10::ivalue::Future> cast_gather_sum_into(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& src,
    at::ScalarType wire_dtype, double pre_scale, const at::Tensor& out, double post_scale);

// The mean of `tensor` over the group, written back into `tensor`: torch's allreduce_hook (divide,
// then allreduce; bit-identical for fp32/fp64), or for 16-bit values where the mode resolves to
// kAllgather, a gather with the division applied once to the fp32 sum.
c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& tensor, ExchangeMode mode);

}  // namespace hooks
}  // namespace ddpx
