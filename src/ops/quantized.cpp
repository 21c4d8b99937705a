#include "ops/quantized.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "ops/cast.h"
#include "ops/cuda_launch.h"

#ifdef DDPX_WITH_CUDA
#include "kernels/quantize_ef_cuda.h"
#endif

namespace ddpx {
namespace ops {
namespace {

static_assert(sizeof(kernels::BlockRef) == 3 * sizeof(int64_t),
              "BlockRef travels to the device as three int64 per block");

void check_qtensor(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.defined(), op, ": ", what, " must be defined");
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), op, ": ", what,
              " must be dense and contiguous");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": ", what,
              " must be a CPU or CUDA tensor, got ", t.device());
  TORCH_CHECK(kWithCuda || t.device().is_cpu(), op,
              ": ddpx was built without CUDA support; rebuild with a CUDA-enabled torch to use ",
              t.device(), " tensors");
}

// Rotated blocks (QuantSpec::rotate, Unrotate) must be a size the kernels can rotate.
void check_rotation(bool rotated, int64_t block, const char* op) {
  TORCH_CHECK(!rotated || kernels::rotation_block_ok(block), op,
              ": rotated blocks must hold a power of two in [8, 8192] values, got ", block);
}

void check_qformat(int bits, int64_t block, const char* op) {
  TORCH_CHECK(kernels::valid_quant_bits(bits), op, ": bits must be 1, 2, 4 or 8, got ", bits);
  TORCH_CHECK(block >= 1 && block * bits % 8 == 0, op, ": block ", block,
              " must be positive and hold whole bytes of ", bits, "-bit codes");
}

void check_qmessage(const at::Tensor& message, int64_t need, const at::Tensor& like,
                    const char* op) {
  check_qtensor(message, op, "message");
  TORCH_CHECK(message.scalar_type() == at::kByte, op, ": message must be uint8");
  TORCH_CHECK(message.numel() >= need, op, ": message must hold ", need, " bytes, got ",
              message.numel());
  TORCH_CHECK(message.device() == like.device(), op, ": tensors must be on one device, got ",
              message.device(), " and ", like.device());
}

void check_covers(const BlockTable& table, const at::Tensor& t, int64_t block, const char* op,
                  const char* what) {
  TORCH_CHECK(table.extent() <= t.numel(), op, ": the blocks reach value ", table.extent(), ", ",
              what, " holds ", t.numel());
  for (const auto& r : table.refs()) {
    TORCH_CHECK(r.len >= 1 && r.len <= block && r.begin >= 0, op, ": a block of ", r.len,
                " values at ", r.begin, " does not fit blocks of ", block);
  }
}

// Blocks per task of ATen's thread pool: about 64K values, so that small buckets stay on the
// calling thread and large ones spread over every core.
int64_t quant_grain_blocks(int64_t block) {
  return std::max<int64_t>(1, (int64_t(1) << 16) / block);
}

}  // namespace

BlockTable::BlockTable(std::vector<kernels::BlockRef> refs) : refs_(std::move(refs)) {
  for (const auto& r : refs_) extent_ = std::max(extent_, r.begin + r.len);
}

BlockTable BlockTable::contiguous(int64_t n, int64_t block, uint64_t draw_base) {
  std::vector<kernels::BlockRef> refs;
  for (int64_t begin = 0; begin < n; begin += block) {
    refs.push_back({begin, std::min(block, n - begin), draw_base + static_cast<uint64_t>(begin)});
  }
  return BlockTable(std::move(refs));
}

void BlockTable::to(const c10::Device& device) {
  if (device.is_cpu() || refs_.empty()) return;
  if (device_refs_.defined() && device_refs_.device() == device) return;
  const at::Tensor host = at::from_blob(refs_.data(), {size(), 3}, at::kLong);
  device_refs_ = host.to(device);
}

const kernels::BlockRef* BlockTable::data(const c10::Device& device) const {
  if (device.is_cpu() || refs_.empty()) return refs_.data();
  TORCH_CHECK(device_refs_.defined() && device_refs_.device() == device,
              "ddpx::ops::BlockTable: not copied to ", device, " (call to() first)");
  return reinterpret_cast<const kernels::BlockRef*>(device_refs_.data_ptr());
}

int64_t quantized_message_bytes(int64_t blocks, int bits, int64_t block) {
  return kernels::quantized_message_bytes(blocks, bits, block);
}

