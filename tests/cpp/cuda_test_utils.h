// Helpers shared by the CUDA kernel tests: skip without a usable GPU, assert on CUDA calls.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

namespace ddpx_test {

// True when a CUDA device can be used; otherwise `why` says why not.
inline bool cuda_device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    (void)cudaGetLastError();  // clear the error state
    return false;
  }
  if (count == 0) {
    *why = "cudaGetDeviceCount returned 0";
    return false;
  }
  return true;
}

}  // namespace ddpx_test

#define DDPX_SKIP_WITHOUT_GPU()                                         \
  do {                                                                  \
    std::string why_;                                                   \
    if (!ddpx_test::cuda_device_available(&why_)) GTEST_SKIP() << why_; \
  } while (0)

#define DDPX_ASSERT_CUDA(expr)                                                 \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)
