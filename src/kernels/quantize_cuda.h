// CUDA variants of the kernels in quantize.h: same semantics and bits, device pointers,
// launched asynchronously on `stream`. Errors in a launch are raised as std::runtime_error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "quantize.h"

namespace ddpx {
namespace kernels {

// Device scratch that quantize_row_cuda needs for n values in `channels` channels (partial
// minima and maxima of a channel split over several blocks).
int64_t quantize_row_cuda_workspace_bytes(int64_t n, int64_t channel, int64_t channels);

// quantize_row_cpu on the device: `workspace` holds quantize_row_cuda_workspace_bytes bytes.
void quantize_row_cuda(const void* x, DType t, int64_t n, int64_t channel, int64_t channels,
                       uint8_t* row, void* workspace, cudaStream_t stream);

// dequantize_mean_cpu on the device.
void dequantize_mean_cuda(const uint8_t* peers, const uint8_t* own, int64_t own_row, int64_t rows,
                          int64_t n, int64_t channel, int64_t channels, void* dst, DType dst_t,
                          cudaStream_t stream);

}  // namespace kernels
}  // namespace ddpx
