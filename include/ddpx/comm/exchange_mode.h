// How values travel between ranks, and the one rule that decides it for 16-bit values.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <ddpx/common/process_group.h>

#include <string>

namespace ddpx {
namespace comm {

// Whether `pg`'s backend should sum values of `dtype` on `device` itself. False for 16-bit
// values (fp16, bf16) on CPU or where the group's backend for `device` is Gloo (in torch 2.x a
// group may map CPU and CUDA to different backends; its default's name is not asked): Gloo sums
// fp16 element by element in scalar code, and wrongly (gloo/types.h's float16::operator= skips an
// assignment when the new bits equal the old bits read as an integer: 43712 + (-0.0530396) gives
// -0.0530396), and torch 1.13's Gloo refuses bf16. Where it is false, ddpx sums 16-bit values
// itself in fp32: the hooks gather them (ExchangeMode::kAllgather), parameter averaging reduces
// them as fp32. Every place that decides how 16-bit values travel asks this function (there is no
// second copy of the rule).
bool backend_sums_natively(const c10d::ProcessGroup& pg, at::ScalarType dtype,
                           const c10::Device& device);

// How the hooks' 16-bit values travel between ranks.
enum class ExchangeMode {
  // Where backend_sums_natively() is true, kAllreduce. Otherwise kReduceScatter on 3 or more
  // ranks in the hooks that can defer a second collective (fp16/bf16_compress_hook, and
  // allreduce_hook on 16-bit buckets), kAllgather everywhere else (2 ranks; PowerSGD's factors
  // and the averagers, which issue one collective per call).
  kAuto = 0,
  // The backend's allreduce in the values' own dtype. Fast on NCCL; see backend_sums_natively()
  // for why not on Gloo.
  kAllreduce = 1,
  // Gather every rank's raw 16-bit values (an all-to-all of this rank's values to its peers, into
  // reused buffers), then sum the world_size rows locally in fp32 in rank order, this rank's own
  // row read where it is, with vectorised code. Sends
  // (world_size - 1) * numel * 2 bytes per rank: no more than an fp32 ring allreduce
  // (2 * (world_size - 1) / world_size * numel * 4) up to 4 ranks, half of it on 2 ranks; and no
  // 16-bit rounding of partial sums.
  kAllgather = 2,
  // Two all-to-alls: each rank sends chunk c of its 16-bit values to rank c, which sums the
  // world_size rows of its chunk in fp32 in rank order and rounds the sum to 16 bits once; then
  // each rank sends its summed chunk to every peer. Sends 2 * (world_size - 1) / world_size *
  // numel * 2 bytes per rank, a ring allreduce's count in 16 bits: on 3 ranks 2/3 of kAllgather's,
  // on 8 ranks 2/7. Replicas stay identical (each chunk is summed by one rank). The second
  // all-to-all needs the first one's result, so a hook issues it from its next runHook
  // (comm::ReduceScatterSum, DeferredCollective); sum_into refuses this mode.
  kReduceScatter = 3,
};

// Parses "auto" / "allreduce" / "allgather" / "reduce_scatter"; c10::Error naming the choices
// otherwise.
ExchangeMode parse_exchange_mode(const std::string& name);
const char* exchange_mode_name(ExchangeMode mode);

// The mode kAuto resolves to for values of `wire_dtype` (the dtype that travels) on `device`,
// exchanged over `pg`, by a caller that can (`two_rounds`) or cannot defer a second collective
// to its next call. Other modes are returned as they are.
ExchangeMode resolve_exchange_mode(ExchangeMode mode, const c10d::ProcessGroup& pg,
                                   at::ScalarType wire_dtype, const c10::Device& device,
                                   bool two_rounds = false);

}  // namespace comm
}  // namespace ddpx
