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

// P[i, c] = sum_j M[i, j] * Qt[c, j], four columns of P per sweep over a row: the row is loaded
// once for four products (L1 loads, not FLOPs, bound these loops). With `err`, the row is first
// compensated in the same sweep (M += err; err = M: PowerSGD's error feedback, the same values as
// ef_apply), so M is read from memory once for both.
template <typename T>
inline void project(T* M, int64_t n, int64_t m, const T* Q, int64_t r, T* P, T* err) {
  const std::vector<T> qt = transpose(Q, m, r);
  for (int64_t i = 0; i < n; ++i) {
    T* row = M + i * m;
    int64_t c = 0;
    if (err != nullptr) {
      T* e = err + i * m;
      if (r >= 4) {
        const T *q0 = qt.data(), *q1 = q0 + m, *q2 = q1 + m, *q3 = q2 + m;
        T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t j = 0; j < m; ++j) {
          const T x = e[j] + row[j];
          e[j] = x;
          row[j] = x;
          a0 += x * q0[j];
          a1 += x * q1[j];
          a2 += x * q2[j];
          a3 += x * q3[j];
        }
        P[i * r] = a0;
        P[i * r + 1] = a1;
        P[i * r + 2] = a2;
        P[i * r + 3] = a3;
        c = 4;
      } else {
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) {
          const T x = e[j] + row[j];
          e[j] = x;
          row[j] = x;
        }
      }
    }
    for (; c + 4 <= r; c += 4) {
      const T* q0 = qt.data() + c * m;
      const T *q1 = q0 + m, *q2 = q1 + m, *q3 = q2 + m;
      T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t j = 0; j < m; ++j) {
        const T x = row[j];
        a0 += x * q0[j];
        a1 += x * q1[j];
        a2 += x * q2[j];
        a3 += x * q3[j];
      }
      P[i * r + c] = a0;
      P[i * r + c + 1] = a1;
      P[i * r + c + 2] = a2;
      P[i * r + c + 3] = a3;
    }
    for (; c < r; ++c) {
      const T* qc = qt.data() + c * m;
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < m; ++j) acc += row[j] * qc[j];
      P[i * r + c] = acc;
    }
  }
}

// Qt[c, :] += P[i, c] * M[i, :] over rows i, then Q = Qt^T. Four columns of Qt per sweep, over
// two rows at once where there are two (half the loads and stores of Qt per product); each Qt
// element still accumulates the rows in order i = 0, 1, ..., so the result does not depend on
// the blocking.
template <typename T>
inline void project_t(const T* M, int64_t n, int64_t m, const T* P, int64_t r, T* Q) {
  std::vector<T> qt(static_cast<size_t>(r * m), T(0));
  int64_t i = 0;
  for (; r >= 4 && i + 2 <= n; i += 2) {
    const T* x0 = M + i * m;
    const T* x1 = x0 + m;
    const T* pa = P + i * r;
    const T* pb = pa + r;
    int64_t c = 0;
    for (; c + 4 <= r; c += 4) {
      const T a0 = pa[c], a1 = pa[c + 1], a2 = pa[c + 2], a3 = pa[c + 3];
      const T b0 = pb[c], b1 = pb[c + 1], b2 = pb[c + 2], b3 = pb[c + 3];
      T* q0 = qt.data() + c * m;
      T *q1 = q0 + m, *q2 = q1 + m, *q3 = q2 + m;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) {
        const T u = x0[j], v = x1[j];
        T t0 = q0[j], t1 = q1[j], t2 = q2[j], t3 = q3[j];
        t0 += a0 * u;
        t1 += a1 * u;
        t2 += a2 * u;
        t3 += a3 * u;
        t0 += b0 * v;
        t1 += b1 * v;
        t2 += b2 * v;
        t3 += b3 * v;
        q0[j] = t0;
        q1[j] = t1;
        q2[j] = t2;
        q3[j] = t3;
      }
    }
    for (; c < r; ++c) {
      T* qc = qt.data() + c * m;
      const T a = pa[c], b = pb[c];
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) {
        T t = qc[j];
        t += a * x0[j];
        t += b * x1[j];
        qc[j] = t;
      }
    }
  }
  for (; i < n; ++i) {
    const T* row = M + i * m;
    int64_t c = 0;
    for (; c + 4 <= r; c += 4) {
      const T p0 = P[i * r + c], p1 = P[i * r + c + 1], p2 = P[i * r + c + 2],
              p3 = P[i * r + c + 3];
      T* q0 = qt.data() + c * m;
      T *q1 = q0 + m, *q2 = q1 + m, *q3 = q2 + m;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) {
        const T x = row[j];
        q0[j] += p0 * x;
        q1[j] += p1 * x;
        q2[j] += p2 * x;
        q3[j] += p3 * x;
      }
    }
    for (; c < r; ++c) {
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

// M[i, :] = sum_c P[i, c] * Qt[c, :], summed in order c = 0, 1, ... in a register per element
// (the same operations as accumulating each column into the row in turn, one store instead of
// r). With `err`, the residual is taken in the same sweep: err -= M (the row is still in
// registers), the same values as a separate subtraction afterwards.
template <typename T>
inline void reconstruct(const T* P, const T* Q, int64_t n, int64_t m, int64_t r, T* M, T* err) {
  const std::vector<T> qt = transpose(Q, m, r);
  const T* q0 = qt.data();
  for (int64_t i = 0; i < n; ++i) {
    T* row = M + i * m;
    const T* p = P + i * r;
    if (r == 4) {  // the default rank of torch's examples, unrolled
      const T *q1 = q0 + m, *q2 = q1 + m, *q3 = q2 + m;
      const T p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) {
        T acc = p0 * q0[j];
        acc += p1 * q1[j];
        acc += p2 * q2[j];
        acc += p3 * q3[j];
        row[j] = acc;
      }
    } else {
      const T p0 = p[0];
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) row[j] = p0 * q0[j];
      for (int64_t c = 1; c < r; ++c) {
        const T pc = p[c];
        const T* qc = q0 + c * m;
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) row[j] += pc * qc[j];
      }
    }
    if (err != nullptr) {
      T* e = err + i * m;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) e[j] -= row[j];
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
  project(const_cast<float*>(M), n, m, Q, r, P, static_cast<float*>(nullptr));  // M not written
}
DDPX_CLONES void lowrank_project_cpu(const double* M, int64_t n, int64_t m, const double* Q,
                                     int64_t r, double* P) {
  project(const_cast<double*>(M), n, m, Q, r, P, static_cast<double*>(nullptr));
}
DDPX_CLONES void lowrank_compensate_project_cpu(float* M, float* err, int64_t n, int64_t m,
                                                const float* Q, int64_t r, float* P) {
  project(M, n, m, Q, r, P, err);
}
DDPX_CLONES void lowrank_compensate_project_cpu(double* M, double* err, int64_t n, int64_t m,
                                                const double* Q, int64_t r, double* P) {
  project(M, n, m, Q, r, P, err);
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
                                         int64_t r, float* M, float* err) {
  reconstruct(P, Q, n, m, r, M, err);
}
DDPX_CLONES void lowrank_reconstruct_cpu(const double* P, const double* Q, int64_t n, int64_t m,
                                         int64_t r, double* M, double* err) {
  reconstruct(P, Q, n, m, r, M, err);
}

}  // namespace kernels
}  // namespace ddpx
