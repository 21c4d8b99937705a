// DDPX_CUDA_CHECK: the one error check for CUDA runtime calls in the torch-free kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#define DDPX_CUDA_CHECK(expr)                                                                     \
  do {                                                                                            \
    const cudaError_t ddpx_err_ = (expr);                                                         \
    if (ddpx_err_ != cudaSuccess) {                                                               \
      throw std::runtime_error(std::string("ddpx CUDA error: ") + cudaGetErrorString(ddpx_err_) + \
                               " at " + __FILE__ + ":" + std::to_string(__LINE__) +               \
                               " (" #expr ")");                                                   \
    }                                                                                             \
  } while (0)
