// ATen layer over kernels/cast{,_cuda}.h: validates tensors, picks the CPU or CUDA kernel by
// device, and launches CUDA work on the current stream of the tensors' device.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/cast.h"

namespace ddpx {
namespace ops {

// Kernel dtype tag for a floating tensor dtype; a clear error naming `what` otherwise.
kernels::DType to_kernel_dtype(at::ScalarType t, const char* what);

// Returns a new 1-D tensor of dtype `dtype` on src's device: cast(scale * src), in src's logical
// order (any strided src; sparse ones are refused).
at::Tensor scaled_cast(const at::Tensor& src, at::ScalarType dtype, double scale);

// dst = cast(scale * src) in place of dst's storage; shapes need only agree in numel.
// Both tensors contiguous, on the same device; they may be the same memory with the same dtype,
// and must not overlap otherwise.
void scaled_cast_into(const at::Tensor& src, const at::Tensor& dst, double scale);

// dst = cast(scale * sum over the first dimension of src), src of shape [rows, dst.numel()].
// Accumulates in fp32 (fp64 for fp64 tensors).
void sum_rows_into(const at::Tensor& src, const at::Tensor& dst, double scale);

// dst = cast(scale * (row_0 + row_1 + ... + row_{rows-1})), in that order, where row own_row is
// `own` and the others are the rows of `peers` ([rows - 1, dst.numel()], in row order, skipping
// own_row). A rank sums its own values where they are, with only its peers' rows received.
// Accumulates in fp32 (fp64 for fp64 tensors); `own` and `peers` share one dtype.
void sum_rows_with_own_into(const at::Tensor& peers, const at::Tensor& own, int64_t own_row,
                            const at::Tensor& dst, double scale);

}  // namespace ops
}  // namespace ddpx
