// ATen layer for PowerSGD's compute: batched Gram-Schmidt over matrices packed in one buffer, and
// the fused error-feedback update. CPU or CUDA by the tensors' device (CUDA on the current stream).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace ddpx {

// Where matrices live in a flat buffer: matrix k is rows[k] x cols[k], row-major, at offsets[k].
// Build once per bucket layout: on CUDA the descriptors are uploaded once and reused.
class MatrixPack {
 public:
  MatrixPack() = default;
  MatrixPack(std::vector<int64_t> offsets, std::vector<int64_t> rows, std::vector<int64_t> cols,
             const at::Device& device);
  // Matrices stored back to back from element `first`: offsets[k] = first + the sizes before k.
  static MatrixPack back_to_back(std::vector<int64_t> rows, std::vector<int64_t> cols,
                                 const at::Device& device, int64_t first = 0);

  int64_t count() const { return static_cast<int64_t>(offsets_.size()); }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::vector<int64_t>& rows() const { return rows_; }
  const std::vector<int64_t>& cols() const { return cols_; }
  // One past the last element any matrix covers: the buffer must have at least this many.
  int64_t extent() const { return extent_; }
  // [3, count] int64 on the device: offsets, rows, cols (CUDA only; undefined on CPU).
  const at::Tensor& device_descriptors() const { return device_desc_; }

 private:
  std::vector<int64_t> offsets_, rows_, cols_;
  int64_t extent_ = 0;
  at::Tensor device_desc_;
};

// Orthonormalises the columns of every matrix of `pack` inside `flat` (1-D, contiguous), in one
// pass (one CUDA launch). 16-bit buffers are processed in fp32 and rounded back.
void orthogonalize_(const at::Tensor& flat, const MatrixPack& pack, double epsilon);

// PowerSGD's products on 3-D batches [b, ., .] (b may be 1): P = M Q, Q = M^T P, M = P Q^T.
// CPU fp32/fp64 use ddpx's one-pass skinny kernels (<ddpx/compression/lowrank.h>); other
// devices and dtypes use at::bmm (one batched GEMM launch on CUDA). Outputs are written in place.
void lowrank_project_(const at::Tensor& M, const at::Tensor& Q, const at::Tensor& P);
void lowrank_project_t_(const at::Tensor& M, const at::Tensor& P, const at::Tensor& Q);
void lowrank_reconstruct_(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& M);

// err += input; input = err (the compensated gradient, which err keeps as the copy that the
// final `err -= output` turns into the new residual). One fused pass on CUDA.
void error_feedback_apply_(const at::Tensor& input, const at::Tensor& err);

}  // namespace ddpx
