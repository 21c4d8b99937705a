// The hooks' reduction primitives. See src/comm/exchange.h.
#include "comm/exchange.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "comm/staging.h"
#include "common/compat_internal.h"
#include "ops/cast.h"

namespace ddpx {
namespace comm {

using ops::scaled_cast_into;
using ops::sum_rows_with_own_into;

void keep_until_current_stream_done(const at::Tensor& t) {
  if (t.device().is_cpu()) return;
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(t.device()));
}

// The future of a collective's `work` on `device` tensors, taken without making the current
// stream (DDP's autograd stream, in a hook) wait for the collective. torch 2.15's nccl2 backend
// makes its future at getFuture(): it has the *current* stream wait for the collective and marks
// the future complete on that stream, so taken on the autograd stream, every later backward
// kernel would wait for communication. torch's classic ProcessGroupNCCL and Gloo complete it on
// their own streams and ignore the current one. Taken with a side stream current, on either the
// future is CUDA-aware and complete only after the collective's kernels, and its then() callbacks
// run on a stream that waits for them.
c10::intrusive_ptr<c10::ivalue::Future> future_of(c10d::Work& work, const c10::Device& device) {
  const OnPoolStream on_side(device);
  return work.getFuture();
}

OnPoolStream::OnPoolStream(const c10::Device& device) {
  if (device.is_cpu()) return;
  const c10::impl::VirtualGuardImpl impl(device.type());
  guard_.reset_stream(impl.getStreamFromGlobalPool(device));
}

c10::intrusive_ptr<c10::ivalue::Future> sum_into(const ProcessGroupPtr& pg,
                                                 const at::Tensor& values, const at::Tensor& out,
                                                 double scale, ExchangeMode mode) {
  TORCH_INTERNAL_ASSERT(pg);
  TORCH_INTERNAL_ASSERT(values.is_contiguous() && out.is_contiguous());
  TORCH_INTERNAL_ASSERT(values.numel() == out.numel());
  const auto resolved = resolve_exchange_mode(mode, *pg, values.scalar_type(), values.device());
  TORCH_CHECK(resolved != ExchangeMode::kReduceScatter,
              "the reduce_scatter exchange needs a hook that issues its second collective from "
              "its next call (ddpx::comm::ReduceScatterSum); use auto, allreduce or allgather");

  if (resolved == ExchangeMode::kAllgather) {
    return cast_gather_sum_into(pg, values, values.scalar_type(), 1.0, out, scale);
  }

  std::vector<at::Tensor> tensors{values};
  auto work = pg->allreduce(tensors);
  return future_of(*work, values.device())
      ->then(
          [values, out, scale](c10::ivalue::Future& f) {
            f.value();  // rethrows a failed collective
            if (!values.is_same(out) || scale != 1.0) scaled_cast_into(values, out, scale);
            return c10::IValue(out);
          },
          c10::TensorType::get());
}

struct RowGather::Buffers {
  StagingPool::Lease send, recv;
};

RowGather::RowGather(ProcessGroupPtr pg, int64_t row_bytes, const at::TensorOptions& options)
    : pg_(std::move(pg)), row_bytes_(row_bytes) {
  TORCH_INTERNAL_ASSERT(pg_ && row_bytes_ >= 0);
  // Peers only: one copy of this rank's row per other rank (splits of 0 bytes to and from
  // itself, so nothing is copied to self, and Gloo's CUDA path stages no row of its own). The
  // reduction then uses this rank's own row in place.
  const int64_t peers = pg_->getSize() - 1;
  buffers_ = std::make_shared<Buffers>();
  buffers_->send = StagingPool::Lease(std::max<int64_t>(peers, 1) * row_bytes_, options);
  buffers_->recv = StagingPool::Lease(peers * row_bytes_, options);
  own_ = buffers_->send.get().narrow(0, 0, row_bytes_);
}

c10::intrusive_ptr<c10::ivalue::Future> RowGather::start(Reduce reduce) {
  const int64_t world = pg_->getSize();
  const int64_t rank = pg_->getRank();
  const int64_t peers = world - 1;
  const int64_t row_bytes = row_bytes_;
  at::Tensor send = buffers_->send.get(), recv = buffers_->recv.get(), own = own_;
  if (peers > 1) {
    at::Tensor rows = send.view({peers, row_bytes});
    for (int64_t r = 1; r < peers; ++r) rows[r].copy_(rows[0]);
  }
  // The leases go back to the pool with the callback, once it has run.
  auto finish = [buffers = buffers_, own, peers, row_bytes, reduce = std::move(reduce)]() {
    // On a device, this runs on the callback's stream; the own row is in `send`, which (unlike
    // `recv`) is not the collective's value.
    keep_until_current_stream_done(buffers->send.get());
    at::Tensor result = reduce(buffers->recv.get().view({peers, row_bytes}), own);
    return c10::IValue(result);
  };
  if (world == 1) {
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    done->markCompleted(finish());
    return done;
  }
  // Two vectors: ProcessGroupGloo moves from its split-size arguments.
  std::vector<int64_t> out_splits(static_cast<size_t>(world), row_bytes);
  out_splits[static_cast<size_t>(rank)] = 0;
  std::vector<int64_t> in_splits = out_splits;
  auto work = compat::all_to_all_single(*pg_, recv, send, out_splits, in_splits);
  return future_of(*work, send.device())
      ->then(
          [finish](c10::ivalue::Future& f) {
            f.value();  // rethrows a failed collective: then() does not propagate errors itself
            return finish();
          },
          c10::TensorType::get());
}

c10::intrusive_ptr<c10::ivalue::Future> cast_gather_sum_into(
    const ProcessGroupPtr& pg, const at::Tensor& src, at::ScalarType wire_dtype, double pre_scale,
    const at::Tensor& out, double post_scale) {
  TORCH_INTERNAL_ASSERT(pg && src.is_contiguous() && out.is_contiguous());
  TORCH_INTERNAL_ASSERT(src.numel() == out.numel());
  const int64_t n = src.numel();
  const int64_t row_bytes = n * static_cast<int64_t>(c10::elementSize(wire_dtype));
  const int64_t rank = pg->getRank();
  RowGather gather(pg, row_bytes, src.options());
  scaled_cast_into(src, gather.own_row().view(wire_dtype), pre_scale);
  // The rows summed in rank order with this rank's own row used in place: every rank sums the
  // same rows in the same order, so replicas stay identical.
  return gather.start(
      [wire_dtype, out, post_scale, rank, n](const at::Tensor& peers, const at::Tensor& own) {
        sum_rows_with_own_into(peers.view(wire_dtype).view({peers.size(0), n}),
                               own.view(wire_dtype), rank, out, post_scale);
        return out;
      });
}

namespace {
c10::intrusive_ptr<c10::ivalue::Future> sparse_allreduce_mean(const ProcessGroupPtr& pg,
                                                              const at::Tensor& tensor) {
  TORCH_INTERNAL_ASSERT(pg && tensor.is_sparse());
  tensor.div_(pg->getSize());
  std::vector<at::Tensor> tensors{tensor};
  auto work = pg->allreduce(tensors);
  return future_of(*work, tensor.device())
      ->then(
          [](c10::ivalue::Future& f) {
            const c10::IValue v = f.value();  // rethrows a failed collective
            return c10::IValue(v.isTensor() ? v.toTensor() : v.toTensorVector().at(0));
          },
          c10::TensorType::get());
}
}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(const ProcessGroupPtr& pg,
                                                       const at::Tensor& tensor,
                                                       ExchangeMode mode) {
  if (tensor.is_sparse()) return sparse_allreduce_mean(pg, tensor);
  const double inv_world = 1.0 / pg->getSize();
  const auto resolved = resolve_exchange_mode(mode, *pg, tensor.scalar_type(), tensor.device());
  TORCH_CHECK(resolved != ExchangeMode::kReduceScatter,
              "allreduce_mean: the reduce_scatter exchange is the hooks' (ReduceScatterSum)");
  if (resolved == ExchangeMode::kAllgather) {
    return sum_into(pg, tensor, tensor, inv_world, ExchangeMode::kAllgather);
  }
  tensor.div_(pg->getSize());
  return sum_into(pg, tensor, tensor, 1.0, ExchangeMode::kAllreduce);
}

namespace {
// Chunk starts on multiples of 64 elements (see exchange_chunk_length).
int64_t ceil_div_aligned(int64_t n, int64_t parts) {
  return ((n + parts - 1) / parts + 63) / 64 * 64;
}
}  // namespace

int64_t exchange_chunk_length(int64_t n) {
  constexpr int64_t kChunkElements = 1 << 20;
  constexpr int64_t kMaxChunks = 8;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, n / kChunkElements));
  return chunks == 1 ? n : ceil_div_aligned(n, chunks);
}

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

