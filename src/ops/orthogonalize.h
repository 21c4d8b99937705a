// ATen layer over kernels/orthogonalize{,_cuda}.h: PowerSGD's batched Gram-Schmidt over matrices
// packed in one buffer. CPU or CUDA by the buffer's device (CUDA on the current stream).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ddpx {
namespace ops {

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
  // The first element any matrix covers (0 for an empty pack): [begin(), extent()) is the region
  // orthogonalize_ reads and writes.
  int64_t begin() const { return begin_; }
  // [4, count] int64 on the device: offsets, rows, cols, and offsets - begin() (the matrices'
  // places in a copy of the region alone) (CUDA only; undefined on CPU).
  const at::Tensor& device_descriptors() const { return device_desc_; }

 private:
  std::vector<int64_t> offsets_, rows_, cols_;
  int64_t extent_ = 0, begin_ = 0;
  at::Tensor device_desc_;
};

// Orthonormalises the columns of every matrix of `pack` inside `flat` (1-D, contiguous), in one
// pass (one CUDA launch). 16-bit buffers are processed in fp32 and rounded back.
// `spread`: on CUDA, let a few tall matrices take several blocks each (the default); false keeps
// one block per matrix (for benchmarks that compare the two).
void orthogonalize_(const at::Tensor& flat, const MatrixPack& pack, double epsilon,
                    bool spread = true);

}  // namespace ops
}  // namespace ddpx
