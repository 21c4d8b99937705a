// The hooks' reduction primitives (private): sum a tensor over the ranks of a group and write the
// (scaled) sum into an output of any floating dtype, with 16-bit values travelling as
// ExchangeMode says (include/ddpx/comm/exchange_mode.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <ddpx/comm/exchange_mode.h>
#include <ddpx/common/process_group.h>

#include <functional>
#include <memory>

#include "comm/deferred.h"

namespace ddpx {
namespace comm {

// Starts the collective and returns a future that completes, with `out`, once
//   out = cast<out.dtype>(scale * sum over ranks of values)
// holds (`mode` kReduceScatter is refused: it needs ReduceScatterSum). `values` (contiguous,
// floating) may be overwritten; `out` has values.numel() elements and may be `values` itself. Both
// stay alive until the future completes. Collectives are issued on the calling thread, so their
// order across ranks is the order of the calls.
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

// An exchange of one row of bytes per rank, for values that a hook encodes itself (the
// quantization hooks' parameters and values in one row). Write this rank's row into own_row(),
// then start(): one all-to-all sends it to every peer (Gloo's allgather copies through a flat
// buffer of its own, see StagingPool in exchange.cpp), and the returned future, on the row's
// device, completes with what `reduce(peers, own)` returns once the peers' rows are here.
// `peers` holds them in rank order without this rank's ([world - 1, row_bytes] uint8), `own` is
// own_row(). Both come from a reused staging pool and go back to it after `reduce`, which must
// not keep them. Create and start from runHook (the collective's order is the calls' order);
// one object per exchange.
class RowGather {
 public:
  using Reduce = std::function<at::Tensor(const at::Tensor& peers, const at::Tensor& own)>;
  RowGather(ProcessGroupPtr pg, int64_t row_bytes, const at::TensorOptions& options);
  const at::Tensor& own_row() const { return own_; }
  c10::intrusive_ptr<c10::ivalue::Future> start(Reduce reduce);

 private:
  struct Buffers;  // its staging buffers (exchange.cpp), held until the reduction has run
  ProcessGroupPtr pg_;
  int64_t row_bytes_;
  std::shared_ptr<Buffers> buffers_;
  at::Tensor own_;
};

// The mean of `tensor` over the group, written back into `tensor`: torch's allreduce_hook
// (divide, then allreduce; bit-identical for fp32/fp64), or for 16-bit values where the mode
// resolves to kAllgather, a gather with the division applied once to the fp32 sum. A sparse
// `tensor` (nn.Embedding(sparse=True)) is divided in place and summed by the backend's sparse
// allreduce, as torch's hook does (Gloo; NCCL has none): the future then holds the new,
// coalesced sum, not `tensor`.
c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(const ProcessGroupPtr& pg,
                                                       const at::Tensor& tensor, ExchangeMode mode);

// Chunking of the hooks' staged exchanges, so that casting and summing one chunk overlap the
// transfers of the others: about 1M elements (2 MiB of 16-bit values) per chunk, at most 8,
// each starting on a multiple of 64 elements (128 bytes of 16-bit values, 256 of fp32: the cast
// kernels take their vector path only on aligned pointers). The chunk length for
// `n` elements; n itself when there is one chunk.
int64_t exchange_chunk_length(int64_t n);

// While alive, a stream from torch's pool is the current stream of `device` (on CPU: nothing).
// For a hook's work that waits for a collective first: Future::wait() on a CUDA future makes the
// current stream wait, and in runHook that is DDP's autograd stream, whose later backward kernels
// would then queue behind the communication. The work's results leave through futures whose
// events are recorded on this stream, so whoever waits on them is ordered after it.
class OnPoolStream {
 public:
  explicit OnPoolStream(const c10::Device& device);

 private:
  c10::OptionalStreamGuard guard_;
};

// An empty future on `value`'s device (CUDA-aware where `value` is not on CPU), for a hook's
// result that another future's callback completes.
c10::intrusive_ptr<c10::ivalue::Future> future_on(const at::Tensor& value);

// A future on `value`'s device that completes with `value` once every one of `parts` has.
// Not c10::collectAll(...)->then(...): collectAll's future has no devices, and neither would its
// then(), so on CUDA DDP's wait would not order the autograd stream after the parts' kernels,
// which run on pool streams. Here the completing callback takes a pool stream (OnPoolStream),
// has it wait on every part (Future::wait() on a CUDA future), and markCompleted then records
// the result's events on it, after those waits. Not the caller's stream: with NCCL the parts are
// complete already, the callback runs inline in runHook, and the waits would stall the autograd
// stream until every part's collective and sum were done.
c10::intrusive_ptr<c10::ivalue::Future> all_done(
    const c10::List<c10::intrusive_ptr<c10::ivalue::Future>>& parts, const at::Tensor& value);

// ExchangeMode::kReduceScatter for a hook: start() casts cast<wire_dtype>(pre_scale * src) and
// issues the first all-to-all of each chunk (chunk c of the values to rank c); the second one
// (each rank's summed chunk to its peers) is deferred to the next start() or flush(), or issued
// at once for the last bucket of a backward pass (DeferredCollective: every rank then issues
// the collectives in the same order whatever the timing). The future completes, with `out`,
// once
//   out = cast<out.dtype>(cast<wire_dtype>(post_scale * sum over ranks of the wire values))
// holds, the sum in fp32 in rank order: one 16-bit rounding of the sum more than kAllgather,
// the same result as kAllgather where `out` is 16-bit. Every rank gets the same bits.
// One object per hook; called from runHook only (not thread-safe).
class ReduceScatterSum {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> start(const ProcessGroupPtr& pg, const at::Tensor& src,
                                                at::ScalarType wire_dtype, double pre_scale,
                                                const at::Tensor& out, double post_scale,
                                                bool last);
  // Issues the deferred second round, if any: a runHook that takes another path calls it first.
  void flush() { deferred_.flush(); }

 private:
  DeferredCollective deferred_;
};

}  // namespace comm
}  // namespace ddpx
