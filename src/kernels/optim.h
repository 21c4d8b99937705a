// Torch-free kernels of the functional optimizers SGD, Adam and AdamW (the elementwise
// optimizers' are elementwise_optim.h): one
// tensor's fused update over raw pointers, elements [begin, end), on the calling thread. The
// ATen layer (ops/optim.h) splits a tensor across threads and picks the CPU or CUDA variant
// (optim_cuda.h) by device.
//
// Every element is updated by the function in optim_inl.h, shared with the CUDA kernels, which
// follows torch.optim's single-tensor implementation operation by operation (see there), so
// results match torch's CPU optimizers bit for bit where torch's own ops are IEEE-rounded.
#pragma once

#include <cstdint>

#include "cast.h"  // DType

namespace ddpx {
namespace kernels {

// Hyper-parameters of one SGD update, as torch's Python code holds them (double); the kernels
// round them to the element type as ATen does.
struct SgdScalars {
  double lr = 0;
  double momentum = 0;  // 0: no momentum buffer is read or written
  double dampening = 0;
  double weight_decay = 0;  // L2 penalty added to the gradient
  bool nesterov = false;
  bool maximize = false;
  bool init_buffer = false;  // first step: buffer = gradient (torch's clone), no dampening
};

// One tensor of an SGD update: n elements each, contiguous, of one dtype. `buf` may be null when
// momentum == 0. `param` and `buf` are updated in place; `grad` is only read.
struct SgdTensor {
  void* param = nullptr;
  const void* grad = nullptr;
  void* buf = nullptr;
  int64_t n = 0;
};

// Which torch's Adam the update reproduces (the formulas differ, see optim_inl.h).
enum class AdamFormula : int { kTorch1 = 1, kTorch2 = 2 };

// Hyper-parameters of one Adam/AdamW update of one tensor, with the bias corrections of its step
// already computed in double as torch's Python code computes them.
struct AdamScalars {
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;  // AdamW: param *= 1 - lr * weight_decay
  AdamFormula formula = AdamFormula::kTorch2;
  double step_size = 0;              // lr / (1 - beta1 ** step)
  double bias_correction2_sqrt = 0;  // sqrt(1 - beta2 ** step)
};

// One tensor of an Adam update: n contiguous elements each, one dtype. `max_exp_avg_sq` is read
// and written only with amsgrad (may be null otherwise).
struct AdamTensor {
  void* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;
  int64_t n = 0;
};

// Updates elements [begin, end) of `t` (0 <= begin <= end <= t.n). float32 and float64 only
// (std::invalid_argument otherwise). Disjoint ranges may run concurrently on several threads.
void sgd_cpu(const SgdTensor& t, DType dtype, const SgdScalars& s, int64_t begin, int64_t end);
void adam_cpu(const AdamTensor& t, DType dtype, const AdamScalars& s, int64_t begin, int64_t end);

// True when the CPU kernels run their AVX2/FMA build on this machine (else a portable build
// with the same results: fma is fma either way, only slower).
bool optim_cpu_has_fma();

}  // namespace kernels
}  // namespace ddpx
