// Torch-free CPU kernels for PowerSGD's three products with a tall, skinny factor (r small):
// P = M Q, Q = M^T P and M = P Q^T, each reading or writing the n x m matrix M exactly once.
// A general GEMM library handles these shapes poorly (a generic BLAS runs M^T P far below the
// memory bound), while the products are memory-bound: one pass over M is the floor.
#pragma once

#include <cstdint>

namespace ddpx {
namespace kernels {

// All matrices row-major and contiguous: M is n x m, P is n x r, Q is m x r.
// P = M Q.
void lowrank_project_cpu(const float* M, int64_t n, int64_t m, const float* Q, int64_t r, float* P);
void lowrank_project_cpu(const double* M, int64_t n, int64_t m, const double* Q, int64_t r,
                         double* P);
// M += err; err = M; then P = M Q, in one pass over M and err: PowerSGD's error feedback
// (error_feedback_apply_cpu's values) fused into the projection.
void lowrank_compensate_project_cpu(float* M, float* err, int64_t n, int64_t m, const float* Q,
                                    int64_t r, float* P);
void lowrank_compensate_project_cpu(double* M, double* err, int64_t n, int64_t m, const double* Q,
                                    int64_t r, double* P);
// Q = M^T P.
void lowrank_project_t_cpu(const float* M, int64_t n, int64_t m, const float* P, int64_t r,
                           float* Q);
void lowrank_project_t_cpu(const double* M, int64_t n, int64_t m, const double* P, int64_t r,
                           double* Q);
// M = P Q^T; then, unless err is null, err -= M in the same pass (PowerSGD's new residual:
// the compensated gradient minus its approximation), n x m like M.
void lowrank_reconstruct_cpu(const float* P, const float* Q, int64_t n, int64_t m, int64_t r,
                             float* M, float* err = nullptr);
void lowrank_reconstruct_cpu(const double* P, const double* Q, int64_t n, int64_t m, int64_t r,
                             double* M, double* err = nullptr);

// err[i] += in[i]; in[i] = err[i]: PowerSGD's error-feedback application in one pass (two reads,
// two writes; as separate add and copy it is three reads and two writes).
void error_feedback_apply_cpu(float* in, float* err, int64_t n);
void error_feedback_apply_cpu(double* in, double* err, int64_t n);

}  // namespace kernels
}  // namespace ddpx
