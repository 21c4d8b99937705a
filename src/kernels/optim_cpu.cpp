// CPU kernels of the functional optimizers: one pass over each tensor's memory (read param,
// grad and state; write param and state), with the element updates of optim_inl.h.
//
// The loops are built twice: for AVX2+FMA (chosen once at run time when the CPU has them),
// where fmaf and sqrtf become vector instructions, and portably, where fma is a libm call. Both
// give the same results. This file is compiled with -fno-math-errno -fno-trapping-math so the
// loops vectorise (CMakeLists.txt).
#include <stdexcept>
#include <string>

#include "optim.h"
#include "optim_inl.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define DDPX_OPTIM_X86 1
#endif

namespace ddpx {
namespace kernels {
namespace {

[[noreturn]] void bad_dtype(DType t, const char* op) {
  throw std::invalid_argument(std::string("ddpx ") + op + ": unsupported dtype " + dtype_name(t) +
                              " (float32 and float64 only)");
}

// The loops, specialised on the flags that change the memory touched so each variant is a
// straight vectorisable loop (the remaining flags are loop-invariant branches the compiler
// unswitches).
template <typename T>
DDPX_OPTIM_INLINE void sgd_loop(T* __restrict p, const T* __restrict g, T* __restrict b,
                                const detail::SgdCoeffs<T>& coeffs, int64_t begin, int64_t end) {
  const detail::SgdCoeffs<T> c = coeffs;  // a local copy: stores through p cannot alias it
  if (c.has_momentum) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      T pi = p[i];
      T bi = c.init_buffer ? T(0) : b[i];
      detail::sgd_element(pi, g[i], bi, c);
      p[i] = pi;
      b[i] = bi;
    }
  } else {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      T pi = p[i];
      T unused = T(0);
      detail::sgd_element(pi, g[i], unused, c);
      p[i] = pi;
    }
  }
}

template <typename T>
DDPX_OPTIM_INLINE void adam_loop(T* __restrict p, const T* __restrict g, T* __restrict m,
                                 T* __restrict v, T* __restrict vmax,
                                 const detail::AdamCoeffs<T>& coeffs, int64_t begin, int64_t end) {
  const detail::AdamCoeffs<T> c = coeffs;  // a local copy: stores through p cannot alias it
  // Values go through locals, loaded and stored unconditionally, so the element function's
  // branches become selects and the loop vectorises.
  if (c.amsgrad != T(0)) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      T pi = p[i], mi = m[i], vi = v[i], vmaxi = vmax[i];
      detail::adam_element(pi, g[i], mi, vi, vmaxi, c);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      vmax[i] = vmaxi;
    }
  } else {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      T pi = p[i], mi = m[i], vi = v[i], unused = T(0);
      detail::adam_element(pi, g[i], mi, vi, unused, c);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
    }
  }
}

template <typename T>
DDPX_OPTIM_INLINE void sgd_typed(const SgdTensor& t, const SgdScalars& s, int64_t begin,
                                 int64_t end) {
  sgd_loop<T>(static_cast<T*>(t.param), static_cast<const T*>(t.grad), static_cast<T*>(t.buf),
              detail::sgd_coeffs<T>(s), begin, end);
}

template <typename T>
DDPX_OPTIM_INLINE void adam_typed(const AdamTensor& t, const AdamScalars& s, int64_t begin,
                                  int64_t end) {
  adam_loop<T>(static_cast<T*>(t.param), static_cast<const T*>(t.grad), static_cast<T*>(t.exp_avg),
               static_cast<T*>(t.exp_avg_sq), static_cast<T*>(t.max_exp_avg_sq),
               detail::adam_coeffs<T>(s), begin, end);
}

// One build of the loops; the AVX2 build differs only in its target attribute.
#define DDPX_OPTIM_DEFINE(suffix, attr)                                                          \
  attr void sgd_f32_##suffix(const SgdTensor& t, const SgdScalars& s, int64_t b, int64_t e) {    \
    sgd_typed<float>(t, s, b, e);                                                                \
  }                                                                                              \
  attr void sgd_f64_##suffix(const SgdTensor& t, const SgdScalars& s, int64_t b, int64_t e) {    \
    sgd_typed<double>(t, s, b, e);                                                               \
  }                                                                                              \
  attr void adam_f32_##suffix(const AdamTensor& t, const AdamScalars& s, int64_t b, int64_t e) { \
    adam_typed<float>(t, s, b, e);                                                               \
  }                                                                                              \
  attr void adam_f64_##suffix(const AdamTensor& t, const AdamScalars& s, int64_t b, int64_t e) { \
    adam_typed<double>(t, s, b, e);                                                              \
  }

DDPX_OPTIM_DEFINE(portable, )
#ifdef DDPX_OPTIM_X86
DDPX_OPTIM_DEFINE(avx2, __attribute__((target("avx2,fma"))))
#endif

using SgdFn = void (*)(const SgdTensor&, const SgdScalars&, int64_t, int64_t);
using AdamFn = void (*)(const AdamTensor&, const AdamScalars&, int64_t, int64_t);

struct OptimOps {
  SgdFn sgd_f32 = sgd_f32_portable;
  SgdFn sgd_f64 = sgd_f64_portable;
  AdamFn adam_f32 = adam_f32_portable;
  AdamFn adam_f64 = adam_f64_portable;
  bool fma = false;
  OptimOps() {
#ifdef DDPX_OPTIM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      sgd_f32 = sgd_f32_avx2;
      sgd_f64 = sgd_f64_avx2;
      adam_f32 = adam_f32_avx2;
      adam_f64 = adam_f64_avx2;
      fma = true;
    }
#endif
  }
};

const OptimOps& optim_ops() {
  static const OptimOps ops;
  return ops;
}

void check_range(int64_t n, int64_t begin, int64_t end, const char* op) {
  if (begin < 0 || begin > end || end > n) {
    throw std::invalid_argument(std::string("ddpx ") + op + ": range [" + std::to_string(begin) +
                                ", " + std::to_string(end) + ") outside [0, " + std::to_string(n) +
                                ")");
  }
}

}  // namespace

void sgd_cpu(const SgdTensor& t, DType dtype, const SgdScalars& s, int64_t begin, int64_t end) {
  check_range(t.n, begin, end, "sgd_cpu");
  if (begin == end) return;  // as the CUDA entry points: no element, no state needed
  if (s.momentum != 0 && t.buf == nullptr) {
    throw std::invalid_argument("ddpx sgd_cpu: momentum needs a buffer");
  }
  switch (dtype) {
    case DType::kFloat32:
      return optim_ops().sgd_f32(t, s, begin, end);
    case DType::kFloat64:
      return optim_ops().sgd_f64(t, s, begin, end);
    default:
      bad_dtype(dtype, "sgd_cpu");
  }
}

void adam_cpu(const AdamTensor& t, DType dtype, const AdamScalars& s, int64_t begin, int64_t end) {
  check_range(t.n, begin, end, "adam_cpu");
  if (begin == end) return;  // as the CUDA entry points: no element, no state needed
  if (s.amsgrad && t.max_exp_avg_sq == nullptr) {
    throw std::invalid_argument("ddpx adam_cpu: amsgrad needs max_exp_avg_sq");
  }
  switch (dtype) {
    case DType::kFloat32:
      return optim_ops().adam_f32(t, s, begin, end);
    case DType::kFloat64:
      return optim_ops().adam_f64(t, s, begin, end);
    default:
      bad_dtype(dtype, "adam_cpu");
  }
}

bool optim_cpu_has_fma() { return optim_ops().fma; }

}  // namespace kernels
}  // namespace ddpx
