// The owner-sharded exchange. See src/comm/sharded_exchange.h.
#include "comm/sharded_exchange.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <utility>

#include "common/compat_internal.h"
#include "ops/cast.h"

namespace ddpx {
namespace comm {

// This file's helpers, in a namespace of their own (unity builds merge anonymous namespaces).
namespace sharded {
kernels::Unrotate unrotate_of(const kernels::QuantSpec& spec, TermStreams streams) {
  kernels::Unrotate u;
  u.on = spec.rotate;
  u.seed = spec.seed;
  u.stream0 = streams.stream0;
  u.stream_step = streams.step;
  return u;
}

// Whether the blocks lie back to back from value 0, in order: a raw message of them is then
// the values as they are in a buffer indexed by the table.
bool packed_in_order(const ops::BlockTable& blocks) {
  int64_t at = 0;
  for (const auto& r : blocks.refs()) {
    if (r.begin != at) return false;
    at += r.len;
  }
  return true;
}

c10::IValue value_of(const at::Tensor& t) { return c10::IValue(t); }

// The tensors are read by kernels queued on the current stream (a pool stream or a callback's,
// not the one they were allocated on): their memory is not handed out again before those run.
void keep(const ops::BlockTable& t) {
  if (t.device_refs().defined()) keep_until_current_stream_done(t.device_refs());
}
void keep(const at::Tensor& t) {
  if (t.defined()) keep_until_current_stream_done(t);
}
}  // namespace sharded
using sharded::keep;
using sharded::packed_in_order;
using sharded::unrotate_of;
using sharded::value_of;

// ---- QuantCodec ---------------------------------------------------------------------------------

int64_t QuantCodec::message_bytes(const ops::BlockTable& blocks) const {
  return ops::quantized_message_bytes(blocks.size(), spec_.bits, spec_.block);
}

void QuantCodec::encode(const at::Tensor& x, const at::Tensor& residual,
                        const ops::BlockTable& blocks, uint64_t stream,
                        const at::Tensor& message) const {
  kernels::QuantSpec spec = spec_;
  spec.stream = stream;
  ops::quantize_ef_into(x, residual, blocks, spec, message);
}

void QuantCodec::decode_sum(const at::Tensor& rows, const ops::BlockTable& blocks, double scale,
                            const at::Tensor& dst, const ops::ExactValues& exact,
                            TermStreams streams) const {
  ops::dequantize_sum_into(rows, blocks, spec_.bits, spec_.block, static_cast<float>(scale), dst,
                           exact, unrotate_of(spec_, streams));
}

void QuantCodec::decode(const at::Tensor& message, const ops::BlockTable& blocks,
                        const at::Tensor& dst, uint64_t stream) const {
  ops::dequantize_into(message, blocks, spec_.bits, spec_.block, dst,
                       unrotate_of(spec_, TermStreams{stream, 0}));
}

// ---- RawCodec -----------------------------------------------------------------------------------

int64_t RawCodec::message_bytes(const ops::BlockTable& blocks) const {
  int64_t values = 0;
  for (const auto& r : blocks.refs()) values += r.len;
  return values * static_cast<int64_t>(c10::elementSize(wire_));
}

at::ScalarType RawCodec::sum_dtype(at::ScalarType t) const {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

void RawCodec::encode(const at::Tensor& x, const at::Tensor& residual,
                      const ops::BlockTable& blocks, uint64_t /*stream*/,
                      const at::Tensor& message) const {
  TORCH_INTERNAL_ASSERT(!residual.defined(), "RawCodec: the values travel whole, no residual");
  const at::Tensor values = message.narrow(0, 0, message_bytes(blocks)).view(wire_);
  int64_t at = 0;
  for (const auto& r : blocks.refs()) {
    ops::scaled_cast_into(x.narrow(0, r.begin, r.len), values.narrow(0, at, r.len), 1.0);
    at += r.len;
  }
}

void RawCodec::decode_sum(const at::Tensor& rows, const ops::BlockTable& blocks, double scale,
                          const at::Tensor& dst, const ops::ExactValues& exact,
                          TermStreams /*streams*/) const {
  // A raw plan packs the owner's blocks back to back in its message order, so each row is the
  // packed sum buffer's values as they are: whole-buffer operations, one per term.
  TORCH_INTERNAL_ASSERT(packed_in_order(blocks), "RawCodec: the sum's blocks must be packed");
  int64_t count = 0;
  for (const auto& r : blocks.refs()) count += r.len;
  const at::Tensor sum = dst.narrow(0, 0, count);
  const int64_t peers = rows.size(0);
  const int64_t terms = peers + (exact.x.defined() ? 1 : 0);
  // Each term scaled before it is added (as allreduce_hook divides first): no overflow where
  // the mean is finite. Two roundings, product then sum, each term scaled in its own buffer (no
  // temporary of the whole sum per term; add_'s alpha may fuse the two roundings into one on some
  // paths and not on others).
  for (int64_t t = 0; t < terms; ++t) {
    at::Tensor term;
    if (exact.x.defined() && t == exact.row) {
      // This rank's own values, packed as the rows are (into the sum itself when first).
      term = t == 0 ? sum : at::empty({count}, dst.options());
      int64_t at = 0;
      for (const auto& r : exact.table->refs()) {
        term.narrow(0, at, r.len).copy_(exact.x.narrow(0, r.begin, r.len));
        at += r.len;
      }
    } else {
      const int64_t r = exact.x.defined() && t > exact.row ? t - 1 : t;
      term =
          rows[r].narrow(0, 0, count * static_cast<int64_t>(c10::elementSize(wire_))).view(wire_);
      if (term.scalar_type() != sum.scalar_type()) term = term.to(sum.scalar_type());
    }
    if (t == 0) {
      if (!term.is_same(sum)) sum.copy_(term);
      sum.mul_(scale);
    } else {
      term.mul_(scale);
      sum.add_(term);
    }
  }
}

void RawCodec::decode(const at::Tensor& message, const ops::BlockTable& blocks,
                      const at::Tensor& dst, uint64_t /*stream*/) const {
  const at::Tensor values = message.narrow(0, 0, message_bytes(blocks)).view(wire_);
  int64_t at = 0;
  for (const auto& r : blocks.refs()) {
    ops::scaled_cast_into(values.narrow(0, at, r.len), dst.narrow(0, r.begin, r.len), 1.0);
    at += r.len;
  }
}

// ---- ShardPlan ----------------------------------------------------------------------------------

ShardPlan::ShardPlan(int64_t world_, int64_t rank_,
                     std::vector<std::vector<kernels::BlockRef>> blocks,
                     const std::vector<int64_t>& owned_offsets, int64_t owned_values_,
                     const Codec& codec, const c10::Device& device)
    : world(world_), rank(rank_), owned_values(owned_values_) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(blocks.size()) == world && rank >= 0 && rank < world);
  const auto& mine = blocks[static_cast<size_t>(rank)];
  TORCH_INTERNAL_ASSERT(owned_offsets.size() == mine.size());
  std::vector<kernels::BlockRef> owned_refs;
  for (size_t m = 0; m < mine.size(); ++m) {
    owned_refs.push_back({owned_offsets[m], mine[m].len, mine[m].draw});
  }
  owned = ops::BlockTable(std::move(owned_refs));
  owned.to(device);
  for (auto& refs : blocks) {
    ops::BlockTable t(std::move(refs));
    t.to(device);
    message_bytes.push_back(codec.message_bytes(t));
    to_owner.push_back(std::move(t));
  }
}

int64_t ShardPlan::scatter_send_bytes() const {
  int64_t bytes = 0;
  for (int64_t j = 0; j < world; ++j) {
    if (j != rank) bytes += message_bytes[static_cast<size_t>(j)];
  }
  return bytes;
}

int64_t ShardPlan::scatter_recv_bytes() const {
  return (world - 1) * message_bytes[static_cast<size_t>(rank)];
}

// ---- round one ----------------------------------------------------------------------------------

OwnerScatter::OwnerScatter(const ProcessGroupPtr& pg, std::shared_ptr<const ShardPlan> plan,
                           std::shared_ptr<const Codec> codec, const at::Tensor& x,
                           const at::Tensor& residual, uint64_t stream)
    : plan_(std::move(plan)), codec_(std::move(codec)), x_(x) {
  const ShardPlan& P = *plan_;
  const int64_t own_bytes = P.message_bytes[static_cast<size_t>(P.rank)];
  send_ = StagingPool::Lease(P.scatter_send_bytes(), x.options());
  recv_ = StagingPool::Lease(P.scatter_recv_bytes(), x.options());
  // A rank's own blocks cross no wire: they enter its sum as they are, and keep no residual.
  std::vector<int64_t> to_owners, from_others;
  for (int64_t j = 0, at = 0; j < P.world; ++j) {
    const int64_t bytes = j == P.rank ? 0 : P.message_bytes[static_cast<size_t>(j)];
    if (bytes > 0) {
      codec_->encode(x, residual, P.to_owner[static_cast<size_t>(j)], stream,
                     send_.get().narrow(0, at, bytes));
    }
    at += bytes;
    to_owners.push_back(bytes);
    from_others.push_back(j == P.rank ? 0 : own_bytes);
  }
  at::Tensor send = send_.get(), recv = recv_.get();
  auto work = compat::all_to_all_single(*pg, recv, send, from_others, to_owners);
  sent_ = future_of(*work, x.device());
}

void OwnerScatter::wait() { sent_->wait(); }

void OwnerScatter::sum_into(const at::Tensor& sum, double scale, TermStreams streams) {
  sent_->value();  // rethrows a failed collective
  const ShardPlan& P = *plan_;
  const int64_t own_bytes = P.message_bytes[static_cast<size_t>(P.rank)];
  keep(send_.get());
  keep(recv_.get());
  if (P.owned.size() == 0) return;
  keep(x_);
  keep(sum);
  keep(P.owned);
  keep(P.to_owner[static_cast<size_t>(P.rank)]);
  const ops::ExactValues own{x_, &P.to_owner[static_cast<size_t>(P.rank)], P.rank};
  codec_->decode_sum(recv_.get().view({P.world - 1, own_bytes}), P.owned, scale, sum, own, streams);
}

// ---- round two ----------------------------------------------------------------------------------

FuturePtr gather_from_owners(const ProcessGroupPtr& pg, std::shared_ptr<const ShardPlan> plan,
                             std::shared_ptr<const Codec> codec, const at::Tensor& sum,
                             const at::Tensor& residual, uint64_t stream, const at::Tensor& out,
                             TermStreams streams, std::exception_ptr failed) {
  const ShardPlan& P = *plan;
  const int64_t world = P.world, rank = P.rank;
  const int64_t own_bytes = P.message_bytes[static_cast<size_t>(rank)];
  // This rank's message goes to every peer (one copy each: all_to_all_single sends from one
  // buffer) and is decoded from the first copy here; the peers' come in rank order.
  const StagingPool::Lease send(std::max<int64_t>(world - 1, 1) * own_bytes, out.options());
  const StagingPool::Lease recv(P.scatter_send_bytes(), out.options());
  const at::Tensor first = send.get().narrow(0, 0, own_bytes);
  if (failed) {
    poison_message(send.get());
  } else if (own_bytes > 0) {
    keep(sum);
    keep(residual);
    keep(P.owned);
    codec->encode(sum, residual, P.owned, stream, first);
    for (int64_t r = 1; r < world - 1; ++r) {
      send.get().narrow(0, r * own_bytes, own_bytes).copy_(first);
    }
  }
  std::vector<int64_t> to_peers, from_owners;
  for (int64_t j = 0; j < world; ++j) {
    to_peers.push_back(j == rank ? 0 : own_bytes);
    from_owners.push_back(j == rank ? 0 : P.message_bytes[static_cast<size_t>(j)]);
  }
  at::Tensor s = send.get(), r = recv.get();
  auto work = compat::all_to_all_single(*pg, r, s, from_owners, to_peers);
  return future_of(*work, out.device())
      ->then(
          [send, recv, out, plan, codec, streams, failed](c10::ivalue::Future& f) {
            f.value();  // rethrows a failed collective
            if (failed) std::rethrow_exception(failed);
            const ShardPlan& P = *plan;
            keep(send.get());
            keep(recv.get());
            for (int64_t j = 0, at = 0; j < P.world; ++j) {
              const int64_t bytes = P.message_bytes[static_cast<size_t>(j)];
              if (bytes == 0) continue;
              const at::Tensor message =
                  j == P.rank ? send.get().narrow(0, 0, bytes) : recv.get().narrow(0, at, bytes);
              if (j != P.rank) at += bytes;
              TORCH_CHECK(!poisoned(message), "the owner-sharded exchange: rank ", j,
                          " failed before its second round and sent no values (its own error "
                          "says why); this bucket's average is lost on every rank");
              keep(P.to_owner[static_cast<size_t>(j)]);
              codec->decode(message, P.to_owner[static_cast<size_t>(j)], out,
                            streams.stream0 + static_cast<uint64_t>(j) * streams.step);
            }
            return value_of(out);
          },
          c10::TensorType::get());
}

// ---- the one-round form -------------------------------------------------------------------------

FuturePtr all_gather_sum(const ProcessGroupPtr& pg, std::shared_ptr<const ops::BlockTable> all,
                         std::shared_ptr<const Codec> codec, const at::Tensor& x,
                         const at::Tensor& residual, uint64_t stream, double scale,
                         const at::Tensor& out, TermStreams streams) {
  const int64_t world = pg->getSize(), rank = pg->getRank();
  const int64_t S = codec->message_bytes(*all);
  // Row r of `rows`: rank r's message.
  const StagingPool::Lease rows(world * S, x.options());
  StagingPool::Lease copies;
  at::Tensor send, recv;
  std::vector<int64_t> splits(static_cast<size_t>(world), S);
  if (world == 2) {
    // This rank's row goes out as it is and the other one comes in: no copies.
    codec->encode(x, residual, *all, stream, rows.get().narrow(0, rank * S, S));
    send = rows.get().narrow(0, rank * S, S);
    recv = rows.get().narrow(0, (1 - rank) * S, S);
    splits[static_cast<size_t>(rank)] = 0;
  } else {
    // all_to_all_single packs what it receives by source rank, so the rows come in whole, this
    // rank's own from itself; every row sent is a copy of this rank's message.
    copies = StagingPool::Lease(world * S, x.options());
    send = copies.get();
    codec->encode(x, residual, *all, stream, send.narrow(0, 0, S));
    for (int64_t r = 1; r < world; ++r) send.narrow(0, r * S, S).copy_(send.narrow(0, 0, S));
    recv = rows.get();
  }
  // Two vectors, not one passed twice: torch 1.13's Gloo moves each split list into its work,
  // and a second reference to a moved-from vector reads as empty.
  std::vector<int64_t> recv_splits = splits;
  auto work = compat::all_to_all_single(*pg, recv, send, recv_splits, splits);
  return future_of(*work, x.device())
      ->then(
          [rows, copies, all, codec, scale, out, streams, world, S](c10::ivalue::Future& f) {
            f.value();  // rethrows a failed collective
            keep(rows.get());
            keep(copies.get());
            keep(*all);
            const at::ScalarType acc = codec->sum_dtype(out.scalar_type());
            // The sum lands in the bucket directly where it has the sum's dtype.
            if (out.scalar_type() == acc) {
              codec->decode_sum(rows.get().view({world, S}), *all, scale, out, ops::ExactValues(),
                                streams);
            } else {
              const StagingPool::Lease sum_bytes(
                  out.numel() * static_cast<int64_t>(c10::elementSize(acc)), out.options());
              const at::Tensor sum = sum_bytes.get().view(acc);
              codec->decode_sum(rows.get().view({world, S}), *all, scale, sum, ops::ExactValues(),
                                streams);
              out.copy_(sum);
              keep(sum_bytes.get());
            }
            return value_of(out);
          },
          c10::TensorType::get());
}

// ---- poison -------------------------------------------------------------------------------------

void poison_message(const at::Tensor& message) {
  if (message.numel() > 0) message.fill_(0xff);
}

bool poisoned(const at::Tensor& message) {
  if (!message.device().is_cpu() || message.numel() < 4) return false;
  uint32_t head = 0;
  std::memcpy(&head, message.data_ptr(), sizeof(head));
  return head == 0xffffffffu;
}

}  // namespace comm
}  // namespace ddpx
