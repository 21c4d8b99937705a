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

// dst[i] = cast<dst_t>(scale * sum_r row_r[i]), rows summed in order r = 0..rows-1, each from
// row 0 (so a column of -0.0 stays -0.0), in fp32 (fp64 when either side is fp64): bit for bit
// sum_rows_cpu. Row r is src + r * n, except that with `own` given, row own_row is `own` and
// src packs the other rows - 1 rows (a rank sums its own values where they are, uncopied).
// `dst` must not overlap the rows. In place (src == dst) scaled_cast needs src_t == dst_t.
void sum_rows_cuda(const void* src, DType src_t, int64_t rows, int64_t n, void* dst, DType dst_t,
                   double scale, cudaStream_t stream, const void* own = nullptr,
                   int64_t own_row = -1);

}  // namespace kernels
}  // namespace ddpx
