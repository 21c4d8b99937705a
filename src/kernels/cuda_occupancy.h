// Resident-block counts for the CUDA kernels' launch sizes, queried once per kernel and device
// (review finding F2: a device query on every launch). Include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda_check.h"

namespace ddpx {
namespace kernels {

// Blocks of `threads` threads that `Kernel` keeps resident on the current device at once (SMs
// times the occupancy its registers and static shared memory allow): a grid-stride loop needs no
// more, and a cooperative launch may not have more.
template <auto Kernel, int threads>
int64_t resident_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> cache[kMaxDevices];  // per kernel and device; 0 = not known yet
  int device = 0;
  DDPX_CUDA_CHECK(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kMaxDevices;
  int64_t blocks = cached ? cache[device].load(std::memory_order_relaxed) : 0;
  if (blocks == 0) {
    int sms = 0, per_sm = 0;
    DDPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    DDPX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, 0));
    blocks = static_cast<int64_t>(sms) * per_sm;
    if (cached) cache[device].store(blocks > 0 ? blocks : -1, std::memory_order_relaxed);
  }
  return blocks > 0 ? blocks : 0;
}

}  // namespace kernels
}  // namespace ddpx
