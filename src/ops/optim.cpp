#include "ops/optim.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "ops/cast.h"  // to_kernel_dtype
#include "ops/cuda_launch.h"

#ifdef DDPX_WITH_CUDA
#include "kernels/optim_cuda.h"
#endif

namespace ddpx {
namespace ops {
namespace {

// Elements per task: ATen's own grain, so small tensors run on the calling thread.
constexpr int64_t kGrain = 32768;

kernels::DType check_like(const at::Tensor& param, const at::Tensor& t, const char* what) {
  TORCH_INTERNAL_ASSERT(t.defined(), what, " must be defined");
  TORCH_INTERNAL_ASSERT(t.device() == param.device() && t.scalar_type() == param.scalar_type() &&
                            t.numel() == param.numel() && t.is_contiguous(),
                        what, " must match the parameter and be contiguous");
  return to_kernel_dtype(t.scalar_type(), what);
}

void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The kernels by tensor type, so that run() serves every optimizer.
void cpu_range(const kernels::SgdTensor& t, kernels::DType dt, const kernels::SgdScalars& s,
               int64_t begin, int64_t end) {
  kernels::sgd_cpu(t, dt, s, begin, end);
}
void cpu_range(const kernels::AdamTensor& t, kernels::DType dt, const kernels::AdamScalars& s,
               int64_t begin, int64_t end) {
  kernels::adam_cpu(t, dt, s, begin, end);
}
#ifdef DDPX_WITH_CUDA
void cuda_all(const kernels::SgdTensor& t, kernels::DType dt, const kernels::SgdScalars& s,
              cudaStream_t stream) {
  kernels::sgd_cuda(t, dt, s, stream);
}
void cuda_all(const kernels::AdamTensor& t, kernels::DType dt, const kernels::AdamScalars& s,
              cudaStream_t stream) {
  kernels::adam_cuda(t, dt, s, stream);
}
#endif

// Runs `t`'s update: on the current stream of param's CUDA device, or split across ATen's
// intra-op threads on CPU.
template <typename KTensor, typename KScalars>
void run(const at::Tensor& param, const KTensor& t, kernels::DType dt, const KScalars& s) {
  run_elementwise(
      param, t.n, kGrain,
      [&](auto stream) {
#ifdef DDPX_WITH_CUDA
        cuda_all(t, dt, s, stream);
#endif
        (void)stream;
      },
      [&](int64_t begin, int64_t end) { cpu_range(t, dt, s, begin, end); });
}

}  // namespace

void sgd_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& buf,
                const kernels::SgdScalars& s) {
  const kernels::DType dt = check_like(param, param, "param");
  check_like(param, grad, "grad");
  if (s.momentum != 0) check_like(param, buf, "momentum_buffer");
  kernels::SgdTensor t;
  t.param = param.data_ptr();
  t.grad = grad.data_ptr();
  t.buf = s.momentum != 0 ? buf.data_ptr() : nullptr;
  t.n = param.numel();
  run(param, t, dt, s);
}

void adam_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                 const kernels::AdamScalars& s) {
  const kernels::DType dt = check_like(param, param, "param");
  check_like(param, grad, "grad");
  check_like(param, exp_avg, "exp_avg");
  check_like(param, exp_avg_sq, "exp_avg_sq");
  if (s.amsgrad) check_like(param, max_exp_avg_sq, "max_exp_avg_sq");
  kernels::AdamTensor t;
  t.param = param.data_ptr();
  t.grad = grad.data_ptr();
  t.exp_avg = exp_avg.data_ptr();
  t.exp_avg_sq = exp_avg_sq.data_ptr();
  t.max_exp_avg_sq = s.amsgrad ? ptr_or_null(max_exp_avg_sq) : nullptr;
  t.n = param.numel();
  run(param, t, dt, s);
}

namespace {

// Whether the multi-tensor CUDA launch takes these tensors: all on params[0]'s CUDA device, in
// its dtype (else one update per tensor, each on its own device).
bool multi_cuda(const std::vector<at::Tensor>& params) {
  if (params.empty() || !params[0].is_cuda()) return false;
  for (const at::Tensor& p : params) {
    if (p.device() != params[0].device() || p.scalar_type() != params[0].scalar_type()) {
      return false;
    }
  }
  return true;
}

}  // namespace

void sgd_update_multi(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& bufs,
                      const std::vector<kernels::SgdScalars>& s) {
  TORCH_INTERNAL_ASSERT(grads.size() == params.size() && bufs.size() == params.size() &&
                        s.size() == params.size());
  if (!multi_cuda(params)) {
    for (size_t i = 0; i < params.size(); ++i) sgd_update(params[i], grads[i], bufs[i], s[i]);
    return;
  }
  TORCH_CHECK(kWithCuda, "ddpx was built without CUDA support; rebuild with a CUDA-enabled torch");
#ifdef DDPX_WITH_CUDA
  const kernels::DType dt = check_like(params[0], params[0], "param");
  std::vector<kernels::SgdTensor> ts(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    check_like(params[i], params[i], "param");
    check_like(params[i], grads[i], "grad");
    if (s[i].momentum != 0) check_like(params[i], bufs[i], "momentum_buffer");
    ts[i].param = params[i].data_ptr();
    ts[i].grad = grads[i].data_ptr();
    ts[i].buf = s[i].momentum != 0 ? bufs[i].data_ptr() : nullptr;
    ts[i].n = params[i].numel();
  }
  const CudaLaunch launch(params[0]);
  kernels::sgd_cuda_multi(ts.data(), s.data(), static_cast<int64_t>(ts.size()), dt,
                          launch.stream());
#endif
}

void adam_update_multi(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs,
                       const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& max_exp_avg_sqs,
                       const std::vector<kernels::AdamScalars>& s) {
  TORCH_INTERNAL_ASSERT(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                        exp_avg_sqs.size() == params.size() &&
                        max_exp_avg_sqs.size() == params.size() && s.size() == params.size());
  if (!multi_cuda(params)) {
    for (size_t i = 0; i < params.size(); ++i) {
      adam_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], s[i]);
    }
    return;
  }
  TORCH_CHECK(kWithCuda, "ddpx was built without CUDA support; rebuild with a CUDA-enabled torch");
#ifdef DDPX_WITH_CUDA
  const kernels::DType dt = check_like(params[0], params[0], "param");
  std::vector<kernels::AdamTensor> ts(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    check_like(params[i], params[i], "param");
    check_like(params[i], grads[i], "grad");
    check_like(params[i], exp_avgs[i], "exp_avg");
    check_like(params[i], exp_avg_sqs[i], "exp_avg_sq");
    if (s[i].amsgrad) check_like(params[i], max_exp_avg_sqs[i], "max_exp_avg_sq");
    ts[i].param = params[i].data_ptr();
    ts[i].grad = grads[i].data_ptr();
    ts[i].exp_avg = exp_avgs[i].data_ptr();
    ts[i].exp_avg_sq = exp_avg_sqs[i].data_ptr();
    ts[i].max_exp_avg_sq = s[i].amsgrad ? ptr_or_null(max_exp_avg_sqs[i]) : nullptr;
    ts[i].n = params[i].numel();
  }
  const CudaLaunch launch(params[0]);
  kernels::adam_cuda_multi(ts.data(), s.data(), static_cast<int64_t>(ts.size()), dt,
                           launch.stream());
#endif
}

}  // namespace ops
}  // namespace ddpx
