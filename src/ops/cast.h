// ATen layer over kernels/cast{,_cuda}.h: validates tensors, picks the CPU or CUDA kernel by
// device, and launches CUDA work on the current stream of the tensors' device.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels/cast.h"

namespace ddpx {
namespace ops {

// Kernel dtype tag for a floating tensor dtype; a clear error naming `what` otherwise.
kernels::DType to_kernel_dtype(at::ScalarType t, const char* what);

// Returns a new 1-D tensor of dtype `dtype` on src's device: cast(scale * src), in src's logical
// order (any strided src; sparse ones are refused).
at::Tensor scaled_cast(const at::Tensor& src, at::ScalarType dtype, double scale);

// dst = cast(scale * src) in place of dst's storage; shapes need only agree in numel.
// Both tensors contiguous, on the same device.
void scaled_cast_into(const at::Tensor& src, const at::Tensor& dst, double scale);

// dst = cast(scale * sum over the first dimension of src), src of shape [rows, dst.numel()].
// Accumulates in fp32 (fp64 for fp64 tensors).
void sum_rows_into(const at::Tensor& src, const at::Tensor& dst, double scale);

// dst = cast(scale * (rows[0] + rows[1] + ...)), in that order; CPU tensors of one dtype, each
// contiguous with dst.numel() elements. Accumulates in fp32 (fp64 for fp64 tensors).
void sum_row_list_into(const std::vector<at::Tensor>& rows, const at::Tensor& dst, double scale);

}  // namespace ops
}  // namespace ddpx
