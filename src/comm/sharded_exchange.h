// The owner-sharded exchange (private to src/): the one reduce-scatter of the hooks whose values
// travel encoded (quantized_hook, ZeRO-2's reduce_scatter_hook and its quantized variant).
//
// A bucket is cut into blocks, each with an owner rank (a ShardPlan). Two rounds, each one
// all-to-all:
//   scatter: every rank encodes the blocks each other rank owns (plus its residual there) and
//            sends them to their owner; the owner sums the W - 1 decoded pieces and its own values
//            (which cross no wire and enter exactly), each term scaled before it is added, in
//            rank order, into a packed buffer of its blocks (OwnerScatter);
//   gather:  every owner encodes its packed blocks (plus an owner-level residual) once and sends
//            them to every rank, which decodes every owner's blocks into the bucket
//            (gather_from_owners): every rank ends with the same bits;
// and the one-round form, all_gather_sum: every rank encodes every block once and sends that to
// every other rank, and each sums all W messages in rank order.
// quantized_hook runs scatter then gather (its "reduce_scatter" exchange) or all_gather_sum;
// reduce_scatter_hook runs scatter only (each owner keeps its sum, the other values are zeros).
//
// Codecs: quantized blocks (QuantCodec: kernels/quantize_ef.h's format) or the values themselves
// in a wire dtype (RawCodec). Blocks whose values are all zero keep their residual for a later
// step and travel as zeros (see QuantCodec).
//
// Ordering: every collective is issued on the calling thread, so that the ranks issue them in
// the order of the calls (from runHook, in bucket order). Lifetimes: every buffer is held by the
// futures and callbacks that use it (StagingPool::Lease) and, on a device, recorded on the streams
// that read it, so that neither the pool nor the caching allocator hands it out while queued
// kernels still use it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "comm/staging.h"
#include "kernels/quantize_ef.h"
#include "ops/quantized.h"

namespace ddpx {
namespace comm {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// The streams of a sum's terms (quantized rotations): term t was encoded with stream0 + t * step.
struct TermStreams {
  uint64_t stream0 = 0;
  uint64_t step = 0;
};

// How blocks travel: encoded into bytes, decoded from them. Implementations are immutable.
class Codec {
 public:
  virtual ~Codec() = default;
  // Bytes of a message of the blocks of `blocks`.
  virtual int64_t message_bytes(const ops::BlockTable& blocks) const = 0;
  // The dtype a sum of decoded values of dtype `t` accumulates in.
  virtual at::ScalarType sum_dtype(at::ScalarType t) const = 0;
  // message = the blocks of x, plus `residual` (undefined: none; else fp32 indexed like x), which
  // receives the new error; `stream`: the draws (rotation, stochastic rounding).
  virtual void encode(const at::Tensor& x, const at::Tensor& residual,
                      const ops::BlockTable& blocks, uint64_t stream,
                      const at::Tensor& message) const = 0;
  // dst (sum_dtype, indexed by `blocks`) = the sum over the rows of `rows` ([rows, bytes], each a
  // message of `blocks`) of `scale` times its values, in row order, with `exact` (x defined)
  // one more term at its row. The rows are received messages, spent here: a codec may scale
  // them in place.
  virtual void decode_sum(const at::Tensor& rows, const ops::BlockTable& blocks, double scale,
                          const at::Tensor& dst, const ops::ExactValues& exact,
                          TermStreams streams) const = 0;
  // dst (any floating dtype, indexed by `blocks`) = the values of `message`.
  virtual void decode(const at::Tensor& message, const ops::BlockTable& blocks,
                      const at::Tensor& dst, uint64_t stream) const = 0;
};

// Quantized blocks with error feedback. spec.stream is ignored (each call passes its own).
class QuantCodec final : public Codec {
 public:
  explicit QuantCodec(const kernels::QuantSpec& spec) : spec_(spec) {}
  const kernels::QuantSpec& spec() const { return spec_; }
  int64_t message_bytes(const ops::BlockTable& blocks) const override;
  at::ScalarType sum_dtype(at::ScalarType) const override { return at::kFloat; }
  void encode(const at::Tensor& x, const at::Tensor& residual, const ops::BlockTable& blocks,
              uint64_t stream, const at::Tensor& message) const override;
  void decode_sum(const at::Tensor& rows, const ops::BlockTable& blocks, double scale,
                  const at::Tensor& dst, const ops::ExactValues& exact,
                  TermStreams streams) const override;
  void decode(const at::Tensor& message, const ops::BlockTable& blocks, const at::Tensor& dst,
              uint64_t stream) const override;