void quantize_ef_into(const at::Tensor& x, const at::Tensor& residual, const BlockTable& table,
                      const kernels::QuantSpec& spec, const at::Tensor& message) {
  const char* op = "ddpx::ops::quantize_ef_into";
  check_qformat(spec.bits, spec.block, op);
  check_rotation(spec.rotate, spec.block, op);
  check_qtensor(x, op, "x");
  check_covers(table, x, spec.block, op, "x");
  const int64_t blocks = table.size();
  check_qmessage(message, kernels::quantized_message_bytes(blocks, spec.bits, spec.block), x, op);
  float* res = nullptr;
  if (residual.defined()) {
    check_qtensor(residual, op, "residual");
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.numel() == x.numel() &&
                    residual.device() == x.device(),
                op, ": residual must be fp32 of ", x.numel(), " values on ", x.device());
    res = residual.data_ptr<float>();
  }
  const auto t = to_kernel_dtype(x.scalar_type(), "the quantized tensor");
  auto* scales = reinterpret_cast<float*>(message.data_ptr());
  uint8_t* codes = static_cast<uint8_t*>(message.data_ptr()) + 4 * blocks;
  const void* xp = x.data_ptr();
  const kernels::BlockRef* refs = table.data(x.device());
  if (x.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(x);
    kernels::quantize_ef_blocks_cuda(xp, t, res, refs, blocks, spec, scales, codes,
                                     launch.stream());
#endif
    return;
  }
  at::parallel_for(0, blocks, quant_grain_blocks(spec.block), [&](int64_t b0, int64_t b1) {
    kernels::quantize_ef_blocks_cpu(xp, t, res, refs, b0, b1, spec, scales, codes);
  });
}

void dequantize_sum_into(const at::Tensor& messages, const BlockTable& table, int bits,
                         int64_t block, float post_scale, const at::Tensor& dst,
                         const ExactValues& exact, const kernels::Unrotate& unrotate) {
  const char* op = "ddpx::ops::dequantize_sum_into";
  check_qformat(bits, block, op);
  check_rotation(unrotate.on, block, op);
  check_qtensor(dst, op, "dst");
  check_covers(table, dst, block, op, "dst");
  TORCH_CHECK(dst.scalar_type() == at::kFloat, op, ": dst must be fp32");
  const bool has_exact = exact.x.defined();
  TORCH_CHECK(messages.dim() == 2 && messages.size(0) >= (has_exact ? 0 : 1), op,
              ": messages must be [rows, bytes] with rows >= 1 (>= 0 with an exact term)");
  const int64_t blocks = table.size();
  const int64_t rows = messages.size(0), row_bytes = messages.size(1);
  kernels::ExactTerm term;
  if (has_exact) {
    TORCH_CHECK(exact.table != nullptr && exact.table->size() == blocks, op,
                ": the exact term's table must have the sum's ", blocks, " blocks");
    check_qtensor(exact.x, op, "the exact term");
    check_covers(*exact.table, exact.x, block, op, "the exact term");
    TORCH_CHECK(exact.x.device() == dst.device(), op, ": tensors must be on one device, got ",
                exact.x.device(), " and ", dst.device());
    TORCH_CHECK(exact.row >= 0 && exact.row <= rows, op, ": the exact term's row ", exact.row,
                " must be in [0, ", rows, "]");
    for (int64_t m = 0; m < blocks; ++m) {
      TORCH_CHECK(exact.table->refs()[m].len == table.refs()[m].len, op, ": block ", m,
                  " of the exact term holds ", exact.table->refs()[m].len, " values, the sum's ",
                  table.refs()[m].len);
    }
    term.x = exact.x.data_ptr();
    term.t = to_kernel_dtype(exact.x.scalar_type(), "the exact term");
    term.refs = exact.table->data(dst.device());
    term.row = exact.row;
  }
  if (rows > 0) {
    check_qmessage(messages[0], kernels::quantized_message_bytes(blocks, bits, block), dst, op);
    check_qtensor(messages, op, "messages");
  }
  const auto* m = rows > 0 ? static_cast<const uint8_t*>(messages.data_ptr()) : nullptr;
  float* d = dst.data_ptr<float>();
  const kernels::BlockRef* refs = table.data(dst.device());
  if (dst.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(dst);
    kernels::dequantize_sum_blocks_cuda(m, rows, row_bytes, blocks, refs, bits, block, post_scale,
                                        d, term, unrotate, launch.stream());
#endif
    return;
  }
  at::parallel_for(0, blocks, quant_grain_blocks(block), [&](int64_t b0, int64_t b1) {
    kernels::dequantize_sum_blocks_cpu(m, rows, row_bytes, blocks, refs, b0, b1, bits, block,
                                       post_scale, d, term, unrotate);
  });
}

void dequantize_into(const at::Tensor& message, const BlockTable& table, int bits, int64_t block,
                     const at::Tensor& dst, const kernels::Unrotate& unrotate) {
  const char* op = "ddpx::ops::dequantize_into";
  check_qformat(bits, block, op);
  check_rotation(unrotate.on, block, op);
  check_qtensor(dst, op, "dst");
  check_covers(table, dst, block, op, "dst");
  const int64_t blocks = table.size();
  check_qmessage(message, kernels::quantized_message_bytes(blocks, bits, block), dst, op);
  const auto t = to_kernel_dtype(dst.scalar_type(), "the destination tensor");
  const auto* m = static_cast<const uint8_t*>(message.data_ptr());
  void* d = dst.data_ptr();
  const kernels::BlockRef* refs = table.data(dst.device());
  if (dst.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(dst);
    kernels::dequantize_blocks_cuda(m, blocks, refs, bits, block, d, t, unrotate, launch.stream());
#endif
    return;
  }
  at::parallel_for(0, blocks, quant_grain_blocks(block), [&](int64_t b0, int64_t b1) {
    kernels::dequantize_blocks_cpu(m, blocks, refs, b0, b1, bits, block, d, t, unrotate);
  });
}

}  // namespace ops
}  // namespace ddpx
