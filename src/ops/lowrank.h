// ATen layer over kernels/lowrank{,_cuda}.h: PowerSGD's products with its rank-r factors and the
// fused error-feedback update. CPU or CUDA by the tensors' device (CUDA on the current stream).
#pragma once

#include <ATen/core/Tensor.h>

namespace ddpx {
namespace ops {

// PowerSGD's products on 3-D batches [b, ., .] (b may be 1): P = M Q, Q = M^T P, M = P Q^T.
// CPU fp32/fp64 use ddpx's one-pass skinny kernels (kernels/lowrank.h), except from rank 16 on
// with an MKL torch; other devices and dtypes, and those, use at::bmm (one batched GEMM launch
// on CUDA). Outputs are written in place.
//
// With a defined `err` (shaped as M), the error feedback around the products is part of them,
// with the values of separate steps: lowrank_project_ first compensates (error_feedback_apply_
// (M, err)), lowrank_reconstruct_ then takes the residual (err -= M). The CPU kernels do either
// in the same pass over M as the product, so PowerSGD reads its gradients once less per step
// for each.
void lowrank_project_(const at::Tensor& M, const at::Tensor& Q, const at::Tensor& P,
                      const at::Tensor& err = {});
void lowrank_project_t_(const at::Tensor& M, const at::Tensor& P, const at::Tensor& Q);
void lowrank_reconstruct_(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& M,
                          const at::Tensor& err = {});

// err += input; input = err (the compensated gradient, which err keeps as the copy that the
// final `err -= output` turns into the new residual). One fused pass on CPU and CUDA.
void error_feedback_apply_(const at::Tensor& input, const at::Tensor& err);

}  // namespace ops
}  // namespace ddpx
