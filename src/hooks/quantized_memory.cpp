// quantized_hook's layouts and residuals. See src/hooks/quantized_memory.h.
#include "hooks/quantized_memory.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <torch/csrc/distributed/c10d/comm.hpp>

namespace ddpx {
namespace hooks {
namespace detail {

using comm::ExchangeMode;

bool QuantLayout::same(const std::vector<int64_t>& k, int64_t n_, int64_t w, int64_t r,
                       const QuantizedOptions& o) const {
  return keys == k && n == n_ && world == w && rank == r && bits == o.bits &&
         block == o.block_size && error_feedback == o.use_error_feedback && gather == gathers(o, w);
}

bool QuantLayout::gathers(const QuantizedOptions& o, int64_t w) {
  return o.exchange == ExchangeMode::kAllgather || (o.exchange == ExchangeMode::kAuto && w == 2);
}

namespace {
// Draw index of value `offset` of the parameter with key k: keys below 2^24, offsets below 2^40.
uint64_t draw_of(int64_t key, int64_t offset) {
  return (static_cast<uint64_t>(key) << 40) + static_cast<uint64_t>(offset);
}

std::shared_ptr<QuantLayout> make_layout(std::vector<int64_t> keys, const c10d::GradBucket& b,
                                         int64_t n, int64_t world, int64_t rank,
                                         const QuantizedOptions& o, const c10::Device& device) {
  auto L = std::make_shared<QuantLayout>();
  L->keys = std::move(keys);
  L->n = n;
  L->world = world;
  L->rank = rank;
  L->bits = o.bits;
  L->block = o.block_size;
  L->error_feedback = o.use_error_feedback;
  L->gather = QuantLayout::gathers(o, world);
  // DDP's dense bucket is its parameters' gradients back to back, in getParameters() order.
  int64_t offset = 0;
  for (const at::Tensor& p : b.getParameters()) {
    L->offsets.push_back(offset);
    L->lengths.push_back(p.numel());
    offset += p.numel();
  }
  TORCH_CHECK(offset == n, "quantized_hook: the bucket's parameters hold ", offset,
              " values and its buffer ", n);
  std::vector<std::vector<kernels::BlockRef>> to_owner(static_cast<size_t>(world));
  std::vector<kernels::BlockRef> all;
  std::vector<int64_t> owned_offsets;
  const int64_t B = o.block_size;
  for (size_t i = 0; i < L->keys.size(); ++i) {
    const int64_t k = L->keys[i];
    for (int64_t off = 0, blk = 0; off < L->lengths[i]; off += B, ++blk) {
      const int64_t len = std::min(B, L->lengths[i] - off);
      const int64_t owner = (k + blk) % world;
      const kernels::BlockRef ref{L->offsets[i] + off, len, draw_of(k, off)};
      to_owner[static_cast<size_t>(owner)].push_back(ref);
      all.push_back(ref);
      if (owner == rank) {
        owned_offsets.push_back(static_cast<int64_t>(owned_offsets.size()) * B);
        L->owned_from.emplace_back(i, off);
      }
    }
  }
  const auto codec = quant_codec_of(o);
  const int64_t owned_values = static_cast<int64_t>(owned_offsets.size()) * B;
  L->plan = std::make_shared<const comm::ShardPlan>(world, rank, std::move(to_owner), owned_offsets,
                                                    owned_values, *codec, device);
  auto all_table = std::make_shared<ops::BlockTable>(std::move(all));
  L->encoded_bytes = codec->message_bytes(*all_table);
  if (L->gather) {
    all_table->to(device);
    L->all = std::move(all_table);
  }
  return L;
}
}  // namespace

QuantizedBucket& QuantizedMemory::bucket_for(size_t index, std::vector<int64_t> keys,
                                             const c10d::GradBucket& b, int64_t n, int64_t world,
                                             int64_t rank, const QuantizedOptions& o,
                                             const at::TensorOptions& options) {
  auto it = live.find(index);
  if (it != live.end() && it->second.layout->same(keys, n, world, rank, o)) return it->second;
  // A new layout. If any of its parameters is still held by another layout (DDP rebuilt its
  // buckets, the group or the options changed), every bucket goes back to per-parameter form
  // first; the deferred step of the previous bucket updates its server residual, so it runs
  // before.
  bool held = it != live.end();
  for (const int64_t k : keys) held = held || bucket_of_key.count(k) > 0;
  if (held) {
    deferred.flush();
    park_all();
  }
  QuantizedBucket q;
  auto layout = make_layout(std::move(keys), b, n, world, rank, o, options.device());
  const QuantLayout& L = *layout;
  q.layout = std::move(layout);
  if (L.error_feedback) {
    const auto f32 = options.dtype(at::kFloat);
    q.worker = at::zeros({L.n}, f32);
    q.server = at::zeros({L.plan->owned_values}, f32);
    for (size_t i = 0; i < L.keys.size(); ++i) {
      auto w = parked_worker.find(L.keys[i]);
      if (w == parked_worker.end()) continue;
      TORCH_CHECK_VALUE(w->second.numel() == L.lengths[i], "quantized_hook: the residual of ",
                        "parameter ", L.keys[i], " has ", w->second.numel(),
                        " values, the parameter ", L.lengths[i],
                        " (a checkpoint of another model?)");
      q.worker.narrow(0, L.offsets[i], L.lengths[i]).copy_(w->second);
      parked_worker.erase(w);
    }
    // The owner level's residuals: those of the blocks this rank owns by reduce-scatter stay
    // there; the others (every one by all-gather) go to the rank level, where they are sent.
    // An owner-level error e in the mean is sent as W e from one rank (the mean divides by W).
    const double W = static_cast<double>(world);
    for (size_t i = 0; i < L.keys.size(); ++i) {
      auto s = parked_server.find(L.keys[i]);
      if (s == parked_server.end()) continue;
      TORCH_CHECK_VALUE(s->second.numel() == L.lengths[i], "quantized_hook: the owner residual ",
                        "of parameter ", L.keys[i], " has ", s->second.numel(),
                        " values, the parameter ", L.lengths[i]);
      at::Tensor rest = s->second.to(options.device(), at::kFloat, false, /*copy=*/true);
      if (!L.gather) {
        for (size_t m = 0; m < L.owned_from.size(); ++m) {
          if (L.owned_from[m].first != i) continue;
          const int64_t off = L.owned_from[m].second;
          const int64_t len = L.plan->owned.refs()[m].len;
          q.server.narrow(0, m * L.block, len).copy_(rest.narrow(0, off, len));
          rest.narrow(0, off, len).zero_();
        }
      }
      q.worker.narrow(0, L.offsets[i], L.lengths[i]).add_(rest, W);
      parked_server.erase(s);
    }
    if (!L.gather) {
      // This rank's own blocks cross no wire by reduce-scatter, so their rank-level residual
      // (left by an all-gather layout) moves to the owner level, where the mean is sent from.
      for (size_t m = 0; m < L.owned_from.size(); ++m) {
        const auto& [i, off] = L.owned_from[m];
        const int64_t len = L.plan->owned.refs()[m].len;
        at::Tensor w = q.worker.narrow(0, L.offsets[i] + off, len);
        q.server.narrow(0, m * L.block, len).add_(w, 1.0 / W);
        w.zero_();
      }
    }
  }
  for (const int64_t k : L.keys) bucket_of_key[k] = index;
  return live[index] = std::move(q);
}

void QuantizedMemory::park_all() {
  for (const auto& entry : live) {
    const QuantizedBucket& b = entry.second;
    const QuantLayout& L = *b.layout;
    if (!b.worker.defined()) continue;
    for (size_t i = 0; i < L.keys.size(); ++i) {
      parked_worker[L.keys[i]] = b.worker.narrow(0, L.offsets[i], L.lengths[i]).clone();
    }
    for (size_t m = 0; m < L.owned_from.size(); ++m) {
      const auto& [i, off] = L.owned_from[m];
      auto s = parked_server.find(L.keys[i]);
      if (s == parked_server.end()) {
        s = parked_server.emplace(L.keys[i], at::zeros({L.lengths[i]}, b.server.options())).first;
      }
      const int64_t len = L.plan->owned.refs()[m].len;
      s->second.narrow(0, off, len).copy_(b.server.narrow(0, m * L.block, len));
    }
  }
  live.clear();
  bucket_of_key.clear();
}

std::map<int64_t, at::Tensor> QuantizedMemory::workers() const {
  std::map<int64_t, at::Tensor> out;
  for (const auto& [k, t] : parked_worker) out[k] = t.detach().cpu().clone();
  for (const auto& entry : live) {
    const QuantizedBucket& b = entry.second;
    if (!b.worker.defined()) continue;
    const QuantLayout& L = *b.layout;
    for (size_t i = 0; i < L.keys.size(); ++i) {
      out[L.keys[i]] = b.worker.narrow(0, L.offsets[i], L.lengths[i]).detach().cpu().clone();
    }
  }
  return out;
}

std::map<int64_t, at::Tensor> QuantizedMemory::servers() const {
  std::map<int64_t, at::Tensor> out;
  for (const auto& [k, t] : parked_server) out[k] = t.detach().cpu().clone();
  for (const auto& entry : live) {
    const QuantizedBucket& b = entry.second;
    if (!b.server.defined()) continue;
    const QuantLayout& L = *b.layout;
    for (size_t m = 0; m < L.owned_from.size(); ++m) {
      const auto& [i, off] = L.owned_from[m];
      auto it = out.find(L.keys[i]);
      if (it == out.end()) it = out.emplace(L.keys[i], at::zeros({L.lengths[i]}, at::kFloat)).first;
      const int64_t len = L.plan->owned.refs()[m].len;
      it->second.narrow(0, off, len).copy_(b.server.narrow(0, m * L.block, len));
    }
  }
  return out;
}

void QuantizedMemory::clear() {
  live.clear();
  bucket_of_key.clear();
  parked_worker.clear();
  parked_server.clear();
}

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