 private:
  kernels::QuantSpec spec_;
};

// The values themselves, cast to `wire` (no residual: nothing is lost but the cast). A block of a
// RawCodec's table may be of any length (a whole parameter, a ZeRO piece).
class RawCodec final : public Codec {
 public:
  explicit RawCodec(at::ScalarType wire) : wire_(wire) {}
  int64_t message_bytes(const ops::BlockTable& blocks) const override;
  // fp64 for fp64 values, fp32 otherwise.
  at::ScalarType sum_dtype(at::ScalarType t) const override;
  void encode(const at::Tensor& x, const at::Tensor& residual, const ops::BlockTable& blocks,
              uint64_t stream, const at::Tensor& message) const override;
  void decode_sum(const at::Tensor& rows, const ops::BlockTable& blocks, double scale,
                  const at::Tensor& dst, const ops::ExactValues& exact,
                  TermStreams streams) const override;
  void decode(const at::Tensor& message, const ops::BlockTable& blocks, const at::Tensor& dst,
              uint64_t stream) const override;

 private:
  at::ScalarType wire_;
};

// Who owns which blocks of a bucket, and where the owner's sum lands.
struct ShardPlan {
  int64_t world = 1, rank = 0;
  // Per owner j: the blocks it owns, in bucket coordinates, and their message's bytes.
  std::vector<ops::BlockTable> to_owner;
  std::vector<int64_t> message_bytes;
  // This rank's blocks, in to_owner[rank]'s order, packed into the owner's sum buffer
  // (owned_values long): where its sum lands.
  ops::BlockTable owned;
  int64_t owned_values = 0;
  // Round one's bytes: sent to the others (every owner's message but this rank's), received.
  int64_t scatter_send_bytes() const;
  int64_t scatter_recv_bytes() const;

  // `to_owner`: per owner, its blocks; `owned_offsets`: where this rank's blocks land in its
  // packed sum buffer (one per block of to_owner[rank]), `owned_values` its length.
  ShardPlan(int64_t world, int64_t rank, std::vector<std::vector<kernels::BlockRef>> to_owner,
            const std::vector<int64_t>& owned_offsets, int64_t owned_values, const Codec& codec,
            const c10::Device& device);
};

// Round one (scatter), in flight from construction (which issues the all-to-all) until sum_into.
// One object per bucket; held by shared_ptr where a later runHook finishes it.
class OwnerScatter {
 public:
  // Encodes x's blocks of every other owner (plus `residual` there) with `stream` and sends them.
  OwnerScatter(const ProcessGroupPtr& pg, std::shared_ptr<const ShardPlan> plan,
               std::shared_ptr<const Codec> codec, const at::Tensor& x, const at::Tensor& residual,
               uint64_t stream);
  // The collective's future (completes without the sum).
  const FuturePtr& sent() const { return sent_; }
  // Once sent() has completed (a callback of it) or after wait(): sum (codec's sum_dtype,
  // plan.owned_values long) = scale * this rank's own x values at its row, plus scale * each
  // peer's decoded piece, in rank order. Rethrows a failed collective; a peer's poisoned message
  // (poison_message) is a c10::Error naming it.
  void sum_into(const at::Tensor& sum, double scale, TermStreams streams);
  // Waits for the collective: on a device, the current stream waits.
  void wait();

 private:
  std::shared_ptr<const ShardPlan> plan_;
  std::shared_ptr<const Codec> codec_;
  at::Tensor x_;
  StagingPool::Lease send_, recv_;
  FuturePtr sent_;
};

// Round two: every owner's blocks to every rank. Encodes `sum` (plan.owned, plus `residual`) with
// `stream`, sends it to every rank and returns a future that completes, with `out`, once out
// holds every owner's decoded blocks (term j decoded with streams.stream0 + j * streams.step).
// `failed` set: this rank's round one failed; it still issues the collective, with a poisoned
// message, so that its peers are not left waiting, and the future fails with `failed`; a peer
// that receives a poisoned message fails its future naming the rank (CPU messages; on a device
// the poisoned blocks decode as NaN, which no rank reads back to the host).
FuturePtr gather_from_owners(const ProcessGroupPtr& pg, std::shared_ptr<const ShardPlan> plan,
                             std::shared_ptr<const Codec> codec, const at::Tensor& sum,
                             const at::Tensor& residual, uint64_t stream, const at::Tensor& out,
                             TermStreams streams, std::exception_ptr failed = nullptr);

// The one-round form: encodes x's blocks `all` (plus `residual`) with `stream` into one message,
// sends it to every other rank, and returns a future that completes, with `out`, once out (at
// `all`) = the sum over the ranks' messages, in rank order, of `scale` times each (summed in the
// codec's sum dtype, then cast to out's): every rank gets the same bits.
FuturePtr all_gather_sum(const ProcessGroupPtr& pg, std::shared_ptr<const ops::BlockTable> all,
                         std::shared_ptr<const Codec> codec, const at::Tensor& x,
                         const at::Tensor& residual, uint64_t stream, double scale,
                         const at::Tensor& out, TermStreams streams);

// A message that says "its sender failed": every byte 0xff (a quantized scale and a raw value of
// those bytes are NaN payloads that the kernels never write). poisoned() reads the first four
// bytes (CPU messages only; false on a device).
void poison_message(const at::Tensor& message);
bool poisoned(const at::Tensor& message);

}  // namespace comm
}  // namespace ddpx
