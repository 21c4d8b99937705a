#include <ddpx/compression/powersgd_ops.h>

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <ddpx/compression/lowrank.h>
#include <ddpx/compression/orthogonalize.h>

#ifdef DDPX_WITH_CUDA
// Not ATen/cuda/CUDAContext.h: it pulls in the cuBLAS/cuSPARSE/cuSOLVER headers.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <ddpx/compression/orthogonalize_cuda.h>
#endif

namespace ddpx {

MatrixPack::MatrixPack(std::vector<int64_t> offsets, std::vector<int64_t> rows,
                       std::vector<int64_t> cols, const at::Device& device)
    : offsets_(std::move(offsets)), rows_(std::move(rows)), cols_(std::move(cols)) {
  TORCH_INTERNAL_ASSERT(offsets_.size() == rows_.size() && rows_.size() == cols_.size());
  for (size_t k = 0; k < rows_.size(); ++k) {
    TORCH_CHECK(cols_[k] <= rows_[k], "MatrixPack: matrix ", k, " has more columns (", cols_[k],
                ") than rows (", rows_[k], ")");
    TORCH_CHECK(offsets_[k] >= 0 && rows_[k] >= 0 && cols_[k] >= 0, "MatrixPack: matrix ", k,
                " has a negative offset or size");
    extent_ = std::max(extent_, offsets_[k] + rows_[k] * cols_[k]);
  }
  if (device.is_cuda() && !offsets_.empty()) {
    std::vector<int64_t> all(offsets_);
    all.insert(all.end(), rows_.begin(), rows_.end());
    all.insert(all.end(), cols_.begin(), cols_.end());
    device_desc_ = at::tensor(all, at::kLong).view({3, count()}).to(device);
  }
}

MatrixPack MatrixPack::back_to_back(std::vector<int64_t> rows, std::vector<int64_t> cols,
                                    const at::Device& device, int64_t first) {
  TORCH_CHECK(rows.size() == cols.size(), "MatrixPack: rows and cols must have the same length, "
              "got ", rows.size(), " and ", cols.size());
  std::vector<int64_t> offsets;
  offsets.reserve(rows.size());
  for (size_t k = 0; k < rows.size(); ++k) {
    offsets.push_back(first);
    first += rows[k] * cols[k];
  }
  return MatrixPack(std::move(offsets), std::move(rows), std::move(cols), device);
}

void orthogonalize_(const at::Tensor& flat, const MatrixPack& pack, double epsilon) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "orthogonalize_: expected a contiguous 1-D buffer");
  if (pack.count() == 0) return;
  // An out-of-bounds write on the GPU would leave a sticky error in the CUDA context.
  TORCH_CHECK(pack.extent() <= flat.numel(), "orthogonalize_: the matrices extend to element ",
              pack.extent(), " but the buffer has ", flat.numel());
  if (flat.scalar_type() == at::kHalf || flat.scalar_type() == at::kBFloat16) {
    at::Tensor wide = flat.to(at::kFloat);
    orthogonalize_(wide, pack, epsilon);
    flat.copy_(wide);
    return;
  }
  TORCH_CHECK(flat.scalar_type() == at::kFloat || flat.scalar_type() == at::kDouble,
              "orthogonalize_: unsupported dtype ", flat.scalar_type());
  if (flat.is_cuda()) {
#ifdef DDPX_WITH_CUDA
    c10::cuda::CUDAGuard guard(flat.device());
    const at::Tensor& d = pack.device_descriptors();
    TORCH_CHECK(d.defined() && d.device() == flat.device(),
                "orthogonalize_: the MatrixPack was built for another device");
    auto stream = c10::cuda::getCurrentCUDAStream(flat.device().index()).stream();
    const int64_t* base = d.data_ptr<int64_t>();
    const int64_t n = pack.count();
    if (flat.scalar_type() == at::kFloat) {
      kernels::orthogonalize_cuda(flat.data_ptr<float>(), base, base + n, base + 2 * n, n,
                                  static_cast<float>(epsilon), stream);
    } else {
      kernels::orthogonalize_cuda(flat.data_ptr<double>(), base, base + n, base + 2 * n, n,
                                  epsilon, stream);
    }
    return;
#else
    TORCH_CHECK(false, "orthogonalize_: ddpx was built without CUDA support");
#endif
  }
  if (flat.scalar_type() == at::kFloat) {
    kernels::orthogonalize_cpu(flat.data_ptr<float>(), pack.offsets().data(), pack.rows().data(),
                               pack.cols().data(), pack.count(), static_cast<float>(epsilon));
  } else {
    kernels::orthogonalize_cpu(flat.data_ptr<double>(), pack.offsets().data(), pack.rows().data(),
                               pack.cols().data(), pack.count(), epsilon);
  }
}

