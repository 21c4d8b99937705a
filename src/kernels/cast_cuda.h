// CUDA variants of the kernels in cast.h: same semantics, device pointers,
// launched asynchronously on `stream` (never on the default stream by accident: pass the
// caller's current stream). Errors in the launch are raised as std::runtime_error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cast.h"

namespace ddpx {
namespace kernels {

// dst[i] = cast<dst_t>(scale * src[i]); one fused pass, vectorised loads where aligned.
void scaled_cast_cuda(const void* src, DType src_t, void* dst, DType dst_t, int64_t n, double scale,
                      cudaStream_t stream);

// dst[i] = cast<dst_t>(scale * sum_r src[r * n + i]); fp32 accumulation, one pass.
void sum_rows_cuda(const void* src, DType src_t, int64_t rows, int64_t n, void* dst, DType dst_t,
                   double scale, cudaStream_t stream);

}  // namespace kernels
}  // namespace ddpx
