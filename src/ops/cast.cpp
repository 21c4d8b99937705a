#include "ops/cast.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ops/cuda_launch.h"

#ifdef DDPX_WITH_CUDA
#include "kernels/cast_cuda.h"
#endif

namespace ddpx {
namespace ops {
namespace {

void check_pair(const at::Tensor& src, const at::Tensor& dst, const char* op) {
  TORCH_CHECK(src.defined() && dst.defined(), op, ": tensors must be defined");
  TORCH_CHECK(src.device() == dst.device(), op, ": src and dst must be on the same device, got ",
              src.device(), " and ", dst.device());
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), op, ": tensors must be contiguous");
  TORCH_CHECK(src.layout() == at::kStrided && dst.layout() == at::kStrided, op,
              ": sparse tensors are not supported");
  TORCH_CHECK(src.device().is_cpu() || src.device().is_cuda(), op,
              ": only CPU and CUDA tensors are supported, got ", src.device());
  TORCH_CHECK(kWithCuda || src.device().is_cpu(), op,
              ": ddpx was built without CUDA support; rebuild with a CUDA-enabled torch to use ",
              src.device(), " tensors");
}

}  // namespace

kernels::DType to_kernel_dtype(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kDouble:
      return kernels::DType::kFloat64;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      TORCH_CHECK(false, what,
                  " must have a floating-point dtype (float32, float64, float16 or bfloat16), got ",
                  t);
  }
}

at::Tensor scaled_cast(const at::Tensor& src, at::ScalarType dtype, double scale) {
  TORCH_CHECK(src.defined(), "ddpx::ops::scaled_cast: src must be defined");
  // Checked before contiguous(): torch 2.x raises an unrelated message for a sparse tensor there.
  TORCH_CHECK(src.layout() == at::kStrided,
              "ddpx::ops::scaled_cast: sparse tensors are not supported, got ", src.layout());
  at::Tensor dst = at::empty({src.numel()}, src.options().dtype(dtype));
  scaled_cast_into(src.contiguous(), dst, scale);
  return dst;
}

void scaled_cast_into(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_pair(src, dst, "ddpx::ops::scaled_cast_into");
  TORCH_CHECK(src.numel() == dst.numel(), "ddpx::ops::scaled_cast_into: src has ", src.numel(),
              " elements but dst has ", dst.numel());
  const auto st = to_kernel_dtype(src.scalar_type(), "source tensor");
  const auto dt = to_kernel_dtype(dst.scalar_type(), "destination tensor");
  if (src.numel() == 0) return;
  // In place is one dtype over the same elements; any other overlap would read values already
  // overwritten (and break the CUDA kernel's no-alias promise).
  const char* s = static_cast<const char*>(src.data_ptr());
  const char* d = static_cast<const char*>(dst.data_ptr());
  TORCH_CHECK(s == d ? src.scalar_type() == dst.scalar_type()
                     : s + src.nbytes() <= d || d + dst.nbytes() <= s,
              "ddpx::ops::scaled_cast_into: src and dst overlap; only an exact in-place cast "
              "(same memory, same dtype) is supported");
  if (src.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(src);
    kernels::scaled_cast_cuda(src.data_ptr(), st, dst.data_ptr(), dt, src.numel(), scale,
                              launch.stream());
#endif
    return;
  }
  kernels::scaled_cast_cpu(src.data_ptr(), st, dst.data_ptr(), dt, src.numel(), scale);
}

namespace {

// dst = cast(scale * sum of `rows` rows in order), on dst's device: the rows of `packed`
// (contiguous, n = dst.numel() each), except that with `own` defined, row own_row is `own` and
// `packed` skips it. Checked by the callers.
void sum_rows_dispatch(const at::Tensor& packed, int64_t rows, const at::Tensor& own,
                       int64_t own_row, const at::Tensor& dst, double scale) {
  const at::Tensor& any = own.defined() ? own : packed;
  const auto st = to_kernel_dtype(any.scalar_type(), "source tensor");
  const auto dt = to_kernel_dtype(dst.scalar_type(), "destination tensor");
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (!own.defined()) own_row = -1;
  if (dst.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(dst);
    kernels::sum_rows_cuda(packed.data_ptr(), st, rows, n, dst.data_ptr(), dt, scale,
                           launch.stream(), own.defined() ? own.data_ptr() : nullptr, own_row);
#endif
    return;
  }
  const auto* base = static_cast<const char*>(packed.data_ptr());
  const size_t row_bytes = static_cast<size_t>(n) * kernels::dtype_size(st);
  std::vector<const void*> ptrs;
  ptrs.reserve(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t packed_row = own_row >= 0 && r > own_row ? r - 1 : r;
    ptrs.push_back(r == own_row ? own.data_ptr() : base + packed_row * row_bytes);
  }
  kernels::sum_row_ptrs_cpu(ptrs.data(), st, rows, n, dst.data_ptr(), dt, scale);
}

}  // namespace

void sum_rows_into(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_pair(src, dst, "ddpx::ops::sum_rows_into");
  TORCH_CHECK(src.dim() == 2, "ddpx::ops::sum_rows_into: src must be 2-D [rows, n], got ",
              src.sizes());
  TORCH_CHECK(src.size(0) >= 1, "ddpx::ops::sum_rows_into: src must have at least one row");
  TORCH_CHECK(src.size(1) == dst.numel(), "ddpx::ops::sum_rows_into: src rows have ", src.size(1),
              " elements but dst has ", dst.numel());
  sum_rows_dispatch(src, src.size(0), at::Tensor(), -1, dst, scale);
}

void sum_rows_with_own_into(const at::Tensor& peers, const at::Tensor& own, int64_t own_row,
                            const at::Tensor& dst, double scale) {
  const char* op = "ddpx::ops::sum_rows_with_own_into";
  check_pair(peers, dst, op);
  check_pair(own, dst, op);
  TORCH_CHECK(peers.dim() == 2 && peers.size(1) == dst.numel() && own.numel() == dst.numel(), op,
              ": peers must be [rows - 1, n] and own [n] with n = dst.numel(), got ", peers.sizes(),
              " and ", own.sizes(), " for ", dst.numel());
  TORCH_CHECK(peers.scalar_type() == own.scalar_type(), op, ": peers and own must share a dtype");
  const int64_t rows = peers.size(0) + 1;
  TORCH_CHECK(own_row >= 0 && own_row < rows, op, ": own_row ", own_row, " is not in [0, ", rows,
              ")");
  sum_rows_dispatch(peers, rows, own, own_row, dst, scale);
}

}  // namespace ops
}  // namespace ddpx
