// Device facts the CUDA kernels size their launches by, queried once per device (and kernel)
// instead of on every launch: they do not change, and the queries are host calls that a small
// launch would otherwise pay each time. Include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda_check.h"

namespace ddpx {
namespace kernels {

constexpr int kMaxCachedDevices = 64;

// query(device) for the current device, remembered in cache[device] (stored plus one, so that 0
// means "not asked yet"); devices past the cache are asked every time.
template <typename Query>
int64_t per_device(std::atomic<int64_t> (&cache)[kMaxCachedDevices], Query query) {
  int device = 0;
  DDPX_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxCachedDevices) return query(device);
  int64_t v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    v = query(device) + 1;
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v - 1;
}

// Attribute `Attr` of the current device.
template <cudaDeviceAttr Attr>
int64_t device_attribute() {
  static std::atomic<int64_t> cache[kMaxCachedDevices];
  return per_device(cache, [](int device) {
    int value = 0;
    DDPX_CUDA_CHECK(cudaDeviceGetAttribute(&value, Attr, device));
    return static_cast<int64_t>(value);
  });
}

// Blocks of `threads` threads that `Kernel` keeps resident on the current device at once (SMs
// times the occupancy its registers and static shared memory allow): a grid-stride loop needs no
// more, and a cooperative launch may not have more.
template <auto Kernel, int threads>
int64_t resident_blocks() {
  static std::atomic<int64_t> cache[kMaxCachedDevices];
  return per_device(cache, [](int) {
    int per_sm = 0;
    DDPX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, 0));
    return device_attribute<cudaDevAttrMultiProcessorCount>() * per_sm;
  });
}

}  // namespace kernels
}  // namespace ddpx
