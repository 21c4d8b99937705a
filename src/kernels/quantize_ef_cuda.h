// CUDA variants of the kernels in quantize_ef.h: the same element functions (quantize_ef_inl.h),
// device pointers, launched asynchronously on `stream`. Launch errors are raised as
// std::runtime_error. One CUDA block per quantization block: its max|v| and sum|v| are reduced in
// shared memory, so the 1-bit mean scale and the fitted 2-bit scale may differ from the CPU's in
// their last bits (another summation order; for the fitted scale, a value at the mean may fall on
// the other side of it); every other result is the CPU's, bit for bit. Rotation
// (QuantSpec::rotate) holds a whole block in shared memory (rotation_block_ok).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "quantize_ef.h"

namespace ddpx {
namespace kernels {

// `refs` is a device pointer (the table copied to the device).
void quantize_ef_blocks_cuda(const void* x, DType t, float* residual, const BlockRef* refs,
                             int64_t blocks, const QuantSpec& spec, float* scales, uint8_t* codes,
                             cudaStream_t stream);

void dequantize_sum_blocks_cuda(const uint8_t* messages, int64_t count, int64_t message_bytes,
                                int64_t blocks, const BlockRef* refs, int bits, int64_t block,
                                float post_scale, float* dst, const ExactTerm& exact,
                                const Unrotate& unrotate, cudaStream_t stream);

void dequantize_blocks_cuda(const uint8_t* message, int64_t blocks, const BlockRef* refs, int bits,
                            int64_t block, void* dst, DType dst_t, const Unrotate& unrotate,
                            cudaStream_t stream);

}  // namespace kernels
}  // namespace ddpx
