#include <algorithm>
#include <cmath>
#include <vector>

#include "orthogonalize.h"

namespace ddpx {
namespace kernels {
namespace {

// Step i's first sweep: normalises column i and sums its dot products with the `later` columns
// after it into dots[]. L > 0: `later` known at compile time (short rows: no loop overhead).
template <int L, typename T>
inline __attribute__((always_inline)) void normalise_and_dot(T* m, int64_t n, int64_t r, int64_t i,
                                                             int64_t later, bool zero, bool divide,
                                                             T inv, double denom, double* dots) {
  if (L > 0) later = L;
  std::fill(dots, dots + later, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    T* row = m + j * r;
    // torch's arithmetic: m * (1/norm); a zero column becomes zeros.
    row[i] = zero ? T(0) : divide ? T(double(row[i]) / denom) : T(row[i] * inv);
    const double mi = double(row[i]);
    const T* rest = row + i + 1;
    for (int64_t c = 0; c < later; ++c) dots[c] += mi * double(rest[c]);
  }
}

// Step i's second sweep: takes the projections coef[c] * column i off the later columns and
// returns the squared norm of column i + 1 (the next step's).
template <int L, typename T>
inline __attribute__((always_inline)) double project_out(T* m, int64_t n, int64_t r, int64_t i,
                                                         int64_t later, const T* coef) {
  if (L > 0) later = L;
  double sq = 0;
  for (int64_t j = 0; j < n; ++j) {
    T* row = m + j * r;
    const T mi = row[i];
    T* rest = row + i + 1;
    for (int64_t c = 0; c < later; ++c) rest[c] -= coef[c] * mi;
    sq += double(rest[0]) * double(rest[0]);
  }
  return sq;
}

// Step i's two sweeps for `later` > 0 columns after column i; returns column i + 1's squared
// norm. L: `later` at compile time (1-3: short rows without loop overhead) or 0 (at run time).
template <int L, typename T>
inline __attribute__((always_inline)) double sweep_step(T* m, int64_t n, int64_t r, int64_t i,
                                                        int64_t later, bool zero, bool divide,
                                                        T inv, double denom, double* dots,
                                                        T* coef) {
  normalise_and_dot<L>(m, n, r, i, later, zero, divide, inv, denom, dots);
  for (int64_t c = 0; c < later; ++c) coef[c] = zero ? T(0) : T(dots[c]);
  return project_out<L>(m, n, r, i, later, coef);
}

// Modified Gram-Schmidt on one row-major n x r matrix. After column i is normalised, its dot
// products with every later column are taken in one sweep over the rows (each row's later
// columns are contiguous: the inner loop vectorises), and the projections are taken off in a
// second sweep, which also sums the next column's squared norm. `dots` and `coef` hold r values.
// Each sum still runs over the rows in order, and column c's dot does not depend on the other
// columns' updates of the same step, so the results are those of the column-by-column loop, bit
// for bit, at two sweeps per column instead of O(r) of them.
template <typename T>
inline __attribute__((always_inline)) void gram_schmidt_body(T* m, int64_t n, int64_t r, double eps,
                                                             double* dots, T* coef) {
  double sq = 0;  // squared norm of column i, summed by the previous step's second sweep
  for (int64_t j = 0; j < n && r > 0; ++j) sq += double(m[j * r]) * double(m[j * r]);
  for (int64_t i = 0; i < r; ++i) {
    const double norm = std::sqrt(sq);
    const bool zero = norm == 0.0 && eps == 0.0;
    const double denom = norm + eps;
    const T inv = zero ? T(0) : T(1.0 / denom);
    // A tiny float column (0 < norm < ~2.9e-39, denormal entries): 1/norm overflows float, and
    // scaling by it would turn the column into inf/NaN. Divide in double instead. (In double
    // the squared norm underflows to 0 first: such a column is a zero column.)
    const bool divide = !std::isfinite(inv);
    const int64_t later = r - i - 1;
    if (later == 0) {
      normalise_and_dot<0>(m, n, r, i, 0, zero, divide, inv, denom, dots);
      return;
    }
    switch (later) {
      case 1:
        sq = sweep_step<1>(m, n, r, i, later, zero, divide, inv, denom, dots, coef);
        break;
      case 2:
        sq = sweep_step<2>(m, n, r, i, later, zero, divide, inv, denom, dots, coef);
        break;
      case 3:
        sq = sweep_step<3>(m, n, r, i, later, zero, divide, inv, denom, dots, coef);
        break;
      default:
        sq = sweep_step<0>(m, n, r, i, later, zero, divide, inv, denom, dots, coef);
    }
  }
}

// The same code compiled for AVX2 (4 doubles per vector instead of SSE2's 2), where the CPU has
// it. Not FMA: without contraction both builds round every operation alike, bit for bit.
template <typename T>
__attribute__((target("avx2"))) void gram_schmidt_avx2(T* m, int64_t n, int64_t r, double eps,
                                                       double* dots, T* coef) {
  gram_schmidt_body(m, n, r, eps, dots, coef);
}

template <typename T>
void gram_schmidt_generic(T* m, int64_t n, int64_t r, double eps, double* dots, T* coef) {
  gram_schmidt_body(m, n, r, eps, dots, coef);
}

template <typename T>
void gram_schmidt(T* m, int64_t n, int64_t r, double eps, double* dots, T* coef) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    gram_schmidt_avx2(m, n, r, eps, dots, coef);
  } else {
    gram_schmidt_generic(m, n, r, eps, dots, coef);
  }
}

template <typename T>
void run(T* data, const int64_t* offsets, const int64_t* rows, const int64_t* cols, int64_t count,
         double eps) {
  int64_t widest = 0;
  for (int64_t k = 0; k < count; ++k) widest = std::max(widest, cols[k]);
  std::vector<double> dots(static_cast<size_t>(widest));
  std::vector<T> coef(static_cast<size_t>(widest));
  for (int64_t k = 0; k < count; ++k) {
    gram_schmidt(data + offsets[k], rows[k], cols[k], eps, dots.data(), coef.data());
    // Above rank 2 a second pass ("twice is enough") restores orthogonality that one pass loses
    // on ill-conditioned matrices, where torch switches to QR. Ranks 1-2 keep torch's single
    // pass, and its exact arithmetic.
    if (cols[k] > 2)
      gram_schmidt(data + offsets[k], rows[k], cols[k], 0.0, dots.data(), coef.data());
  }
}

}  // namespace

void orthogonalize_cpu(float* data, const int64_t* offsets, const int64_t* rows,
                       const int64_t* cols, int64_t count, float epsilon) {
  run(data, offsets, rows, cols, count, epsilon);
}

void orthogonalize_cpu(double* data, const int64_t* offsets, const int64_t* rows,
                       const int64_t* cols, int64_t count, double epsilon) {
  run(data, offsets, rows, cols, count, epsilon);
}

}  // namespace kernels
}  // namespace ddpx
