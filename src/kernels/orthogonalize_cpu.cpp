#include <cmath>

#include "orthogonalize.h"

namespace ddpx {
namespace kernels {
namespace {

template <typename T>
void gram_schmidt(T* m, int64_t n, int64_t r, double eps) {
  for (int64_t i = 0; i < r; ++i) {
    double sq = 0;
    for (int64_t j = 0; j < n; ++j) sq += double(m[j * r + i]) * double(m[j * r + i]);
    const double norm = std::sqrt(sq);
    if (norm == 0.0 && eps == 0.0) {
      for (int64_t j = 0; j < n; ++j) m[j * r + i] = T(0);
      continue;
    }
    const double denom = norm + eps;
    const T inv = T(1.0 / denom);
    if (std::isfinite(inv)) {
      for (int64_t j = 0; j < n; ++j) m[j * r + i] *= inv;  // torch's arithmetic: m * (1/norm)
    } else {
      // A tiny float column (0 < norm < ~2.9e-39, denormal entries): 1/norm overflows float, and
      // scaling by it would turn the column into inf/NaN. Divide in double instead. (In double
      // the squared norm underflows to 0 first: such a column is a zero column above.)
      for (int64_t j = 0; j < n; ++j) m[j * r + i] = T(double(m[j * r + i]) / denom);
    }
    for (int64_t c = i + 1; c < r; ++c) {
      double dot = 0;
      for (int64_t j = 0; j < n; ++j) dot += double(m[j * r + i]) * double(m[j * r + c]);
      const T d = T(dot);
      for (int64_t j = 0; j < n; ++j) m[j * r + c] -= d * m[j * r + i];
    }
  }
}

template <typename T>
void run(T* data, const int64_t* offsets, const int64_t* rows, const int64_t* cols, int64_t count,
         double eps) {
  for (int64_t k = 0; k < count; ++k) {
    gram_schmidt(data + offsets[k], rows[k], cols[k], eps);
    // Above rank 2 a second pass ("twice is enough") restores orthogonality that one pass loses
    // on ill-conditioned matrices, where torch switches to QR. Ranks 1-2 keep torch's single
    // pass, and its exact arithmetic.
    if (cols[k] > 2) gram_schmidt(data + offsets[k], rows[k], cols[k], 0.0);
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
