// How a multi-tensor CUDA launch shares its blocks among its tensors (host code, no CUDA: the
// CPU tests check it). Each tensor with elements gets blocks enough for one element per thread,
// at most `max_per_tensor` (a grid-stride loop covers the rest); an empty tensor gets none.
#pragma once

#include <cstdint>

namespace ddpx {
namespace kernels {

// Tensors per launch: their pointers and coefficients travel in the kernel's parameter block
// (4 KiB at most; 16 Adam tensors in float64 take about 2.8 KiB).
constexpr int kMultiTensors = 16;
constexpr int64_t kMultiMaxBlocksPerTensor = 1024;

// Fills block_start[0..count] (tensor i owns blocks [block_start[i], block_start[i + 1])) and
// returns the launch's block count. count <= kMultiTensors; threads > 0.
inline int64_t plan_blocks(const int64_t* n, int count, int threads, int64_t max_per_tensor,
                           int* block_start) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    block_start[i] = static_cast<int>(total);
    const int64_t want = n[i] > 0 ? (n[i] + threads - 1) / threads : 0;
    total += want < max_per_tensor ? want : max_per_tensor;
  }
  block_start[count] = static_cast<int>(total);
  return total;
}

// The tensor that block `block` of a launch planned by plan_blocks works on (the first tensor
// whose range holds it: empty tensors own no block and are skipped).
#ifdef __CUDACC__
__host__ __device__
#endif
    inline int
    tensor_of_block(const int* block_start, int count, int64_t block) {
  int k = 0;
  while (k + 1 < count && block_start[k + 1] <= block) ++k;
  return k;
}

}  // namespace kernels
}  // namespace ddpx