namespace {

bool use_cpu_kernels(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    if (!t->device().is_cpu() || !t->is_contiguous() ||
        (t->scalar_type() != at::kFloat && t->scalar_type() != at::kDouble) ||
        t->scalar_type() != (*ts.begin())->scalar_type()) {
      return false;
    }
  }
  return true;
}

void check_batch(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 3, "PowerSGD products: ", what, " must be 3-D [batch, rows, cols], got ",
              t.sizes());
}

template <typename T>
T* ptr(const at::Tensor& t, int64_t b) {
  return t.data_ptr<T>() + b * t.size(1) * t.size(2);
}

}  // namespace

void lowrank_project_(const at::Tensor& M, const at::Tensor& Q, const at::Tensor& P) {
  check_batch(M, "M");
  check_batch(Q, "Q");
  check_batch(P, "P");
  if (!use_cpu_kernels({&M, &Q, &P})) {
    at::Tensor out = P;
    at::bmm_out(out, M, Q);
    return;
  }
  const int64_t n = M.size(1), m = M.size(2), r = Q.size(2);
  for (int64_t b = 0; b < M.size(0); ++b) {
    if (M.scalar_type() == at::kFloat) {
      kernels::lowrank_project_cpu(ptr<float>(M, b), n, m, ptr<float>(Q, b), r, ptr<float>(P, b));
    } else {
      kernels::lowrank_project_cpu(ptr<double>(M, b), n, m, ptr<double>(Q, b), r,
                                   ptr<double>(P, b));
    }
  }
}

void lowrank_project_t_(const at::Tensor& M, const at::Tensor& P, const at::Tensor& Q) {
  check_batch(M, "M");
  check_batch(P, "P");
  check_batch(Q, "Q");
  if (!use_cpu_kernels({&M, &P, &Q})) {
    at::Tensor out = Q;
    at::bmm_out(out, M.transpose(1, 2), P);
    return;
  }
  const int64_t n = M.size(1), m = M.size(2), r = P.size(2);
  for (int64_t b = 0; b < M.size(0); ++b) {
    if (M.scalar_type() == at::kFloat) {
      kernels::lowrank_project_t_cpu(ptr<float>(M, b), n, m, ptr<float>(P, b), r,
                                     ptr<float>(Q, b));
    } else {
      kernels::lowrank_project_t_cpu(ptr<double>(M, b), n, m, ptr<double>(P, b), r,
                                     ptr<double>(Q, b));
    }
  }
}

void lowrank_reconstruct_(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& M) {
  check_batch(P, "P");
  check_batch(Q, "Q");
  check_batch(M, "M");
  if (!use_cpu_kernels({&P, &Q, &M})) {
    at::Tensor out = M;
    at::bmm_out(out, P, Q.transpose(1, 2));
    return;
  }
  const int64_t n = M.size(1), m = M.size(2), r = P.size(2);
  for (int64_t b = 0; b < M.size(0); ++b) {
    if (M.scalar_type() == at::kFloat) {
      kernels::lowrank_reconstruct_cpu(ptr<float>(P, b), ptr<float>(Q, b), n, m, r,
                                       ptr<float>(M, b));
    } else {
      kernels::lowrank_reconstruct_cpu(ptr<double>(P, b), ptr<double>(Q, b), n, m, r,
                                       ptr<double>(M, b));
    }
  }
}

void error_feedback_apply_(const at::Tensor& input, const at::Tensor& err) {
  TORCH_CHECK(input.numel() == err.numel() && input.scalar_type() == err.scalar_type() &&
                  input.device() == err.device(),
              "error_feedback_apply_: input and error buffers must match");
#ifdef DDPX_WITH_CUDA
  if (input.is_cuda() && input.is_contiguous() && err.is_contiguous() &&
      (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble)) {
    c10::cuda::CUDAGuard guard(input.device());
    auto stream = c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
    if (input.scalar_type() == at::kFloat) {
      kernels::error_feedback_apply_cuda(input.data_ptr<float>(), err.data_ptr<float>(),
                                         input.numel(), stream);
    } else {
      kernels::error_feedback_apply_cuda(input.data_ptr<double>(), err.data_ptr<double>(),
                                         input.numel(), stream);
    }
    return;
  }
#endif
  if (input.device().is_cpu() && input.is_contiguous() && err.is_contiguous()) {
    if (input.scalar_type() == at::kFloat) {
      kernels::error_feedback_apply_cpu(input.data_ptr<float>(), err.data_ptr<float>(),
                                        input.numel());
      return;
    }
    if (input.scalar_type() == at::kDouble) {
      kernels::error_feedback_apply_cpu(input.data_ptr<double>(), err.data_ptr<double>(),
                                        input.numel());
      return;
    }
  }
  err.add_(input.view(err.sizes()));
  input.copy_(err.view(input.sizes()));
}

}  // namespace ddpx
