// The hooks' reduction primitives. See src/comm/exchange.h.
#include "comm/exchange.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <ddpx/common/compat.h>

#include <map>
#include <mutex>

#include "ops/cast.h"

namespace ddpx {
namespace comm {

using ops::scaled_cast_into;
using ops::sum_rows_with_own_into;

namespace {

// Reuses CPU staging buffers across calls, so that a step does not allocate (and fault in)
// world_size x bucket bytes per bucket. Bounded; CUDA tensors come from torch's caching
// allocator. (What makes the exchange fast is the all-to-all itself: Gloo's allgather copies
// through a flat buffer of its own; benchmarks/bench_collectives.py, 2 x 13 MB: all-to-all
// 13-14 ms, allgather 25-33 ms.)
class StagingPool {
 public:
  static StagingPool& instance() {
    static StagingPool pool;
    return pool;
  }

  at::Tensor acquire(int64_t nbytes, const at::TensorOptions& options) {
    if (options.device().is_cpu()) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(nbytes);
      if (it != free_.end()) {
        at::Tensor t = std::move(it->second);
        free_.erase(it);
        held_ -= nbytes;
        return t;
      }
    }
    return at::empty({nbytes}, options.dtype(at::kByte));
  }

  void release(at::Tensor t) {
    if (!t.device().is_cpu()) return;
    const int64_t nbytes = t.numel();
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_ + nbytes > kMaxHeldBytes) return;
    held_ += nbytes;
    free_.emplace(nbytes, std::move(t));
  }

 private:
  static constexpr int64_t kMaxHeldBytes = int64_t(512) << 20;
  std::mutex mutex_;
  std::multimap<int64_t, at::Tensor> free_;
  int64_t held_ = 0;
};

// `t` is about to be read on the current stream by work its owners may outlive (a future's
// callback reading a buffer that is not in the parent future's value, so the future machinery
// does not record it): tell the caching allocator, so that its memory is not handed out again
// before that stream is done with it. Nothing to do on CPU.
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
  if (device.is_cpu()) return work.getFuture();
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::StreamGuard on_side(impl.getStreamFromGlobalPool(device));
  return work.getFuture();
}

}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> sum_into(const ProcessGroupPtr& pg,
                                                 const at::Tensor& values, const at::Tensor& out,
                                                 double scale, ExchangeMode mode) {
  TORCH_INTERNAL_ASSERT(pg);
  TORCH_INTERNAL_ASSERT(values.is_contiguous() && out.is_contiguous());
  TORCH_INTERNAL_ASSERT(values.numel() == out.numel());
  const auto resolved = resolve_exchange_mode(mode, *pg, values.scalar_type(), values.device());

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

c10::intrusive_ptr<c10::ivalue::Future> cast_gather_sum_into(
    const ProcessGroupPtr& pg, const at::Tensor& src, at::ScalarType wire_dtype, double pre_scale,
    const at::Tensor& out, double post_scale) {
  TORCH_INTERNAL_ASSERT(pg && src.is_contiguous() && out.is_contiguous());
  TORCH_INTERNAL_ASSERT(src.numel() == out.numel());
  const int64_t world = pg->getSize();
  const int64_t n = src.numel();
  const int64_t row_bytes = n * static_cast<int64_t>(c10::elementSize(wire_dtype));
  auto& pool = StagingPool::instance();
  // Peers only: one row of this rank's values per other rank (splits of 0 bytes to and from
  // itself, so nothing is copied to self, and Gloo's CUDA path stages no row of its own), then
  // the rows summed in rank order with this rank's own row used in place: every rank sums the
  // same rows in the same order, so replicas stay identical.
  const int64_t rank = pg->getRank();
  const int64_t peers = world - 1;
  at::Tensor send = pool.acquire(std::max<int64_t>(peers, 1) * row_bytes, src.options());
  at::Tensor recv = pool.acquire(peers * row_bytes, src.options());
  at::Tensor send_rows = send.view(wire_dtype).view({std::max<int64_t>(peers, 1), n});
  scaled_cast_into(src, send_rows[0], pre_scale);
  for (int64_t r = 1; r < peers; ++r) send_rows[r].copy_(send_rows[0]);
  auto sum = [send, recv, wire_dtype, out, post_scale, rank, peers, n]() {
    // On a device, this runs on the callback's stream; the own row is in `send`, which (unlike
    // `recv`) is not the collective's value.
    keep_until_current_stream_done(send);
    sum_rows_with_own_into(recv.view(wire_dtype).view({peers, n}),
                           send.view(wire_dtype).narrow(0, 0, n), rank, out, post_scale);
    auto& pool = StagingPool::instance();
    pool.release(send);
    pool.release(recv);
    return c10::IValue(out);
  };
  if (world == 1) {
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    done->markCompleted(sum());
    return done;
  }
  // Two vectors: ProcessGroupGloo moves from its split-size arguments.
  std::vector<int64_t> out_splits(static_cast<size_t>(world), row_bytes);
  out_splits[static_cast<size_t>(rank)] = 0;
  std::vector<int64_t> in_splits = out_splits;
  auto work = compat::all_to_all_single(*pg, recv, send, out_splits, in_splits);
  return future_of(*work, src.device())
      ->then(
          [sum](c10::ivalue::Future& f) {
            f.value();  // rethrows a failed collective: then() does not propagate errors itself
            return sum();
          },
          c10::TensorType::get());
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
  if (resolve_exchange_mode(mode, *pg, tensor.scalar_type(), tensor.device()) ==
      ExchangeMode::kAllgather) {
    return sum_into(pg, tensor, tensor, inv_world, ExchangeMode::kAllgather);
  }
  tensor.div_(pg->getSize());
  return sum_into(pg, tensor, tensor, 1.0, ExchangeMode::kAllreduce);
}

}  // namespace comm
}  // namespace ddpx
