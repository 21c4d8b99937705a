// quantized_hook: each bucket through the owner-sharded exchange (comm/sharded_exchange.h) with
// quantized blocks, by reduce-scatter (two rounds) or all-gather (one). The layouts and residuals
// are in quantized_memory.cpp, the options in quantized_options.cpp, the state in
// quantized_state.cpp.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/quantized_hook.h>

#include "comm/deferred.h"
#include "comm/exchange.h"
#include "hooks/hook_utils.h"
#include "hooks/quantized_memory.h"

namespace ddpx {
namespace hooks {

using comm::ExchangeMode;
using comm::TermStreams;

QuantizedHook::QuantizedHook(QuantizedStatePtr state) : state_(std::move(state)) {
  TORCH_CHECK_TYPE(state_ != nullptr, "quantized_hook: state must be a QuantizedState");
}

c10::intrusive_ptr<c10::ivalue::Future> QuantizedHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name());
  QuantizedState& st = *state_;
  detail::QuantizedMemory& mem = st.memory();
  const ProcessGroupPtr pg = st.process_group();
  const QuantizedOptions o = st.options();
  const bool last = bucket.isLast();
  const int64_t iter = st.iter();
  const int64_t world = pg->getSize();
  const int64_t n = buffer.numel();
  // Before this state's first collective (and again after a checkpoint, set_iter or new
  // options, on every rank alike): the ranks agree on the options and the iteration.
  detail::agree_once(agreed_epoch_, pg, buffer.device(), st.epoch(),
                     [&] { return detail::quantized_fingerprint(o, iter); });
  // Keys from the first iteration on, warm-up included: DDP's initial buckets give every process
  // that builds the model the same keys, which a checkpoint's residuals are saved under.
  std::vector<int64_t> keys = mem.keys.keys_for(bucket, name(), detail::kQuantizedWho);
  if (last) mem.keys.end_of_iteration();
  if (iter < o.start_iter || world == 1 || n == 0) {
    // Warm-up: allreduce_hook's mean. A group of one (or an empty bucket) has nothing to average.
    mem.deferred.flush();
    st.maybe_increase_iter(last);
    if (iter < o.start_iter) return comm::allreduce_mean(pg, buffer, ExchangeMode::kAuto);
    return detail::completed_future(buffer);
  }
  const int64_t rank = pg->getRank();
  const detail::QuantizedBucket& b = mem.bucket_for(bucket.getIndex(), std::move(keys), bucket, n,
                                                    world, rank, o, buffer.options());
  const std::shared_ptr<const detail::QuantLayout> layout = b.layout;
  const at::Tensor worker = b.worker, server = b.server;
  st.maybe_increase_iter(last);
  mem.bytes_before += n * static_cast<int64_t>(buffer.element_size());
  mem.bytes_after += layout->encoded_bytes;
  const auto codec = detail::quant_codec_of(o);
  const double inv_world = 1.0 / static_cast<double>(world);
  // Rank r's messages are encoded with its own level-0 stream, consecutive in r: a sum's term t
  // (its rank order) was rotated with stream(0) + t.
  const uint64_t rank_stream = detail::quant_stream_id(iter, 0, rank);
  const TermStreams by_rank{detail::quant_stream_id(iter, 0, 0), 1};
  if (layout->gather) {
    mem.deferred.flush();  // a reduce-scatter bucket's second round, should the options change
    return comm::all_gather_sum(pg, layout->all, codec, buffer, worker, rank_stream, inv_world,
                                buffer, by_rank);
  }

  // Round one: every other owner's blocks of (bucket + residual), quantized, to their owner.
  auto scatter =
      std::make_shared<comm::OwnerScatter>(pg, layout->plan, codec, buffer, worker, rank_stream);
  // Round two, from the next runHook: the owners' means, quantized again with their own
  // residual (all with rank 0's level-1 stream), to every rank. The step runs on this thread,
  // in runHook; its callbacks hold buffers only.
  const comm::FuturePtr result = comm::future_on(buffer);
  const uint64_t mean_stream = detail::quant_stream_id(iter, 1, 0);
  comm::DeferredCollective::Step step{
      [pg, scatter, layout, codec, buffer, server, inv_world, by_rank, mean_stream, result] {
        const comm::OnPoolStream on_side(buffer.device());
        // The owned means in fp32, in a reused buffer (a fresh one would fault its pages in
        // every step). A failure here still issues round two (poisoned), so that the peers are
        // not left waiting in it.
        const comm::StagingPool::Lease mean_bytes(layout->plan->owned_values * 4, buffer.options());
        const at::Tensor mean = mean_bytes.get().view(at::kFloat);
        std::exception_ptr failed;
        try {
          scatter->wait();  // on a device: the pool stream waits for the collective
          scatter->sum_into(mean, inv_world, by_rank);
        } catch (...) {
          failed = std::current_exception();
        }
        comm::keep_until_current_stream_done(mean);
        c10::List<comm::FuturePtr> parts(c10::FutureType::create(c10::TensorType::get()));
        parts.push_back(comm::gather_from_owners(pg, layout->plan, codec, mean, server, mean_stream,
                                                 buffer, TermStreams{mean_stream, 0}, failed));
        comm::complete_when_all_done(parts, buffer, result);
      },
      [result](std::exception_ptr error) {
        if (!result->completed()) result->setError(std::move(error));
      }};
  mem.deferred.submit(std::move(step), last);
  return result;
}

CommHookPtr quantized_hook(QuantizedStatePtr state) {
  return std::make_shared<QuantizedHook>(std::move(state));
}

}  // namespace hooks
}  // namespace ddpx