FuturePtr future_on(const at::Tensor& value) {
  std::vector<c10::Device> devices;
  if (!value.device().is_cpu()) devices.push_back(value.device());
  return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), devices);
}

void complete_when_all_done(const c10::List<FuturePtr>& parts, const at::Tensor& value,
                            const FuturePtr& result) {
  c10::collectAll(parts)->addCallback([parts, result, value](c10::ivalue::Future& all) {
    if (all.hasError()) {
      result->setError(all.exception_ptr());
      return;
    }
    try {
      const OnPoolStream on_side(value.device());
      for (size_t i = 0; i < parts.size(); ++i) {
        const FuturePtr fut = parts.get(i);
        fut->wait();   // on CUDA: the pool stream waits on the part's events
        fut->value();  // rethrows a failed part
      }
      result->markCompleted(c10::IValue(value));
    } catch (...) {
      result->setError(std::current_exception());
    }
  });
}

FuturePtr all_done(const c10::List<FuturePtr>& parts, const at::Tensor& value) {
  FuturePtr result = future_on(value);
  complete_when_all_done(parts, value, result);
  return result;
}

namespace {
// One chunk of the reduce-scatter exchange between its two rounds. Rank c owns the values
// [c * step, (c + 1) * step) (clipped to n; the last ranks' may be short or empty). The staged
// values are in "own last" order: the peers' chunks in rank order (what the first all-to-all
// sends, one contiguous prefix), then this rank's own chunk, which stays here.
struct ScatterRound {
  at::Tensor out;
  at::ScalarType wire;
  double post_scale;
  int64_t n, rank, own_begin, own_len;
  // All-to-all split sizes in bytes, 0 for this rank: every rank's chunk (what round one sends
  // to each peer and round two receives from it), and this rank's own chunk (what round one
  // receives from each peer and round two sends to it). Passed as copies: ProcessGroupGloo
  // moves from its split-size arguments.
  std::vector<int64_t> chunk_splits, own_splits;
  // Round one's bytes: [n] staged, [(world - 1) * own_len] got.
  StagingPool::Lease send, recv;
  FuturePtr round_one;
};

// The piece [from_at, from_at + len) of `from`, cast and scaled, into `to` at `to_at`.
void cast_piece(const at::Tensor& from, int64_t from_at, const at::Tensor& to, int64_t to_at,
                int64_t len, double scale) {
  if (len > 0) scaled_cast_into(from.narrow(0, from_at, len), to.narrow(0, to_at, len), scale);
}
std::shared_ptr<ScatterRound> start_round_one(const ProcessGroupPtr& pg, const at::Tensor& src,
                                              at::ScalarType wire, double pre_scale,
                                              const at::Tensor& out, double post_scale) {
  auto j = std::make_shared<ScatterRound>();
  const int64_t world = pg->getSize();
  const int64_t es = static_cast<int64_t>(c10::elementSize(wire));
  j->out = out;
  j->wire = wire;
  j->post_scale = post_scale;
  j->n = src.numel();
  j->rank = pg->getRank();
  const int64_t step = ceil_div_aligned(j->n, world);
  auto length_of = [&](int64_t c) { return std::max<int64_t>(0, std::min(step, j->n - c * step)); };
  j->own_begin = std::min(j->n, j->rank * step);
  j->own_len = length_of(j->rank);
  j->send = StagingPool::Lease(j->n * es, src.options());
  j->recv = StagingPool::Lease((world - 1) * j->own_len * es, src.options());
  // Natural order to "own last": [0, own_begin) stays, what follows the own chunk moves down by
  // own_len, the own chunk goes to the end. Every piece starts on a multiple of 64 elements.
  const at::Tensor staged = j->send.get().view(wire);
  const int64_t own_end = j->own_begin + j->own_len;
  cast_piece(src, 0, staged, 0, j->own_begin, pre_scale);
  cast_piece(src, own_end, staged, j->own_begin, j->n - own_end, pre_scale);
  cast_piece(src, j->own_begin, staged, j->n - j->own_len, j->own_len, pre_scale);
  for (int64_t c = 0; c < world; ++c) {
    const bool self = c == j->rank;
    j->chunk_splits.push_back(self ? 0 : length_of(c) * es);
    j->own_splits.push_back(self ? 0 : j->own_len * es);
  }
  std::vector<int64_t> in_splits = j->chunk_splits, out_splits = j->own_splits;
  at::Tensor peers_part = j->send.get().narrow(0, 0, (j->n - j->own_len) * es);
  at::Tensor recv = j->recv.get();
  auto work = compat::all_to_all_single(*pg, recv, peers_part, out_splits, in_splits);
  j->round_one = future_of(*work, src.device());
  return j;
}

// Waits for round one, sums this rank's chunk (fp32, rank order, one rounding to the wire dtype)
// and sends it to every peer; the future completes once `out` holds every rank's summed chunk.
// The callback holds buffers only, no process group (it may run last on a communication
// thread, and the group's destructor joins that thread).
FuturePtr issue_round_two(const ProcessGroupPtr& pg, ScatterRound& j) {
  j.round_one->wait();   // on CUDA: the current stream waits for the collective
  j.round_one->value();  // rethrows a failed round one
  const int64_t world = pg->getSize();
  const int64_t peers = world - 1;
  const int64_t es = static_cast<int64_t>(c10::elementSize(j.wire));
  const StagingPool::Lease send_lease(peers * j.own_len * es, j.send.get().options());
  at::Tensor send = send_lease.get();
  at::Tensor rows = send.view(j.wire).view({peers, j.own_len});
  if (j.own_len > 0) {
    sum_rows_with_own_into(j.recv.get().view(j.wire).view({peers, j.own_len}),
                           j.send.get().view(j.wire).narrow(0, j.n - j.own_len, j.own_len), j.rank,
                           rows[0], j.post_scale);
    for (int64_t r = 1; r < peers; ++r) rows[r].copy_(rows[0]);
  }
  // Round one's buffers are done with (on this stream): back to the pool.
  keep_until_current_stream_done(j.send.get());
  keep_until_current_stream_done(j.recv.get());
  j.send = StagingPool::Lease();
  j.recv = StagingPool::Lease();
  const StagingPool::Lease recv_lease((j.n - j.own_len) * es, send.options());
  at::Tensor recv = recv_lease.get();
  std::vector<int64_t> in_splits = j.own_splits, out_splits = j.chunk_splits;
  auto work = compat::all_to_all_single(*pg, recv, send, out_splits, in_splits);
  const at::ScalarType wire = j.wire;
  const int64_t n = j.n, own_begin = j.own_begin, own_len = j.own_len;
  const at::Tensor out = j.out;
  return future_of(*work, out.device())
      ->then(
          [send_lease, recv_lease, wire, n, own_begin, own_len, out](c10::ivalue::Future& f) {
            f.value();  // rethrows a failed collective
            keep_until_current_stream_done(send_lease.get());
            // The peers' summed chunks came in rank order without this rank's, which is the
            // first row of `send`: back to natural order, into the bucket's dtype.
            const at::Tensor got = recv_lease.get().view(wire);
            const int64_t own_end = own_begin + own_len;
            cast_piece(got, 0, out, 0, own_begin, 1.0);
            cast_piece(got, own_begin, out, own_end, n - own_end, 1.0);
            cast_piece(send_lease.get().view(wire), 0, out, own_begin, own_len, 1.0);
            return c10::IValue(out);
          },
          c10::TensorType::get());
}
}  // namespace

