// ATen layer over kernels/quantize{,_cuda}.h: validates tensors, picks the CPU or CUDA kernel by
// device, and launches CUDA work on the current stream of the tensors' device.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ddpx {
namespace ops {

// Bytes of one rank's quantized row of n values in `channels` channels (kernels/quantize.h has
// the layout).
int64_t quantized_row_bytes(int64_t n, int64_t channels);

// Writes the quantized row of `x` (contiguous, floating, numel n) into `row` (contiguous uint8 of
// quantized_row_bytes(n, channels) bytes on x's device): per-channel min-max uint8 parameters
// and values, channel c covering the values [c * channel, (c + 1) * channel); channels * channel
// must be >= n.
void quantize_row_into(const at::Tensor& x, int64_t channel, int64_t channels,
                       const at::Tensor& row);

// dst = cast(mean over the rows of their dequantized values), summed in fp32 in row order: row
// own_row is `own` (one row) and the others are the rows of `peers` ([rows - 1, row bytes],
// uint8), as written by quantize_row_into for dst.numel() values. `dst` contiguous, floating,
// on the rows' device; it may be the tensor that was quantized.
void dequantize_mean_into(const at::Tensor& peers, const at::Tensor& own, int64_t own_row,
                          int64_t channel, int64_t channels, const at::Tensor& dst);

}  // namespace ops
}  // namespace ddpx
