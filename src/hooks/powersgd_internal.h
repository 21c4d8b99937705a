// Internals shared by PowerSGDState and the PowerSGD hooks: the per-bucket layout (where each
// gradient, P and Q factor lives) and the job whose second round is deferred to the next bucket.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <ddpx/compression/powersgd_ops.h>

namespace ddpx {
namespace hooks {
namespace detail {

// One compressed gradient viewed as an n x m matrix with rank r factors.
struct CompMatrix {
  size_t index;     // position of the gradient in the bucket
  int64_t n, m, r;  // matrix rows, cols, and rank min(n, m, matrix_approximation_rank)
  int64_t p_off;    // offset of P (n x r) in the P region
  int64_t q_off;    // offset of Q (m x r) in the Q buffer
};

struct BucketLayout {
  std::vector<int64_t> keys;                  // parameter keys, bucket order
  std::vector<int64_t> offsets, numels;       // each gradient inside the bucket buffer
  std::vector<size_t> uncompressed;           // gradients allreduced as they are
  std::vector<CompMatrix> comp;               // compressed gradients, torch's order (by shape)
  std::vector<std::pair<size_t, size_t>> groups;  // [begin, end) of same-shaped runs in comp
  int64_t unc_numel = 0, total_p = 0, total_q = 0;
  int64_t numel_before = 0, numel_after = 0;  // compression statistics of one call
  at::ScalarType compute_dtype = at::kFloat;  // dtype of the arithmetic
  at::ScalarType wire_dtype = at::kFloat;     // dtype on the wire (the bucket's)
  at::Device device = at::kCPU;
  at::Tensor s1;     // [unc_numel + total_p]: uncompressed gradients, then all Ps (round one)
  at::Tensor q;      // [total_q]: all Qs (round two; warm-start memory)
  at::Tensor error;  // error-feedback residual, [bucket numel] (batched: [side * side])
  // Per-step working memory, allocated once with the layout and reused every step (round two runs
  // on another stream on CUDA: a per-step temporary freed when the job dies could be handed to
  // the next bucket while that stream still reads it; review finding B1).
  at::Tensor work_copy;                // the bucket in compute_dtype, when that is not its dtype
  std::vector<at::Tensor> stacked;     // batch_tensors_with_same_shape: [count, n, m] per group
  MatrixPack p_pack, q_pack;
  bool q_valid = false;  // q holds a previous step's factors (warm start)
  // batched_powerSGD_hook only
  int64_t total_length = 0, side = 0, rank = 0;
  at::Tensor padded;  // [side * side] compute buffer
  std::string batched_key;
};

struct PendingJob {
  std::shared_ptr<BucketLayout> layout;
  bool batched = false;
  bool warm_start = true;
  bool batch_same_shape = false;
  double epsilon = 0;
  int64_t world = 1;
  at::Tensor input;  // the bucket buffer: the result lands here
  at::Tensor work;   // input, or its compute-dtype copy (layout->work_copy)
  c10::intrusive_ptr<c10::ivalue::Future> round1;
  c10::intrusive_ptr<c10::ivalue::Future> result;
};

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
