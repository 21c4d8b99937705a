// Skinny products for PowerSGD on the CPU. Q is transposed once into an r x m scratch so that
// every inner loop runs over a contiguous row of M; the loops are written for the compiler's
// vectoriser (`omp simd` reductions, compiled with -fopenmp-simd), and each kernel is cloned for
// AVX2+FMA with a baseline fallback chosen at load time.
#include <cstddef>
#include <vector>

#include "lowrank.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DDPX_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define DDPX_CLONES
#endif

namespace ddpx {
namespace kernels {
namespace {

template <typename T>
std::vector<T> transpose(const T* a, int64_t rows, int64_t cols) {
  std::vector<T> t(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  }
  return t;
}

// P[i, c] = sum_j M[i, j] * Qt[c, j]
template <typename T>
inline void project(const T* M, int64_t n, int64_t m, const T* Q, int64_t r, T* P) {
  const std::vector<T> qt = transpose(Q, m, r);
  for (int64_t i = 0; i < n; ++i) {
    const T* row = M + i * m;
    for (int64_t c = 0; c < r; ++c) {
      const T* qc = qt.data() + c * m;
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < m; ++j) acc += row[j] * qc[j];
      P[i * r + c] = acc;
    }
  }
}

// Qt[c, :] += P[i, c] * M[i, :] over rows i, then Q = Qt^T.
template <typename T>
inline void project_t(const T* M, int64_t n, int64_t m, const T* P, int64_t r, T* Q) {
  std::vector<T> qt(static_cast<size_t>(r * m), T(0));
  for (int64_t i = 0; i < n; ++i) {
    const T* row = M + i * m;
    for (int64_t c = 0; c < r; ++c) {
      const T p = P[i * r + c];
      T* qc = qt.data() + c * m;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) qc[j] += p * row[j];
    }
  }
  for (int64_t c = 0; c < r; ++c) {
    for (int64_t j = 0; j < m; ++j) Q[j * r + c] = qt[c * m + j];
  }
}

// M[i, :] = sum_c P[i, c] * Qt[c, :]
template <typename T>
inline void reconstruct(const T* P, const T* Q, int64_t n, int64_t m, int64_t r, T* M) {
  const std::vector<T> qt = transpose(Q, m, r);
  for (int64_t i = 0; i < n; ++i) {
    T* row = M + i * m;
    const T p0 = P[i * r];
    const T* q0 = qt.data();
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) row[j] = p0 * q0[j];
    for (int64_t c = 1; c < r; ++c) {
      const T p = P[i * r + c];
      const T* qc = qt.data() + c * m;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) row[j] += p * qc[j];
    }
  }
}

template <typename T>
inline void ef_apply(T* in, T* err, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T v = err[i] + in[i];
    err[i] = v;
    in[i] = v;
  }
}

}  // namespace

DDPX_CLONES void error_feedback_apply_cpu(float* in, float* err, int64_t n) {
  ef_apply(in, err, n);
}
DDPX_CLONES void error_feedback_apply_cpu(double* in, double* err, int64_t n) {
  ef_apply(in, err, n);
}

DDPX_CLONES void lowrank_project_cpu(const float* M, int64_t n, int64_t m, const float* Q,
                                     int64_t r, float* P) {
  project(M, n, m, Q, r, P);
}
DDPX_CLONES void lowrank_project_cpu(const double* M, int64_t n, int64_t m, const double* Q,
                                     int64_t r, double* P) {
  project(M, n, m, Q, r, P);
}
DDPX_CLONES void lowrank_project_t_cpu(const float* M, int64_t n, int64_t m, const float* P,
                                       int64_t r, float* Q) {
  project_t(M, n, m, P, r, Q);
}
DDPX_CLONES void lowrank_project_t_cpu(const double* M, int64_t n, int64_t m, const double* P,
                                       int64_t r, double* Q) {
  project_t(M, n, m, P, r, Q);
}
DDPX_CLONES void lowrank_reconstruct_cpu(const float* P, const float* Q, int64_t n, int64_t m,
                                         int64_t r, float* M) {
  reconstruct(P, Q, n, m, r, M);
}
DDPX_CLONES void lowrank_reconstruct_cpu(const double* P, const double* Q, int64_t n, int64_t m,
                                         int64_t r, double* M) {
  reconstruct(P, Q, n, m, r, M);
}

}  // namespace kernels
}  // namespace ddpx
