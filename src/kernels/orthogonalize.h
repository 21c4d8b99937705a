// Torch-free batched Gram-Schmidt for PowerSGD: many small row-major n x r matrices, stored back
// to back in one buffer, orthonormalised column by column in one call (one launch on CUDA).
#pragma once

#include <cstdint>

namespace ddpx {
namespace kernels {

// Matrix k occupies data[offsets[k] : offsets[k] + rows[k] * cols[k]], row-major, cols[k] <=
// rows[k]. For each column i in order: col_i /= (||col_i|| + epsilon), then every later column c
// loses its projection on col_i (modified Gram-Schmidt, the order torch's
// _orthogonalize_gram_schmidt uses). Matrices with more than 2 columns get a second pass
// (reorthogonalisation, epsilon 0), which keeps them orthonormal to rounding where one pass would
// not (torch uses QR there). Norms and dot products accumulate in double. A column whose norm is 0
// while epsilon == 0 is set to zeros (torch divides by zero and spreads NaN; its own log message
// says zeros were meant). A column too small for its reciprocal norm to fit the dtype (float
// denormals) is divided by its norm in double instead: it comes out unit-norm and finite, never
// inf/NaN.
void orthogonalize_cpu(float* data, const int64_t* offsets, const int64_t* rows,
                       const int64_t* cols, int64_t count, float epsilon);
void orthogonalize_cpu(double* data, const int64_t* offsets, const int64_t* rows,
                       const int64_t* cols, int64_t count, double epsilon);

}  // namespace kernels
}  // namespace ddpx
