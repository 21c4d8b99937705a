// PowerSGD's working memory (private): where each gradient, P and Q factor of a bucket lives,
// the per-parameter memories those buffers hold, and the bucket whose round two is deferred.
// PowerSGDState owns one PowerSGDMemory; the hooks (powersgd_hook.cpp) fill and use it.
//
// Keying (see docs/design.md): memories are keyed per parameter, by the order in which
// parameters first reach the hook, so they survive DDP's bucket rebuild and a checkpoint into a
// new process; layouts are keyed by bucket index and rebuilt when a bucket's parameters change.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comm/deferred.h"
#include "hooks/parameter_keys.h"
#include "ops/orthogonalize.h"

namespace ddpx {
namespace hooks {
namespace detail {

// One compressed gradient viewed as a rows x cols matrix with rank-`rank` factors.
struct CompMatrix {
  size_t index;      // position of the gradient in the bucket
  int64_t rows;      // matrix rows (the gradient's first dimension)
  int64_t cols;      // matrix columns (the other dimensions flattened)
  int64_t rank;      // min(rows, cols, matrix_approximation_rank)
  int64_t p_offset;  // offset of P (rows x rank) in the P region of round_one
  int64_t q_offset;  // offset of Q (cols x rank) in q_factors
};

// Everything about one bucket that does not change from step to step.
struct BucketLayout {
  std::vector<int64_t> keys;             // parameter keys, bucket order
  std::vector<int64_t> offsets, numels;  // each gradient inside the bucket buffer
  std::vector<size_t> uncompressed;      // gradients allreduced as they are
  // The uncompressed gradients as runs of the bucket, adjacent ones merged: (offset, numel),
  // packed in this order at the head of round_one. With two runs or more, `uncompressed_index`
  // (int64, on the layout's device) lists the bucket positions of their elements, so that
  // packing is one gather and, on a GPU, unpacking one scatter (two copies per tensor would be
  // dozens of launches per step for transformer buckets of biases and norms).
  std::vector<std::pair<int64_t, int64_t>> uncompressed_runs;
  at::Tensor uncompressed_index;
  std::vector<CompMatrix> comp;                   // compressed gradients, torch's order (by shape)
  std::vector<std::pair<size_t, size_t>> groups;  // [begin, end) of same-shaped runs in comp
  int64_t uncompressed_numel = 0, total_p = 0, total_q = 0;
  // The options the layout was built for (use_error_feedback: whether `error` is defined).
  int64_t built_rank = 0;
  double built_min_compression_rate = 0;
  int64_t numel_before = 0, numel_after = 0;  // compression statistics of one call
  at::ScalarType compute_dtype = at::kFloat;  // dtype of the arithmetic
  at::ScalarType wire_dtype = at::kFloat;     // dtype on the wire (the bucket's)
  at::Device device = at::kCPU;
  // [uncompressed_numel + total_p]: the uncompressed gradients, then every P: what round one
  // exchanges.
  at::Tensor round_one;
  // [total_q]: every Q: what round two exchanges, and the warm-start memory.
  at::Tensor q_factors;
  at::Tensor error;  // error-feedback residual, [bucket numel] (batched: [side * side])
  // Per-step working memory, allocated once with the layout and reused every step (round two runs
  // on another stream on CUDA: a per-step temporary freed when the job dies could be handed to
  // the next bucket while that stream still reads it).
  at::Tensor work_copy;             // the bucket in compute_dtype, when that is not its dtype
  std::vector<at::Tensor> stacked;  // batch_tensors_with_same_shape: [count, rows, cols] per group
  ops::MatrixPack p_pack, q_pack;
  bool q_valid = false;  // q_factors holds a previous step's factors (warm start)
  // batched_powerSGD_hook only: the bucket as one zero-padded side x side matrix.
  int64_t total_length = 0, side = 0, rank = 0;
  at::Tensor padded;  // [side * side] compute buffer
  std::string batched_key;
};

// One bucket's run, from round one to its result.
struct PowerSGDJob {
  std::shared_ptr<BucketLayout> layout;
  bool batched = false;
  bool warm_start = true;
  bool batch_same_shape = false;
  // The error feedback runs inside the products (ops::lowrank_project_ / lowrank_reconstruct_
  // with `err`) for the compressed matrices, and by itself for the uncompressed gradients only:
  // on CPU, where that saves two passes over the bucket; not with stacked same-shape matrices
  // (they are copies) nor on CUDA (one launch over the bucket beats one per matrix).
  bool fused_error_feedback = false;
  double epsilon = 0;
  int64_t world = 1;
  at::Tensor input;  // the bucket buffer: the result lands here
  at::Tensor work;   // input, or its compute-dtype copy (layout->work_copy)
  c10::intrusive_ptr<c10::ivalue::Future> round1;
  c10::intrusive_ptr<c10::ivalue::Future> result;
};

class PowerSGDMemory {
 public:
  template <typename Key>
  using Memories = std::unordered_map<Key, at::Tensor>;

  // Per-parameter memories: views into the current bucket layouts.
  Memories<int64_t> error;
  Memories<int64_t> q;
  // The P factor (rows x rank) of each compressed parameter after its last step: a view into
  // its bucket's round-one buffer (torch's p_memory_dict, keyed per parameter; not checkpointed:
  // P is recomputed from the gradient and Q every step).
  Memories<int64_t> p;
  // Memories loaded from a checkpoint and not yet claimed by a bucket layout.
  Memories<int64_t> restored_error;
  Memories<int64_t> restored_q;
  // Batched hook: Q factor per bucket, keyed by the bucket's parameter keys joined with ','.
  Memories<std::string> batched_q;
  Memories<std::string> restored_batched_q;
  // Batched hook: the residual in the zero padding of each bucket's square matrix (nonzero, since
  // the low-rank result is), keyed like batched_q.
  Memories<std::string> batched_error_pad;
  Memories<std::string> restored_batched_error_pad;
  // Current layout per bucket index.
  std::unordered_map<size_t, std::shared_ptr<BucketLayout>> layouts;
  // Round two of the previous bucket, issued by the next runHook.
  comm::DeferredCollective round_two;
  // load_state_dict's `strict`: a restored error memory of the wrong size raises.
  bool strict_restore = true;
  // The keys of the memories above, per parameter.
  ParameterKeys keys;

  // Forgets everything tied to this process's tensors (a checkpoint is being loaded).
  void reset_live() {
    error.clear();
    q.clear();
    p.clear();
    batched_q.clear();
    batched_error_pad.clear();
    layouts.clear();
    round_two.clear();
  }

  // Forgets every memory, live and restored: the next step starts them as the first compressed
  // step does (zero residuals, fresh Q factors). The layouts go too, so that no bucket can claim
  // a cleared memory as a valid one when it is rebuilt.
  void clear_memories() {
    reset_live();
    restored_error.clear();
    restored_q.clear();
    restored_batched_q.clear();
    restored_batched_error_pad.clear();
  }
};

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
