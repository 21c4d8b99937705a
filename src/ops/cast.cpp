#include "ops/cast.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

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

void sum_rows_into(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_pair(src, dst, "ddpx::ops::sum_rows_into");
  TORCH_CHECK(src.dim() == 2, "ddpx::ops::sum_rows_into: src must be 2-D [rows, n], got ",
              src.sizes());
  TORCH_CHECK(src.size(0) >= 1, "ddpx::ops::sum_rows_into: src must have at least one row");
  TORCH_CHECK(src.size(1) == dst.numel(), "ddpx::ops::sum_rows_into: src rows have ", src.size(1),
              " elements but dst has ", dst.numel());
  const auto st = to_kernel_dtype(src.scalar_type(), "source tensor");
  const auto dt = to_kernel_dtype(dst.scalar_type(), "destination tensor");
  if (dst.numel() == 0) return;
  if (src.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    const CudaLaunch launch(src);
    kernels::sum_rows_cuda(src.data_ptr(), st, src.size(0), src.size(1), dst.data_ptr(), dt, scale,
                           launch.stream());
#endif
    return;
  }
  kernels::sum_rows_cpu(src.data_ptr(), st, src.size(0), src.size(1), dst.data_ptr(), dt, scale);
}

void sum_row_list_into(const std::vector<at::Tensor>& rows, const at::Tensor& dst, double scale) {
  TORCH_CHECK(!rows.empty(), "ddpx::ops::sum_row_list_into: no rows");
  std::vector<const void*> ptrs;
  ptrs.reserve(rows.size());
  for (const at::Tensor& r : rows) {
    check_pair(r, dst, "ddpx::ops::sum_row_list_into");
    TORCH_CHECK(r.device().is_cpu(), "ddpx::ops::sum_row_list_into: CPU tensors only, got ",
                r.device());
    TORCH_CHECK(r.numel() == dst.numel() && r.scalar_type() == rows[0].scalar_type(),
                "ddpx::ops::sum_row_list_into: rows must match dst in size and share one dtype");
    ptrs.push_back(r.data_ptr());
  }
  const auto st = to_kernel_dtype(rows[0].scalar_type(), "source tensor");
  const auto dt = to_kernel_dtype(dst.scalar_type(), "destination tensor");
  kernels::sum_row_ptrs_cpu(ptrs.data(), st, static_cast<int64_t>(rows.size()), dst.numel(),
                            dst.data_ptr(), dt, scale);
}

}  // namespace ops
}  // namespace ddpx
