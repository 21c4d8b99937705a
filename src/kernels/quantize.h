// Torch-free uint8 min-max quantization: the compute core of quantization_pertensor_hook and
// quantization_perchannel_hook. The ATen layer (ops/quantize.h) validates tensors and picks the
// CPU or CUDA variant (quantize_cuda.h) by device.
//
// A rank's quantized values travel as one *row* of bytes, so that one collective carries both
// the quantization parameters and the values:
//   float32 scale[channels] | float32 zero_point[channels] | uint8 q[n] | zero padding
// of quantized_row_bytes(n, channels) bytes (a multiple of 16, so that every row of a gathered
// block keeps its floats aligned). Channel c holds the values [c * channel, (c + 1) * channel)
// clipped to n; channels * channel >= n, and the positions past n count as zeros (torch pads the
// bucket with zeros, which changes no channel's parameters: min and max are taken with 0).
#pragma once

#include <cstdint>

#include "cast.h"

namespace ddpx {
namespace kernels {

// Bytes of one quantized row of n values in `channels` channels.
int64_t quantized_row_bytes(int64_t n, int64_t channels);

// Writes the row of `x` (n values of dtype t): per channel, torch.ao.quantization's
// MinMaxObserver parameters for quint8 affine (quant range 0..255), computed in fp32 as torch
// computes them:
//   min_neg = min(min, 0), max_pos = max(max, 0), scale = max((max_pos - min_neg) / 255, eps),
//   zero_point = clamp(-round(min_neg / scale), 0, 255)            (eps: fp32's, 2^-23)
// then q = clamp(round(x / scale) + zero_point, 0, 255), rounding half to even. The quotient
// x / scale is rounded to x's own dtype first (torch divides a 16-bit tensor by an fp32 scalar
// in fp32 and stores 16 bits; fp64 divides in fp64). A channel with a NaN or an infinity gets
// scale NaN, zero point 0 and q = 0: it dequantizes to NaN everywhere (torch's hook returns
// NaN there too), so a non-finite gradient reaches every rank instead of being masked.
// `row` must not overlap `x`. Runs on the calling thread.
void quantize_row_cpu(const void* x, DType t, int64_t n, int64_t channel, int64_t channels,
                      uint8_t* row);

// dst[i] = cast<dst_t>((0 + deq_0[i] + deq_1[i] + ... + deq_{rows-1}[i]) / rows) for i < n,
// where deq_r[i] = scale_r[c] * (float(q_r[i]) - zero_point_r[c]) for i's channel c, every
// operation rounded in fp32 in that order (torch's dequantize-and-aggregate, bit for bit).
// Row r is `own` for r == own_row, else row (r < own_row ? r : r - 1) of `peers`, whose rows are
// quantized_row_bytes(n, channels) apart. `dst` must not overlap the rows.
void dequantize_mean_cpu(const uint8_t* peers, const uint8_t* own, int64_t own_row, int64_t rows,
                         int64_t n, int64_t channel, int64_t channels, void* dst, DType dst_t);

}  // namespace kernels
}  // namespace ddpx