FuturePtr ReduceScatterSum::start(const ProcessGroupPtr& pg, const at::Tensor& src,
                                  at::ScalarType wire_dtype, double pre_scale,
                                  const at::Tensor& out, double post_scale, bool last) {
  TORCH_INTERNAL_ASSERT(pg && src.is_contiguous() && out.is_contiguous());
  TORCH_INTERNAL_ASSERT(src.numel() == out.numel());
  const int64_t n = src.numel();
  if (pg->getSize() == 1 || n == 0) {
    // Nothing to scatter: one row, summed where it is.
    deferred_.flush();
    return cast_gather_sum_into(pg, src, wire_dtype, pre_scale, out, post_scale);
  }
  const int64_t step = exchange_chunk_length(n);  // n > 0 here, so step > 0
  std::vector<std::shared_ptr<ScatterRound>> rounds;
  for (int64_t begin = 0; begin < n; begin += step) {
    const int64_t len = std::min(step, n - begin);
    rounds.push_back(start_round_one(pg, src.narrow(0, begin, len), wire_dtype, pre_scale,
                                     out.narrow(0, begin, len), post_scale));
  }
  FuturePtr result = future_on(out);
  DeferredCollective::Step step_two{
      [pg, rounds, out, result] {
        // Round one's wait and the sums on a pool stream, not on the autograd stream of the
        // runHook that issues this step (see OnPoolStream).
        const OnPoolStream on_side(out.device());
        c10::List<FuturePtr> parts(c10::FutureType::create(c10::TensorType::get()));
        for (const auto& r : rounds) parts.push_back(issue_round_two(pg, *r));
        complete_when_all_done(parts, out, result);
      },
      [result](std::exception_ptr error) {
        if (!result->completed()) result->setError(std::move(error));
      }};
  deferred_.submit(std::move(step_two), last);
  return result;
}

}  // namespace comm
}  // namespace ddpx
