// quantized_hook's working memory (private): how a bucket is cut into blocks and who owns each
// (QuantLayout), the residuals per bucket and per parameter (QuantizedMemory), and the specs,
// streams and fingerprint the hook derives from its options. QuantizedState owns one
// QuantizedMemory; the hook (quantized_hook.cpp) fills and uses it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ddpx/hooks/quantized_hook.h>

#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comm/deferred.h"
#include "comm/sharded_exchange.h"
#include "hooks/agreement.h"
#include "hooks/parameter_keys.h"
#include "kernels/quantize_ef.h"

namespace c10d {
class GradBucket;
}

namespace ddpx {
namespace hooks {
namespace detail {

// Who the options' errors name.
constexpr const char* kQuantizedWho = "QuantizedState";

// The stochastic generator's and the rotation's stream of one (iteration, level, rank): with each
// block's draw index (its parameter key and offset) every draw of a run is determined by these
// and the seed, whatever DDP's buckets, so a resumed run draws what the original drew. Linear in
// the rank (consecutive ranks' streams differ by 1).
uint64_t quant_stream_id(int64_t iter, int level, int64_t rank);

// The codec of options `o` (its spec's stream is set per call).
std::shared_ptr<const comm::QuantCodec> quant_codec_of(const QuantizedOptions& o);

// What the ranks agree on before the first bucket (agreement.h): the options and the iteration.
Fingerprint quantized_fingerprint(const QuantizedOptions& o, int64_t iter);

// How one bucket layout is cut and who owns what. Every parameter is cut into blocks of its own
// (block_size values from its first one; the last may be short), and block b of the parameter
// with key k is owned by rank (k + b) % world: blocks, owners and draw indices depend on the
// parameter and the group only, not on how DDP groups parameters into buckets. So the same
// gradients give the same results whatever the buckets (bucket_cap_mb, DDP's rebuild after the
// first iteration, a restart), and every residual stays with the rank that keeps it.
struct QuantLayout {
  std::vector<int64_t> keys, offsets, lengths;
  int64_t n = 0, world = 0, rank = 0, bits = 0, block = 0;
  bool error_feedback = false;
  // The all-gather exchange (QuantizedOptions::exchange, resolved for this world size): every
  // block, in bucket order, in one message (`plan` then serves the residuals' bookkeeping only).
  bool gather = false;
  std::shared_ptr<const ops::BlockTable> all;
  // The owners' blocks; this rank's packed at m * block in its owner-level buffers.
  std::shared_ptr<const comm::ShardPlan> plan;
  // Where this rank's block m comes from: (parameter index, offset in the parameter).
  std::vector<std::pair<size_t, int64_t>> owned_from;
  // Bytes of the whole bucket's blocks in one message: the compressed size of the bucket.
  int64_t encoded_bytes = 0;

  bool same(const std::vector<int64_t>& k, int64_t n_, int64_t w, int64_t r,
            const QuantizedOptions& o) const;
  // Whether options `o` exchange by all-gather on `w` ranks.
  static bool gathers(const QuantizedOptions& o, int64_t w);
};

// One bucket's layout and residuals.
struct QuantizedBucket {
  std::shared_ptr<const QuantLayout> layout;
  at::Tensor worker;  // fp32 [n]: this rank's quantization error (error feedback only)
  at::Tensor server;  // fp32 [owned blocks * block]: the error of the owned means
};

class QuantizedMemory {
 public:
  // Live buckets by index, and the parameters' residuals out of any bucket (restored from a
  // checkpoint, or parked when a layout changed) by parameter key, each over the whole
  // parameter: the worker one, and the server one (zeros in the blocks other ranks own).
  std::unordered_map<size_t, QuantizedBucket> live;
  std::unordered_map<int64_t, size_t> bucket_of_key;
  std::unordered_map<int64_t, at::Tensor> parked_worker, parked_server;
  ParameterKeys keys;
  comm::DeferredCollective deferred;
  // compression_stats(): the bytes of the buckets compressed so far, before (their values) and
  // after (their blocks encoded).
  int64_t bytes_before = 0, bytes_after = 0;

  // The bucket's layout and residuals, made (and its parked residuals restored) where the layout
  // changed. On a change the residuals move between the two levels so that nothing is lost:
  // by reduce-scatter, the rank-level residual of a block this rank owns (it crosses no wire, so
  // the rank level would never send it) goes to the owner level, divided by the world size; an
  // owner-level residual of a block it no longer owns, and every one by all-gather (which has no
  // owner level), goes to the rank level, times the world size.
  QuantizedBucket& bucket_for(size_t index, std::vector<int64_t> keys, const c10d::GradBucket& b,
                              int64_t n, int64_t world, int64_t rank, const QuantizedOptions& o,
                              const at::TensorOptions& options);
  // Every live bucket's residuals back to per-parameter form.
  void park_all();
  // The per-parameter residuals (live over parked), as CPU copies.
  std::map<int64_t, at::Tensor> workers() const;
  std::map<int64_t, at::Tensor> servers() const;
  void clear();
};

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
