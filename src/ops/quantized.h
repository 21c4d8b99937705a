// ATen layer over kernels/quantize_ef{,_cuda}.h, the block quantization with error feedback of
// quantized_hook: validates tensors, runs CPU kernels over ATen's thread pool (blocks are
// independent) and launches CUDA kernels on the current stream of the tensors' device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "kernels/quantize_ef.h"

namespace ddpx {
namespace ops {

// A message's blocks (kernels::BlockRef), on the host and, once to() was called for a CUDA
// device, on that device too.
class BlockTable {
 public:
  BlockTable() = default;
  explicit BlockTable(std::vector<kernels::BlockRef> refs);
  // The blocks [0, n) cut into `block`-sized pieces, drawing from draw_base on.
  static BlockTable contiguous(int64_t n, int64_t block, uint64_t draw_base = 0);

  int64_t size() const { return static_cast<int64_t>(refs_.size()); }
  const std::vector<kernels::BlockRef>& refs() const { return refs_; }
  // One past the largest value index a block covers (what a tensor indexed by it must hold).
  int64_t extent() const { return extent_; }
  // Copies the table to `device` (once; CPU: nothing).
  void to(const c10::Device& device);
  // The table where the kernels of `device` read it.
  const kernels::BlockRef* data(const c10::Device& device) const;
  // The device copy (undefined before to() with a CUDA device): for recording the streams that
  // read it.
  const at::Tensor& device_refs() const { return device_refs_; }

 private:
  std::vector<kernels::BlockRef> refs_;
  int64_t extent_ = 0;
  at::Tensor device_refs_;  // int64 [size, 3] on a CUDA device
};

// Bytes of the message of `blocks` blocks (kernels/quantize_ef.h has the layout).
int64_t quantized_message_bytes(int64_t blocks, int bits, int64_t block);

// Quantizes the blocks of `table` (values of `x`: contiguous, floating) into `message`
// (contiguous uint8 on x's device, at least quantized_message_bytes(table.size(), ...) bytes;
// only those are written). `residual`: undefined (no error feedback) or contiguous fp32 indexed
// like x, on x's device, added to x before quantizing and replaced by the new residual there.
void quantize_ef_into(const at::Tensor& x, const at::Tensor& residual, const BlockTable& table,
                      const kernels::QuantSpec& spec, const at::Tensor& message);

// A term of dequantize_sum_into's sum taken as it is, not quantized (kernels::ExactTerm): the
// values of `x` (contiguous, floating, on dst's device) at the blocks of `table` (block m as
// long as the sum's block m), added `row`-th in the summation order.
struct ExactValues {
  at::Tensor x;
  const BlockTable* table = nullptr;
  int64_t row = 0;
};

// dst (fp32, indexed by the table) = the sum over the rows of `messages` ([rows, bytes] uint8,
// each row a message of the table's blocks) of post_scale times each row's values, in row order,
// in fp32 (each term scaled before it is added: no overflow where the mean is finite); with
// `exact` (x defined), its values are one more term of the sum, at its row (rows may then be 0).
// `unrotate`: how rotated messages (kernels::QuantSpec::rotate) are rotated back, by term.
void dequantize_sum_into(const at::Tensor& messages, const BlockTable& table, int bits,
                         int64_t block, float post_scale, const at::Tensor& dst,
                         const ExactValues& exact = ExactValues(),
                         const kernels::Unrotate& unrotate = kernels::Unrotate());

// dst (floating, indexed by the table) = the dequantized values of `message` (uint8, a message
// of the table's blocks), rounded once to dst's dtype. `unrotate`: as its term 0.
void dequantize_into(const at::Tensor& message, const BlockTable& table, int bits, int64_t block,
                     const at::Tensor& dst,
                     const kernels::Unrotate& unrotate = kernels::Unrotate());

}  // namespace ops
}  // namespace ddpx
