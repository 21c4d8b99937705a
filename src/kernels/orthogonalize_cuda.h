// CUDA batched Gram-Schmidt: same contract as kernels/orthogonalize.h, one launch for all
// matrices. `offsets`, `rows`, `cols` are DEVICE arrays; a plan is made from HOST copies of rows
// and cols (see orthogonalize_cuda.cu for the two ways a launch is spread).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ddpx {
namespace kernels {

// The multi-block ("tall") way takes matrices of at most this many columns...
constexpr int kGsTallMaxCols = 32;
// ...when one of them has at least this many rows.
constexpr int64_t kGsTallMinRows = 1024;

// How a launch spreads its matrices over thread blocks.
struct GsPlan {
  int64_t tall_blocks = 0;  // > 0: several blocks per matrix, this many in all; 0: one each
  int64_t max_cols = 0;     // the widest matrix (tall plans)
  int passes = 1;           // 2 when a matrix has more than 2 columns (tall plans)
};

// Picks the way for these matrices (HOST arrays) on the current device: tall when every matrix
// has at most kGsTallMaxCols columns, one has at least `min_rows` rows (tests lower it), the
// device launches cooperatively, and all the blocks fit in half of it at once (a cooperative grid
// starts only when all its blocks are resident: the other half leaves room for the kernels that
// may hold SMs meanwhile, such as NCCL's); one block per matrix otherwise. Cheap after the first
// call per device.
GsPlan plan_orthogonalize_cuda(const int64_t* rows, const int64_t* cols, int64_t count,
                               bool is_double, int64_t min_rows = kGsTallMinRows);
// Doubles of device scratch a launch with `plan` needs (0 for one block per matrix).
int64_t orthogonalize_cuda_scratch(const GsPlan& plan);

// With a tall plan, `scratch` holds orthogonalize_cuda_scratch(plan) doubles on the device;
// without one (or with a null scratch), one block per matrix. A cooperative launch that the
// runtime refuses without leaving a sticky error (a grid that no longer fits, a GPU shared
// through MPS or virtualised that has the attribute but refuses the launch) falls back to one
// block per matrix: the return value is then the refusal, cudaSuccess otherwise. Any other error
// throws std::runtime_error.
cudaError_t orthogonalize_cuda(float* data, const int64_t* offsets, const int64_t* rows,
                               const int64_t* cols, int64_t count, float epsilon,
                               cudaStream_t stream, const GsPlan& plan = GsPlan(),
                               double* scratch = nullptr);
cudaError_t orthogonalize_cuda(double* data, const int64_t* offsets, const int64_t* rows,
                               const int64_t* cols, int64_t count, double epsilon,
                               cudaStream_t stream, const GsPlan& plan = GsPlan(),
                               double* scratch = nullptr);

// For tests: while set, every cooperative launch is made with a grid of no blocks, which the
// runtime refuses at launch (cudaErrorInvalidConfiguration, not sticky), so that the fallback
// runs on any GPU. Not for concurrent use with launches on other threads.
void refuse_cooperative_launches_for_testing(bool refuse);

}  // namespace kernels
}  // namespace ddpx
