#include "ops/lowrank.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <initializer_list>

#include "kernels/lowrank.h"
#include "ops/cuda_launch.h"

#ifdef DDPX_WITH_CUDA
#include "kernels/lowrank_cuda.h"
#endif

namespace ddpx {
namespace ops {
namespace {

// From this rank on, torch's BLAS beats the one-pass kernels when it is MKL: their cost grows
// with the rank (they turn compute-bound) while MKL's blocked GEMM runs these shapes several times
// faster per thread (`bench_powersgd.py --ranks 1,4,32` shows the crossover; figures in
// docs/benchmarks.md). Below rank 16 the kernels' single pass over M is kept. A generic BLAS
// never beats them. The choice depends on the shapes and torch's build alone, so every rank
// makes the same.
constexpr int64_t kBlasMinRank = 16;

// ddpx's one-pass CPU kernels take contiguous fp32/fp64 tensors of one dtype, at ranks below
// kBlasMinRank when torch has MKL; anything else goes to at::bmm. `rank` is the factors' width.
bool use_cpu_kernels(int64_t rank, std::initializer_list<const at::Tensor*> ts) {
  static const bool mkl = at::hasMKL();
  if (mkl && rank >= kBlasMinRank) return false;
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
T* matrix(const at::Tensor& t, int64_t b) {
  return t.data_ptr<T>() + b * t.size(1) * t.size(2);
}

// The path the three products share: check the 3-D batches, then either ddpx's one-pass CPU
// kernel per batch item (kernel(b, scalar_t{})) or ATen's batched GEMM into `out` (bmm(out)).
template <typename Bmm, typename Kernel>
void product(const at::Tensor& x, const char* x_name, const at::Tensor& y, const char* y_name,
             const at::Tensor& out, const char* out_name, Bmm&& bmm, Kernel&& kernel) {
  check_batch(x, x_name);
  check_batch(y, y_name);
  check_batch(out, out_name);
  // The factors' width: the last dimension of Q or P (y in the projections, both in
  // the reconstruction).
  if (!use_cpu_kernels(y.size(2), {&x, &y, &out})) {
    at::Tensor result = out;
    bmm(result);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "PowerSGD product", [&] {
    for (int64_t b = 0; b < out.size(0); ++b) kernel(b, scalar_t{});
  });
}

// The error memory fused into a product: M's shape, dtype and device, contiguous (the kernels
// walk it row by row beside M).
void check_error_buffer(const at::Tensor& err, const at::Tensor& M, const char* who) {
  TORCH_CHECK(err.sizes() == M.sizes() && err.scalar_type() == M.scalar_type() &&
                  err.device() == M.device() && err.is_contiguous(),
              who, ": err must be contiguous and shaped as M ", M.sizes(), ", got ", err.sizes());
}

}  // namespace

void lowrank_project_(const at::Tensor& M, const at::Tensor& Q, const at::Tensor& P,
                      const at::Tensor& err) {
  const bool compensate = err.defined();
  if (compensate) check_error_buffer(err, M, "lowrank_project_");
  product(
      M, "M", Q, "Q", P, "P",
      [&](at::Tensor& out) {
        if (compensate) error_feedback_apply_(M, err);
        at::bmm_out(out, M, Q);
      },
      [&](int64_t b, auto tag) {
        using T = decltype(tag);
        if (compensate) {
          kernels::lowrank_compensate_project_cpu(matrix<T>(M, b), matrix<T>(err, b), M.size(1),
                                                  M.size(2), matrix<T>(Q, b), Q.size(2),
                                                  matrix<T>(P, b));
        } else {
          kernels::lowrank_project_cpu(matrix<T>(M, b), M.size(1), M.size(2), matrix<T>(Q, b),
                                       Q.size(2), matrix<T>(P, b));
        }
      });
}

void lowrank_project_t_(const at::Tensor& M, const at::Tensor& P, const at::Tensor& Q) {
  product(
      M, "M", P, "P", Q, "Q", [&](at::Tensor& out) { at::bmm_out(out, M.transpose(1, 2), P); },
      [&](int64_t b, auto tag) {
        using T = decltype(tag);
        kernels::lowrank_project_t_cpu(matrix<T>(M, b), M.size(1), M.size(2), matrix<T>(P, b),
                                       P.size(2), matrix<T>(Q, b));
      });
}

void lowrank_reconstruct_(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& M,
                          const at::Tensor& err) {
  const bool residual = err.defined();
  if (residual) check_error_buffer(err, M, "lowrank_reconstruct_");
  product(
      P, "P", Q, "Q", M, "M",
      [&](at::Tensor& out) {
        at::bmm_out(out, P, Q.transpose(1, 2));
        if (residual) err.sub_(M);
      },
      [&](int64_t b, auto tag) {
        using T = decltype(tag);
        kernels::lowrank_reconstruct_cpu(matrix<T>(P, b), matrix<T>(Q, b), M.size(1), M.size(2),
                                         P.size(2), matrix<T>(M, b),
                                         residual ? matrix<T>(err, b) : nullptr);
      });
}

void error_feedback_apply_(const at::Tensor& input, const at::Tensor& err) {
  TORCH_CHECK(input.numel() == err.numel() && input.scalar_type() == err.scalar_type() &&
                  input.device() == err.device(),
              "error_feedback_apply_: input and error buffers must match");
  const bool fused = input.is_contiguous() && err.is_contiguous() &&
                     (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble) &&
                     (input.device().is_cpu() || (kWithCuda && input.is_cuda()));
  if (!fused) {
    err.add_(input.view(err.sizes()));
    input.copy_(err.view(input.sizes()));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "error_feedback_apply_", [&] {
    scalar_t* in = input.data_ptr<scalar_t>();
    scalar_t* acc = err.data_ptr<scalar_t>();
#ifdef DDPX_WITH_CUDA
    if (input.is_cuda()) {
      const CudaLaunch launch(input);
      kernels::error_feedback_apply_cuda(in, acc, input.numel(), launch.stream());
      return;
    }
#endif
    kernels::error_feedback_apply_cpu(in, acc, input.numel());
  });
}

}  // namespace ops
}  // namespace ddpx
