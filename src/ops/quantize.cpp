#include "ops/quantize.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "kernels/quantize.h"
#include "ops/cast.h"
#include "ops/cuda_launch.h"

#ifdef DDPX_WITH_CUDA
#include "kernels/quantize_cuda.h"
#endif

namespace ddpx {
namespace ops {
namespace {

void check_tensor(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.defined(), op, ": ", what, " must be defined");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", what, " must be dense, got ", t.layout());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": ", what,
              " must be a CPU or CUDA tensor, got ", t.device());
  TORCH_CHECK(kWithCuda || t.device().is_cpu(), op,
              ": ddpx was built without CUDA support; rebuild with a CUDA-enabled torch to use ",
              t.device(), " tensors");
}

void check_channels(int64_t n, int64_t channel, int64_t channels, const char* op) {
  TORCH_CHECK(channel >= 1 && channels >= 0 && (channels == 0 ? n == 0 : channels * channel >= n),
              op, ": ", channels, " channels of ", channel, " values cannot hold ", n, " values");
}

}  // namespace

int64_t quantized_row_bytes(int64_t n, int64_t channels) {
  return kernels::quantized_row_bytes(n, channels);
}

void quantize_row_into(const at::Tensor& x, int64_t channel, int64_t channels,
                       const at::Tensor& row) {
  const char* op = "ddpx::ops::quantize_row_into";
  check_tensor(x, op, "x");
  check_tensor(row, op, "row");
  TORCH_CHECK(row.scalar_type() == at::kByte, op, ": row must be uint8, got ", row.scalar_type());
  TORCH_CHECK(x.device() == row.device(), op, ": x and row must be on one device, got ", x.device(),
              " and ", row.device());
  const int64_t n = x.numel();
  check_channels(n, channel, channels, op);
  TORCH_CHECK(row.numel() == kernels::quantized_row_bytes(n, channels), op, ": row must hold ",
              kernels::quantized_row_bytes(n, channels), " bytes, got ", row.numel());
  const auto t = to_kernel_dtype(x.scalar_type(), "the quantized tensor");
  auto* out = static_cast<uint8_t*>(row.data_ptr());
  if (x.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(x);
    const at::Tensor workspace = at::empty(
        {kernels::quantize_row_cuda_workspace_bytes(n, channel, channels)}, row.options());
    kernels::quantize_row_cuda(x.data_ptr(), t, n, channel, channels, out, workspace.data_ptr(),
                               launch.stream());
#endif
    return;
  }
  kernels::quantize_row_cpu(x.data_ptr(), t, n, channel, channels, out);
}

void dequantize_mean_into(const at::Tensor& peers, const at::Tensor& own, int64_t own_row,
                          int64_t channel, int64_t channels, const at::Tensor& dst) {
  const char* op = "ddpx::ops::dequantize_mean_into";
  check_tensor(peers, op, "peers");
  check_tensor(own, op, "own");
  check_tensor(dst, op, "dst");
  const int64_t n = dst.numel();
  check_channels(n, channel, channels, op);
  const int64_t row_bytes = kernels::quantized_row_bytes(n, channels);
  TORCH_CHECK(peers.scalar_type() == at::kByte && own.scalar_type() == at::kByte, op,
              ": rows must be uint8");
  TORCH_CHECK(own.numel() == row_bytes && peers.numel() % row_bytes == 0, op, ": rows of ",
              row_bytes, " bytes expected, got ", own.numel(), " and ", peers.numel());
  TORCH_CHECK(peers.device() == dst.device() && own.device() == dst.device(), op,
              ": rows and dst must be on one device");
  const int64_t rows = peers.numel() / row_bytes + 1;
  TORCH_CHECK(own_row >= 0 && own_row < rows, op, ": own_row ", own_row, " is not in [0, ", rows,
              ")");
  const auto dt = to_kernel_dtype(dst.scalar_type(), "the destination tensor");
  const auto* p = static_cast<const uint8_t*>(peers.data_ptr());
  const auto* o = static_cast<const uint8_t*>(own.data_ptr());
  if (dst.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(dst);
    kernels::dequantize_mean_cuda(p, o, own_row, rows, n, channel, channels, dst.data_ptr(), dt,
                                  launch.stream());
#endif
    return;
  }
  kernels::dequantize_mean_cpu(p, o, own_row, rows, n, channel, channels, dst.data_ptr(), dt);
}

}  // namespace ops
}  // namespace ddpx
