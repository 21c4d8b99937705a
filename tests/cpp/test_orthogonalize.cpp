// Tests of PowerSGD's compute kernels: the batched Gram-Schmidt (kernels::orthogonalize_cpu /
// orthogonalize_cuda, ddpx::ops::orthogonalize_ over a MatrixPack) and the fused error-feedback
// update (error_feedback_apply_ / error_feedback_apply_cuda).
//
// References: torch's QR (at::linalg_qr, column signs fixed so that R has a positive diagonal,
// which is the factor Gram-Schmidt produces) for epsilon == 0, and torch's own
// _orthogonalize_gram_schmidt (powerSGD_hook.py) written with ATen ops in fp64 for epsilon > 0.
//
// Tolerance: modified Gram-Schmidt loses orthogonality in proportion to the condition number:
// |Q - Q_ref| <= c * u * kappa(A) (Bjorck), u the unit roundoff of the buffer's dtype. Each case
// measures kappa with at::linalg_svdvals and allows kTolFactor * u * kappa * sqrt(r).
//
// The CUDA cases compare the device kernels with the same references and with the CPU kernel (not
// bit for bit: the block reductions sum in another order). They skip when no GPU is visible, and
// report as skipped when ddpx was built without nvcc.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/orthogonalize.h"
#include "ops/lowrank.h"
#include "ops/orthogonalize.h"
#include "tensor_utils.h"

#ifdef DDPX_TEST_CUDA_KERNELS
#include <cuda_runtime_api.h>

#include "cuda_test_utils.h"
#include "kernels/lowrank_cuda.h"
#include "kernels/orthogonalize_cuda.h"
#endif

namespace {

using ddpx_test::bitwise_equal;

namespace k = ddpx::kernels;
using ::testing::HasSubstr;

// Generous constant of the MGS bound: the observed worst ratio |Q - Q_ref| / (u kappa sqrt(r)) is
// printed by MatchesTorchReference (1 to 2 here); 16x is far below anything a wrong kernel
// gives (a missed projection or normalisation is an O(1) error).
constexpr double kTolFactor = 16.0;

template <typename T>
constexpr double unit_roundoff() {
  return std::is_same<T, float>::value ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53);
}

template <typename T>
at::ScalarType scalar_type_of() {
  return std::is_same<T, float>::value ? at::kFloat : at::kDouble;
}

// Written into the gaps between packed matrices: must come out untouched.
template <typename T>
constexpr T kSentinel = T(-777.25);

struct Shape {
  int64_t n, r;
};

// Matrices stored row-major back to back in one buffer, with gaps of sentinels between them.
template <typename T>
struct Pack {
  std::vector<T> data;
  std::vector<int64_t> offsets, rows, cols;
  std::vector<bool> is_gap;  // per element of data
};

// Standard normal entries (never exactly zero in practice), rounded to T.
template <typename T>
Pack<T> make_pack(const std::vector<Shape>& shapes, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> gap(0, 5);
  Pack<T> p;
  for (const auto& s : shapes) {
    for (int g = gap(gen); g > 0; --g) {
      p.data.push_back(kSentinel<T>);
      p.is_gap.push_back(true);
    }
    p.offsets.push_back(static_cast<int64_t>(p.data.size()));
    p.rows.push_back(s.n);
    p.cols.push_back(s.r);
    for (int64_t i = 0; i < s.n * s.r; ++i) {
      double v = normal(gen);
      while (v == 0.0) v = normal(gen);
      p.data.push_back(static_cast<T>(v));
      p.is_gap.push_back(false);
    }
  }
  p.data.push_back(kSentinel<T>);  // trailing guard
  p.is_gap.push_back(true);
  return p;
}

// Matrix k of a pack as an fp64 n x r tensor (a copy).
template <typename T>
at::Tensor matrix_of(const Pack<T>& p, const std::vector<T>& data, size_t k) {
  at::Tensor t = at::empty({p.rows[k], p.cols[k]}, at::kDouble);
  double* d = t.data_ptr<double>();
  for (int64_t i = 0; i < p.rows[k] * p.cols[k]; ++i) d[i] = data[p.offsets[k] + i];
  return t;
}

// Q of torch's QR with the signs of the columns chosen so that diag(R) > 0: the unique
// orthonormal factor that Gram-Schmidt computes for a matrix of full column rank.
at::Tensor qr_reference(const at::Tensor& a) {
  auto qr = at::linalg_qr(a, "reduced");
  at::Tensor q = std::get<0>(qr), r = std::get<1>(qr);
  at::Tensor s = at::sign(r.diagonal());
  s = at::where(s == 0, at::ones_like(s), s);
  return q * s.unsqueeze(0);
}

// torch's _orthogonalize_gram_schmidt (ddp_comm_hooks/powerSGD_hook.py), fp64, epsilon > 0:
//   col /= norm(col) + epsilon; rest -= sum(col * rest, dim=0) * col
at::Tensor torch_gram_schmidt(const at::Tensor& a, double epsilon) {
  at::Tensor m = a.clone();
  const int64_t r = m.size(1);
  for (int64_t i = 0; i < r; ++i) {
    at::Tensor col = m.narrow(1, i, 1);
    col.div_(at::norm(col, 2, {0}, /*keepdim=*/true) + epsilon);
    if (i + 1 < r) {
      at::Tensor rest = m.narrow(1, i + 1, r - i - 1);
      rest.sub_(at::sum(col * rest, {0}, /*keepdim=*/true) * col);
    }
  }
  return m;
}

double condition_number(const at::Tensor& a) {
  at::Tensor s = at::linalg_svdvals(a);
  return s.max().item<double>() / s.min().item<double>();
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// n in [1, 300], r in [1, min(n, 32)], plus the corners.
std::vector<Shape> random_shapes(uint64_t seed, int count) {
  std::vector<Shape> shapes = {{1, 1},   {2, 1},   {2, 2},    {7, 7},   {32, 32},
                               {33, 32}, {300, 1}, {300, 32}, {257, 3}, {256, 16}};
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> nd(1, 300);
  for (int i = 0; i < count; ++i) {
    const int64_t n = nd(gen);
    std::uniform_int_distribution<int64_t> rd(1, std::min<int64_t>(n, 32));
    shapes.push_back({n, rd(gen)});
  }
  return shapes;
}

// Shapes for the tall way: tall matrices (PowerSGD's P of a 4096-row layer at rank 32; row
// counts that are not a multiple of the block's 128 rows) beside a few small ones in the same
// launch (fewer rows than one block has threads).
std::vector<Shape> tall_shapes(uint64_t seed) {
  std::vector<Shape> shapes = {{4096, 32}, {1500, 4}, {1025, 1}, {2000, 2}, {1024, 3},
                               {129, 17},  {3, 3},    {1, 1},    {640, 32}};
  auto small = random_shapes(seed, 10);
  shapes.insert(shapes.end(), small.begin(), small.end());
  return shapes;
}

// What a kernel produced for pack `p` (`out`), checked matrix by matrix against the reference
// for `epsilon`; returns the worst |Q - Q_ref| / (u kappa sqrt(r)).
template <typename T>
double check_against_reference(const Pack<T>& p, const std::vector<T>& out, double epsilon,
                               const std::string& what) {
  const double u = unit_roundoff<T>();
  double worst = 0;
  for (size_t k = 0; k < p.offsets.size(); ++k) {
    const at::Tensor a = matrix_of(p, p.data, k);
    const at::Tensor q = matrix_of(p, out, k);
    // With epsilon, one Gram-Schmidt pass as torch's; above rank 2 the kernel's contract adds a
    // second pass with epsilon 0 (see orthogonalize.h).
    at::Tensor want = epsilon == 0 ? qr_reference(a) : torch_gram_schmidt(a, epsilon);
    if (epsilon != 0 && p.cols[k] > 2) want = torch_gram_schmidt(want, 0.0);
    const double kappa = condition_number(a);
    // Sums of n products (the kernel's and this check's own) round about sqrt(n) times worse:
    // the bounds, set for n <= 300, grow by sqrt(n / 300) for the tall matrices.
    const double length = std::max(1.0, std::sqrt(static_cast<double>(p.rows[k]) / 300.0));
    const double scale = u * kappa * std::sqrt(static_cast<double>(p.cols[k])) * length;
    const double err = max_abs_diff(q, want);
    worst = std::max(worst, err / scale);
    EXPECT_LE(err, kTolFactor * scale)
        << what << ": matrix " << k << " (" << p.rows[k] << " x " << p.cols[k] << ", kappa "
        << kappa << ") differs from the reference by " << err;
    // Orthonormal columns, to the same order. Epsilon shrinks each norm by about epsilon / norm,
    // more than any rounding for a small column, so with epsilon Q^T Q is compared with the
    // reference's own Gram matrix, which has the same shrinkage.
    const at::Tensor gram = at::mm(q.t(), q);
    const double ortho =
        max_abs_diff(gram, epsilon == 0 ? at::eye(p.cols[k], at::kDouble) : at::mm(want.t(), want));
    EXPECT_LE(ortho, 2 * kTolFactor * scale + 1e-7 * (epsilon > 0))
        << what << ": matrix " << k << ": |Q^T Q - I| = " << ortho;
    // Same column space as the input: A - Q Q^T A vanishes (backward stable, kappa-free).
    if (epsilon == 0) {
      const double resid =
          (a - at::mm(q, at::mm(q.t(), a))).norm().item<double>() / a.norm().item<double>();
      EXPECT_LE(resid, kTolFactor * scale) << what << ": matrix " << k << " spans another space";
    }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (p.is_gap[i]) {
      EXPECT_EQ(std::memcmp(&out[i], &kSentinel<T>, sizeof(T)), 0)
          << what << ": element " << i << " between matrices was written";
    }
  }
  return worst;
}

template <typename T>
void run_cpu(Pack<T>& p, std::vector<T>& data, double epsilon) {
  k::orthogonalize_cpu(data.data(), p.offsets.data(), p.rows.data(), p.cols.data(),
                       static_cast<int64_t>(p.offsets.size()), static_cast<T>(epsilon));
}

struct OrthoCase {
  at::ScalarType dtype;
  double epsilon;
};

std::string ortho_case_name(const ::testing::TestParamInfo<OrthoCase>& info) {
  return std::string(info.param.dtype == at::kFloat ? "f32" : "f64") +
         (info.param.epsilon == 0 ? "_eps0" : "_eps1em8");
}

const OrthoCase kOrthoCases[] = {
    {at::kFloat, 0.0}, {at::kFloat, 1e-8}, {at::kDouble, 0.0}, {at::kDouble, 1e-8}};

uint64_t ortho_seed(const OrthoCase& c) {
  return 1000 + (c.dtype == at::kFloat ? 0 : 10) + (c.epsilon == 0 ? 0 : 1);
}

class OrthogonalizeCpu : public ::testing::TestWithParam<OrthoCase> {};

template <typename T>
void cpu_matches_reference(const OrthoCase& c, bool tall = false) {
  const auto shapes = tall ? tall_shapes(ortho_seed(c)) : random_shapes(ortho_seed(c), 50);
  Pack<T> p = make_pack<T>(shapes, ortho_seed(c) * 7 + 3);
  std::vector<T> out = p.data;
  run_cpu(p, out, c.epsilon);
  const double worst = check_against_reference(p, out, c.epsilon, "orthogonalize_cpu");
  std::cout << "[ info ] orthogonalize_cpu " << (std::is_same<T, float>::value ? "f32" : "f64")
            << " eps " << c.epsilon << ": " << shapes.size()
            << " matrices, worst |Q - Q_ref| / (u kappa sqrt(r)) = " << worst << std::endl;
}

// Every matrix of one packed buffer, orthonormalised in one call, matches torch.
TEST_P(OrthogonalizeCpu, MatchesTorchReference) {
  if (GetParam().dtype == at::kFloat) {
    cpu_matches_reference<float>(GetParam());
  } else {
    cpu_matches_reference<double>(GetParam());
  }
}

// The shapes the CUDA kernel's tall way is tested on (rows up to 4096): the CPU kernel meets the
// same reference tolerance there, so the tolerance holds for tall matrices.
TEST_P(OrthogonalizeCpu, TallMatchesTorchReference) {
  if (GetParam().dtype == at::kFloat) {
    cpu_matches_reference<float>(GetParam(), true);
  } else {
    cpu_matches_reference<double>(GetParam(), true);
  }
}

template <typename T>
void zero_columns_case(double epsilon) {
  // 10 x 5 with columns 0 and 3 zero; 4 x 4 entirely zero; 6 x 2 with its last column zero.
  Pack<T> p = make_pack<T>({{10, 5}, {4, 4}, {6, 2}}, 77);
  auto zero_col = [&](size_t k, int64_t c) {
    for (int64_t j = 0; j < p.rows[k]; ++j) p.data[p.offsets[k] + j * p.cols[k] + c] = T(0);
  };
  zero_col(0, 0);
  zero_col(0, 3);
  for (int64_t c = 0; c < 4; ++c) zero_col(1, c);
  zero_col(2, 1);
  std::vector<T> out = p.data;
  run_cpu(p, out, epsilon);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_FALSE(std::isnan(out[i]) || std::isinf(out[i])) << "element " << i << " is not finite";
  }
  // Zero columns stay zero; the others are the orthonormal factor of the nonzero columns alone
  // (epsilon == 0), or torch's Gram-Schmidt, which gives 0 / epsilon = 0 there (epsilon > 0).
  const double u = unit_roundoff<T>();
  const at::Tensor q0 = matrix_of(p, out, 0), a0 = matrix_of(p, p.data, 0);
  EXPECT_EQ(q0.select(1, 0).abs().max().item<double>(), 0.0);
  EXPECT_EQ(q0.select(1, 3).abs().max().item<double>(), 0.0);
  const at::Tensor keep = at::tensor({1, 2, 4}, at::kLong);
  const at::Tensor nonzero = a0.index_select(1, keep);
  // Above rank 2 (5 columns here) the kernel runs a second pass with epsilon 0.
  const at::Tensor want0 =
      epsilon == 0 ? qr_reference(nonzero)
                   : torch_gram_schmidt(torch_gram_schmidt(a0, epsilon).index_select(1, keep), 0.0);
  EXPECT_LE(max_abs_diff(q0.index_select(1, keep), want0),
            kTolFactor * u * condition_number(nonzero) * 2);
  const at::Tensor q1 = matrix_of(p, out, 1);
  EXPECT_EQ(q1.abs().max().item<double>(), 0.0);
  const at::Tensor q2 = matrix_of(p, out, 2), a2 = matrix_of(p, p.data, 2);
  EXPECT_EQ(q2.select(1, 1).abs().max().item<double>(), 0.0);
  const at::Tensor col = a2.select(1, 0);
  const double norm = col.norm().item<double>();
  EXPECT_LE(max_abs_diff(q2.select(1, 0), col / (norm + epsilon)), 4 * u);
}

// Zero columns come out as zeros with epsilon == 0 (torch would divide 0 by 0), and with
// epsilon > 0 as 0 / epsilon = 0; nothing turns NaN.
TEST_P(OrthogonalizeCpu, ZeroColumnsBecomeZeros) {
  if (GetParam().dtype == at::kFloat) {
    zero_columns_case<float>(GetParam().epsilon);
  } else {
    zero_columns_case<double>(GetParam().epsilon);
  }
}

template <typename T>
void orthonormal_is_fixed_point(double epsilon) {
  // Columns e_0 .. e_{r-1} (scaled by -1 on odd columns): already orthonormal, so Gram-Schmidt
  // must return them exactly when epsilon == 0.
  Pack<T> p = make_pack<T>({{9, 4}}, 5);
  for (int64_t j = 0; j < 9; ++j) {
    for (int64_t c = 0; c < 4; ++c) {
      p.data[p.offsets[0] + j * 4 + c] = j == c ? T(c % 2 ? -1 : 1) : T(0);
    }
  }
  std::vector<T> out = p.data;
  run_cpu(p, out, epsilon);
  for (int64_t i = 0; i < 36; ++i) {
    const T want = p.data[p.offsets[0] + i];
    // With epsilon the first pass shrinks each column to 1 / (1 + epsilon); the second pass that
    // 4 columns get (rank > 2) restores unit norm.
    EXPECT_NEAR(out[p.offsets[0] + i], want, 2 * unit_roundoff<T>()) << "element " << i;
    if (epsilon == 0) EXPECT_EQ(out[p.offsets[0] + i], want) << "element " << i;
  }
}

TEST_P(OrthogonalizeCpu, OrthonormalInputIsAFixedPoint) {
  if (GetParam().dtype == at::kFloat) {
    orthonormal_is_fixed_point<float>(GetParam().epsilon);
  } else {
    orthonormal_is_fixed_point<double>(GetParam().epsilon);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, OrthogonalizeCpu, ::testing::ValuesIn(kOrthoCases),
                         ortho_case_name);

// col / (||col|| + epsilon) in closed form: a column of norm 1e-8 with epsilon 1e-8 comes out
// with norm 1/2 (and with norm 1 when epsilon is 0).
template <typename T>
void epsilon_closed_form() {
  const T v = T(1e-8);
  const T col[3] = {T(0.6) * v, T(0), T(-0.8) * v};
  const double norm = std::sqrt(double(col[0]) * double(col[0]) + double(col[2]) * double(col[2]));
  for (double eps : {0.0, 1e-8}) {
    std::vector<T> data(col, col + 3);
    const int64_t off = 0, rows = 3, cols = 1;
    k::orthogonalize_cpu(data.data(), &off, &rows, &cols, 1, static_cast<T>(eps));
    const double scale = 1.0 / (norm + static_cast<double>(static_cast<T>(eps)));
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(data[i], double(col[i]) * scale, 4 * unit_roundoff<T>()) << "eps " << eps;
    }
    const double out_norm = std::sqrt(double(data[0]) * data[0] + double(data[2]) * data[2]);
    EXPECT_NEAR(out_norm, eps == 0 ? 1.0 : 0.5, 1e-6) << "eps " << eps;
  }
}

TEST(OrthogonalizeCpuEpsilon, AddsEpsilonToTheNorm) {
  epsilon_closed_form<float>();
  epsilon_closed_form<double>();
}

// A float column whose norm is positive but below ~2.9e-39 (denormal entries) has a reciprocal
// norm above FLT_MAX; scaling by it in float gives inf/NaN ({1e-40, -2e-40, 0, 3e-40} -> inf
// -inf nan inf), and PowerSGD's error feedback would keep the NaN for good. The
// column must come out unit-norm and finite, like any other; the next column orthogonal to it.
// (In double the case cannot arise: the squared norm, accumulated in double, underflows to 0 long
// before 1/norm overflows, and the column is then a zero column.)
std::vector<float> tiny_column_input() {
  // 4 x 2: column 0 denormal in float (1/norm > FLT_MAX), column 1 ordinary.
  return {1e-40f, 1.0f, -2e-40f, 2.0f, 0.0f, -1.0f, 3e-40f, 0.5f};
}

void check_tiny_column(const std::vector<float>& in, const std::vector<float>& out) {
  double n0 = 0, n1 = 0, dot = 0, in_norm = 0;
  for (int j = 0; j < 4; ++j) {
    ASSERT_TRUE(std::isfinite(double(out[j * 2])) && std::isfinite(double(out[j * 2 + 1])))
        << "row " << j << ": " << out[j * 2] << ", " << out[j * 2 + 1];
    n0 += double(out[j * 2]) * out[j * 2];
    n1 += double(out[j * 2 + 1]) * out[j * 2 + 1];
    dot += double(out[j * 2]) * out[j * 2 + 1];
    in_norm += double(in[j * 2]) * in[j * 2];
  }
  in_norm = std::sqrt(in_norm);
  EXPECT_NEAR(n0, 1.0, 1e-5);
  EXPECT_NEAR(n1, 1.0, 1e-5);
  EXPECT_NEAR(dot, 0.0, 1e-5);
  // The direction is the input's (denormals carry few significant bits: a loose tolerance).
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(double(out[j * 2]), double(in[j * 2]) / in_norm, 1e-2);
  EXPECT_EQ(out[2 * 2], 0.0f);  // the zero entry stays zero
}

TEST(OrthogonalizeCpuEpsilon, TinyColumnStaysFiniteAndUnitNorm) {
  std::vector<float> in = tiny_column_input(), data = in;
  ASSERT_GT(std::fabs(in[0]), 0.0f) << "this platform flushes denormals to zero";
  const int64_t off = 0, rows = 4, cols = 2;
  k::orthogonalize_cpu(data.data(), &off, &rows, &cols, 1, 0.0f);
  check_tiny_column(in, data);
}

TEST(OrthogonalizeCpuEpsilon, CountZeroWritesNothing) {
  std::vector<float> data = {1.f, 2.f, 3.f};
  const int64_t off = 0, rows = 3, cols = 1;
  k::orthogonalize_cpu(data.data(), &off, &rows, &cols, 0, 0.f);
  EXPECT_EQ(data, (std::vector<float>{1.f, 2.f, 3.f}));
}

// ---- ATen layer: orthogonalize_ over a MatrixPack, error_feedback_apply_ ---------------------

// Packs into a flat tensor of `dtype` (values rounded to it).
at::Tensor flat_tensor(const std::vector<double>& values, at::ScalarType dtype) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kDouble);
  std::memcpy(t.data_ptr<double>(), values.data(), values.size() * sizeof(double));
  return t.to(dtype);
}

// orthogonalize_ is the kernel on fp32/fp64 buffers, and fp32 arithmetic rounded back for
// 16-bit buffers: bit for bit.
TEST(OrthogonalizeAten, MatchesKernelForEveryDtype) {
  const std::vector<Shape> shapes = {{5, 2}, {40, 8}, {3, 3}, {100, 1}};
  const Pack<double> p = make_pack<double>(shapes, 321);
  const ddpx::ops::MatrixPack pack(p.offsets, p.rows, p.cols, at::kCPU);
  EXPECT_EQ(pack.count(), 4);
  for (at::ScalarType dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (double eps : {0.0, 1e-8}) {
      at::Tensor flat = flat_tensor(p.data, dt);
      const at::Tensor original = flat.clone();
      ddpx::ops::orthogonalize_(flat, pack, eps);
      at::Tensor want;
      if (dt == at::kDouble) {
        std::vector<double> d(p.data);
        k::orthogonalize_cpu(d.data(), p.offsets.data(), p.rows.data(), p.cols.data(), 4, eps);
        want = flat_tensor(d, at::kDouble);
      } else {
        at::Tensor f = original.to(at::kFloat).contiguous();
        k::orthogonalize_cpu(f.data_ptr<float>(), p.offsets.data(), p.rows.data(), p.cols.data(), 4,
                             static_cast<float>(eps));
        want = f.to(dt);
      }
      EXPECT_TRUE(bitwise_equal(flat, want)) << "dtype " << dt << " eps " << eps;
    }
  }
  // An empty pack leaves the buffer alone.
  at::Tensor untouched = flat_tensor(p.data, at::kFloat);
  const at::Tensor copy = untouched.clone();
  ddpx::ops::orthogonalize_(untouched, ddpx::ops::MatrixPack({}, {}, {}, at::kCPU), 0.0);
  EXPECT_TRUE(bitwise_equal(untouched, copy));
}

TEST(OrthogonalizeAten, RejectsBadArguments) {
  EXPECT_THAT(
      [] {
        try {
          ddpx::ops::MatrixPack({0}, {2}, {3}, at::kCPU);
        } catch (const c10::Error& e) {
          return std::string(e.what_without_backtrace());
        }
        return std::string("no error");
      }(),
      HasSubstr("more columns"));
  const ddpx::ops::MatrixPack pack({0}, {2}, {2}, at::kCPU);
  EXPECT_THROW(ddpx::ops::orthogonalize_(at::ones({2, 2}), pack, 0.0), c10::Error);
  EXPECT_THROW(ddpx::ops::orthogonalize_(at::ones({8}).slice(0, 0, 8, 2), pack, 0.0), c10::Error);
  EXPECT_THROW(ddpx::ops::orthogonalize_(at::ones({4}, at::kInt), pack, 0.0), c10::Error);
  // Matrices reaching past the buffer: refused before any kernel runs (on a GPU the write would
  // leave a sticky error in the CUDA context), the buffer untouched.
  const ddpx::ops::MatrixPack beyond({0, 4}, {2, 4}, {2, 2}, at::kCPU);  // extends to element 12
  EXPECT_EQ(beyond.extent(), 12);
  at::Tensor short_buffer = at::ones({11});
  EXPECT_THAT(
      [&] {
        try {
          ddpx::ops::orthogonalize_(short_buffer, beyond, 0.0);
        } catch (const c10::Error& e) {
          return std::string(e.what_without_backtrace());
        }
        return std::string("no error");
      }(),
      HasSubstr("extend to element 12 but the buffer has 11"));
  EXPECT_TRUE(at::equal(short_buffer, at::ones({11})));
}

// err += input; input = err: both end up holding fl(err + input), bit for bit.
TEST(ErrorFeedbackApply, AddsResidualIntoBoth) {
  std::mt19937_64 gen(99);
  std::normal_distribution<double> normal;
  for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
    for (int64_t n : {1, 17, 4099}) {
      std::vector<double> a(n), b(n);
      for (auto& x : a) x = normal(gen) * 3;
      for (auto& x : b) x = normal(gen) * 1e-2;
      at::Tensor input = flat_tensor(a, dt), err = flat_tensor(b, dt);
      const at::Tensor want = input + err;
      ddpx::ops::error_feedback_apply_(input, err);
      EXPECT_TRUE(bitwise_equal(err, want)) << dt << " n " << n;
      EXPECT_TRUE(bitwise_equal(input, want)) << dt << " n " << n;
    }
  }
  // A 2-D input against a flat residual of the same numel (a bucket view vs its memory).
  at::Tensor input = at::arange(12, at::kFloat).reshape({3, 4}) + 1;
  at::Tensor err = at::full({12}, 0.5f);
  ddpx::ops::error_feedback_apply_(input, err);
  EXPECT_TRUE(bitwise_equal(err, at::arange(12, at::kFloat) + 1.5f));
  EXPECT_TRUE(bitwise_equal(input.reshape({-1}), err));
}

TEST(ErrorFeedbackApply, RejectsMismatchedBuffers) {
  auto message = [](const at::Tensor& a, const at::Tensor& b) -> std::string {
    try {
      ddpx::ops::error_feedback_apply_(a, b);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_THAT(message(at::ones({4}), at::ones({5})), HasSubstr("must match"));
  EXPECT_THAT(message(at::ones({4}), at::ones({4}, at::kDouble)), HasSubstr("must match"));
}

// PowerSGD's three products against fp64 matmuls, at ranks around the kernels' blocks of four
// columns (1-3: the remainder alone; 4, 8: whole blocks; 5, 9: both), and the fused error
// feedback equal, bit for bit, to the separate steps it replaces.
TEST(LowrankProducts, MatchReferenceAndFusedErrorFeedbackEqualsSeparateSteps) {
  at::manual_seed(7);
  for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
    // Each product sums m (or n) terms: the bound scales with that length and the precision.
    const double eps = dt == at::kFloat ? 1e-6 : 1e-14;
    for (int64_t r : {1, 2, 3, 4, 5, 8, 9}) {
      for (auto nm : {std::pair<int64_t, int64_t>{33, 70}, {128, 17}}) {
        const int64_t n = nm.first, m = nm.second;
        const auto o = at::TensorOptions().dtype(dt);
        const at::Tensor M = at::randn({2, n, m}, o), Q = at::randn({2, m, r}, o);
        const at::Tensor err = at::randn({2, n, m}, o) * 0.1;
        const std::string where = c10::toString(dt) + std::string(" r ") + std::to_string(r) + " " +
                                  std::to_string(n) + "x" + std::to_string(m);

        at::Tensor P = at::empty({2, n, r}, o);
        ddpx::ops::lowrank_project_(M, Q, P);
        const at::Tensor P64 = at::bmm(M.to(at::kDouble), Q.to(at::kDouble));
        EXPECT_LE((P.to(at::kDouble) - P64).abs().max().item<double>(),
                  eps * m * (M.abs().max() * Q.abs().max()).item<double>())
            << "project " << where;

        at::Tensor Qt = at::empty({2, m, r}, o);
        ddpx::ops::lowrank_project_t_(M, P, Qt);
        const at::Tensor Qt64 = at::bmm(M.to(at::kDouble).transpose(1, 2), P.to(at::kDouble));
        EXPECT_LE((Qt.to(at::kDouble) - Qt64).abs().max().item<double>(),
                  eps * n * (M.abs().max() * P.abs().max()).item<double>())
            << "project_t " << where;

        at::Tensor R = at::empty({2, n, m}, o);
        ddpx::ops::lowrank_reconstruct_(P, Q, R);
        const at::Tensor R64 = at::bmm(P.to(at::kDouble), Q.to(at::kDouble).transpose(1, 2));
        EXPECT_LE((R.to(at::kDouble) - R64).abs().max().item<double>(),
                  eps * r * (P.abs().max() * Q.abs().max()).item<double>())
            << "reconstruct " << where;

        // Compensation fused into the projection: M and err both become fl(M + err), and P is
        // the projection of that, as with error_feedback_apply_ and then lowrank_project_.
        at::Tensor m_sep = M.clone(), e_sep = err.clone(), p_sep = at::empty({2, n, r}, o);
        ddpx::ops::error_feedback_apply_(m_sep, e_sep);
        ddpx::ops::lowrank_project_(m_sep, Q, p_sep);
        at::Tensor m_fused = M.clone(), e_fused = err.clone(), p_fused = at::empty({2, n, r}, o);
        ddpx::ops::lowrank_project_(m_fused, Q, p_fused, e_fused);
        EXPECT_TRUE(bitwise_equal(m_fused, m_sep)) << "compensated M " << where;
        EXPECT_TRUE(bitwise_equal(e_fused, e_sep)) << "compensated err " << where;
        EXPECT_TRUE(bitwise_equal(p_fused, p_sep)) << "P " << where;

        // The residual fused into the reconstruction: err -= M after M = P Q^T.
        at::Tensor r_sep = at::empty({2, n, m}, o), e2_sep = err.clone();
        ddpx::ops::lowrank_reconstruct_(P, Q, r_sep);
        e2_sep.sub_(r_sep);
        at::Tensor r_fused = at::empty({2, n, m}, o), e2_fused = err.clone();
        ddpx::ops::lowrank_reconstruct_(P, Q, r_fused, e2_fused);
        EXPECT_TRUE(bitwise_equal(r_fused, r_sep)) << "reconstructed M " << where;
        EXPECT_TRUE(bitwise_equal(e2_fused, e2_sep)) << "residual " << where;
      }
    }
  }
}

TEST(LowrankProducts, RejectsAnErrorBufferOfAnotherShape) {
  const at::Tensor M = at::ones({1, 4, 6}), Q = at::ones({1, 6, 2}), P = at::empty({1, 4, 2});
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_THAT(message([&] {
                ddpx::ops::lowrank_project_(M, Q, P, at::ones({1, 4, 5}));
              }),
              HasSubstr("err must be contiguous and shaped as M"));
  EXPECT_THAT(message([&] { ddpx::ops::lowrank_reconstruct_(P, Q, M.clone(), at::ones({24})); }),
              HasSubstr("err must be contiguous and shaped as M"));
}

// ---- CUDA kernels ----------------------------------------------------------------------------

#ifdef DDPX_TEST_CUDA_KERNELS

// A device copy of a host vector, freed on scope exit. The copy is queued on `stream`, the stream
// the kernels under test then run on: a pageable cudaMemcpy on the legacy stream followed by a
// kernel on a non-blocking stream is not ordered by CUDA's rules.
template <typename T>
struct DeviceVector {
  DeviceVector(const std::vector<T>& host, cudaStream_t stream) : size(host.size()) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(1, size) * sizeof(T)) !=
        cudaSuccess) {
      ptr = nullptr;
      return;
    }
    if (size && cudaMemcpyAsync(ptr, host.data(), size * sizeof(T), cudaMemcpyHostToDevice,
                                stream) != cudaSuccess) {
      cudaFree(ptr);
      ptr = nullptr;
    }
  }
  ~DeviceVector() {
    if (ptr) cudaFree(ptr);
  }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> host(size);
    if (size) cudaMemcpy(host.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  T* ptr = nullptr;
  size_t size;
};

// A non-default stream, as the hooks use (the current stream), destroyed on scope exit.
struct Stream {
  Stream() { ok = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess; }
  ~Stream() {
    if (ok) cudaStreamDestroy(s);
  }
  cudaStream_t s = nullptr;
  bool ok = false;
};

// Runs the CUDA kernel on `data`: one block per matrix, or, with tall_min_rows >= 0, the plan
// for that threshold, which must be a tall one (several blocks per matrix), so that a test of
// the tall way cannot silently test the other.
// `refused` (if given) receives what the cooperative launch was refused with (cudaSuccess: not
// refused).
template <typename T>
void run_cuda(const Pack<T>& p, std::vector<T>& data, double epsilon, int64_t tall_min_rows = -1,
              cudaError_t* refused = nullptr) {
  Stream stream;
  ASSERT_TRUE(stream.ok);
  DeviceVector<T> d(data, stream.s);
  DeviceVector<int64_t> off(p.offsets, stream.s), rows(p.rows, stream.s), cols(p.cols, stream.s);
  ASSERT_TRUE(d.ptr && off.ptr && rows.ptr && cols.ptr) << "cudaMalloc/cudaMemcpy failed";
  const int64_t count = static_cast<int64_t>(p.offsets.size());
  k::GsPlan plan;
  if (tall_min_rows >= 0) {
    plan = k::plan_orthogonalize_cuda(p.rows.data(), p.cols.data(), count,
                                      std::is_same<T, double>::value, tall_min_rows);
    ASSERT_GT(plan.tall_blocks, 0) << "no tall plan for these matrices on this GPU";
  }
  DeviceVector<double> scratch(
      std::vector<double>(static_cast<size_t>(k::orthogonalize_cuda_scratch(plan))), stream.s);
  ASSERT_TRUE(scratch.ptr);
  const cudaError_t got =
      k::orthogonalize_cuda(d.ptr, off.ptr, rows.ptr, cols.ptr, count, static_cast<T>(epsilon),
                            stream.s, plan, plan.tall_blocks > 0 ? scratch.ptr : nullptr);
  if (refused != nullptr) *refused = got;
  DDPX_ASSERT_CUDA(cudaStreamSynchronize(stream.s));
  DDPX_ASSERT_CUDA(cudaGetLastError());
  data = d.to_host();
}

template <typename T>
void cuda_matches(const OrthoCase& c, bool tall) {
  // One block per matrix: the CPU shapes plus many small matrices (a grid of thousands of
  // blocks). Tall: tall_shapes, every matrix spread over blocks of 128 rows.
  auto shapes = tall ? tall_shapes(ortho_seed(c)) : random_shapes(ortho_seed(c), 50);
  if (!tall) {
    for (int i = 0; i < 3000; ++i) shapes.push_back({4 + i % 13, 1 + i % 4});
  }
  Pack<T> p = make_pack<T>(shapes, ortho_seed(c) * 11 + 5);
  std::vector<T> gpu = p.data, cpu = p.data;
  run_cuda(p, gpu, c.epsilon, tall ? 1 : -1);
  if (::testing::Test::HasFatalFailure()) return;
  run_cpu(p, cpu, c.epsilon);
  const double worst = check_against_reference(p, gpu, c.epsilon, "orthogonalize_cuda");
  std::cout << "[ info ] orthogonalize_cuda worst |Q - Q_ref| / (u kappa sqrt(r)) = " << worst
            << std::endl;
  const double u = unit_roundoff<T>();
  for (size_t k2 = 0; k2 < p.offsets.size(); ++k2) {
    const at::Tensor a = matrix_of(p, p.data, k2);
    const double tol =
        2 * kTolFactor * u * condition_number(a) * std::sqrt(static_cast<double>(p.cols[k2]));
    EXPECT_LE(max_abs_diff(matrix_of(p, gpu, k2), matrix_of(p, cpu, k2)), tol) << "matrix " << k2;
  }
}

class OrthogonalizeCuda : public ::testing::TestWithParam<OrthoCase> {};

TEST_P(OrthogonalizeCuda, MatchesTorchReferenceAndCpu) {
  DDPX_SKIP_WITHOUT_GPU();
  if (GetParam().dtype == at::kFloat) {
    cuda_matches<float>(GetParam(), false);
  } else {
    cuda_matches<double>(GetParam(), false);
  }
}

// A few tall matrices, each over several blocks joined by grid barriers.
TEST_P(OrthogonalizeCuda, TallMatchesTorchReferenceAndCpu) {
  DDPX_SKIP_WITHOUT_GPU();
  if (GetParam().dtype == at::kFloat) {
    cuda_matches<float>(GetParam(), true);
  } else {
    cuda_matches<double>(GetParam(), true);
  }
}

template <typename T>
void cuda_zero_columns(double epsilon, bool tall) {
  const int64_t n = tall ? 3000 : 300;
  Pack<T> p = make_pack<T>({{n, 5}, {4, 4}}, 78);
  for (int64_t j = 0; j < n; ++j) {
    p.data[p.offsets[0] + j * 5 + 1] = T(0);
    p.data[p.offsets[0] + j * 5 + 4] = T(0);
  }
  for (int64_t i = 0; i < 16; ++i) p.data[p.offsets[1] + i] = T(0);
  std::vector<T> gpu = p.data, cpu = p.data;
  run_cuda(p, gpu, epsilon, tall ? 1 : -1);
  if (::testing::Test::HasFatalFailure()) return;
  run_cpu(p, cpu, epsilon);
  for (size_t i = 0; i < gpu.size(); ++i) {
    ASSERT_TRUE(std::isfinite(gpu[i])) << "element " << i;
    // Zeros may come out as -0.0 on the GPU (x * 0); compare values.
    EXPECT_NEAR(gpu[i], cpu[i], 1e3 * unit_roundoff<T>()) << "element " << i;
    if (cpu[i] == T(0)) EXPECT_EQ(gpu[i], T(0)) << "element " << i;
  }
}

TEST_P(OrthogonalizeCuda, ZeroColumnsBecomeZeros) {
  DDPX_SKIP_WITHOUT_GPU();
  for (bool tall : {false, true}) {
    SCOPED_TRACE(tall ? "tall" : "one block per matrix");
    if (GetParam().dtype == at::kFloat) {
      cuda_zero_columns<float>(GetParam().epsilon, tall);
    } else {
      cuda_zero_columns<double>(GetParam().epsilon, tall);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, OrthogonalizeCuda, ::testing::ValuesIn(kOrthoCases),
                         ortho_case_name);

// The same on the GPU: the denormal column of TinyColumnStaysFiniteAndUnitNorm, through the CUDA
// kernel (nvcc keeps float denormals unless built with -ftz=true), and the same values as the
// CPU's.
TEST(OrthogonalizeCudaEpsilon, TinyColumnStaysFiniteAndUnitNorm) {
  DDPX_SKIP_WITHOUT_GPU();
  Pack<float> p;  // one 4 x 2 matrix at offset 0, no gaps (make_pack would add some)
  p.data = tiny_column_input();
  p.offsets = {0};
  p.rows = {4};
  p.cols = {2};
  p.is_gap.assign(p.data.size(), false);
  for (int64_t tall_min_rows : {int64_t{-1}, int64_t{1}}) {
    SCOPED_TRACE(tall_min_rows < 0 ? "one block per matrix" : "tall");
    std::vector<float> gpu = p.data, cpu = p.data;
    run_cuda(p, gpu, 0.0, tall_min_rows);
    if (::testing::Test::HasFatalFailure()) return;
    run_cpu(p, cpu, 0.0);
    check_tiny_column(p.data, gpu);
    for (size_t i = 0; i < gpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], 1e-6) << "element " << i;
  }
}

// A cooperative launch refused by the runtime (forced here with a grid of no blocks; on a real
// machine, e.g. a GPU shared through MPS that has the attribute and refuses the launch) leaves no
// error behind and falls back to one block per matrix: the one-block kernel's results, bit for
// bit, and the refusal reported to the caller.
TEST(OrthogonalizeCudaFallback, RefusedCooperativeLaunchTakesOneBlockPerMatrix) {
  DDPX_SKIP_WITHOUT_GPU();
  const std::vector<Shape> shapes = tall_shapes(17);
  Pack<float> p = make_pack<float>(shapes, 23);
  std::vector<float> one_block = p.data, refused = p.data;
  run_cuda(p, one_block, 0.0);
  if (::testing::Test::HasFatalFailure()) return;
  cudaError_t why = cudaSuccess;
  k::refuse_cooperative_launches_for_testing(true);
  run_cuda(p, refused, 0.0, 1, &why);
  k::refuse_cooperative_launches_for_testing(false);
  if (::testing::Test::HasFatalFailure()) return;
  // The runtime's reason varies (CUDA 13 on an H200 says cudaErrorInvalidValue for an empty
  // grid); that it was refused is what the fallback acts on.
  EXPECT_NE(why, cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(refused.size(), one_block.size());
  EXPECT_EQ(std::memcmp(refused.data(), one_block.data(), refused.size() * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(refused.data(), p.data.data(), refused.size() * sizeof(float)), 0);
  // And the cooperative launch works again once allowed.
  std::vector<float> tall = p.data;
  run_cuda(p, tall, 0.0, 1, &why);
  EXPECT_EQ(why, cudaSuccess);
}

// The plan: tall only for matrices of at most 32 columns, one of them at least min_rows long,
// and only as many blocks as half the GPU holds at once (else one block per matrix).
TEST(OrthogonalizeCudaPlan, TallOnlyWhereItFits) {
  DDPX_SKIP_WITHOUT_GPU();
  const std::vector<int64_t> rows = {4096, 100}, cols = {32, 4};
  EXPECT_GT(k::plan_orthogonalize_cuda(rows.data(), cols.data(), 2, false).tall_blocks, 0);
  const k::GsPlan plan = k::plan_orthogonalize_cuda(rows.data(), cols.data(), 2, true);
  EXPECT_EQ(plan.tall_blocks, 32 + 1);
  EXPECT_EQ(plan.max_cols, 32);
  EXPECT_EQ(plan.passes, 2);
  EXPECT_EQ(k::orthogonalize_cuda_scratch(plan), 2 * 33 * 33);
  const std::vector<int64_t> short_rows = {1000, 100};
  EXPECT_EQ(k::plan_orthogonalize_cuda(short_rows.data(), cols.data(), 2, false).tall_blocks, 0);
  const std::vector<int64_t> wide = {32, 33};
  EXPECT_EQ(k::plan_orthogonalize_cuda(rows.data(), wide.data(), 2, false).tall_blocks, 0);
  // 4096 matrices of 4096 rows: far more blocks than any GPU keeps resident.
  const std::vector<int64_t> many_rows(4096, 4096), many_cols(4096, 2);
  EXPECT_EQ(k::plan_orthogonalize_cuda(many_rows.data(), many_cols.data(), 4096, false).tall_blocks,
            0);
  const std::vector<int64_t> one_row = {4096}, two = {2};
  EXPECT_EQ(k::plan_orthogonalize_cuda(one_row.data(), two.data(), 1, false).passes, 1);
}

template <typename T>
void cuda_error_feedback(int64_t n) {
  std::mt19937_64 gen(static_cast<uint64_t>(n) * 3 + sizeof(T));
  std::normal_distribution<double> normal;
  std::vector<T> in(n), err(n);
  for (auto& x : in) x = static_cast<T>(normal(gen));
  for (auto& x : err) x = static_cast<T>(normal(gen) * 1e-2);
  Stream stream;
  ASSERT_TRUE(stream.ok);
  DeviceVector<T> din(in, stream.s), derr(err, stream.s);
  ASSERT_TRUE(din.ptr && derr.ptr);
  k::error_feedback_apply_cuda(din.ptr, derr.ptr, n, stream.s);
  DDPX_ASSERT_CUDA(cudaStreamSynchronize(stream.s));
  const std::vector<T> gin = din.to_host(), gerr = derr.to_host();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T want = err[i] + in[i];
    bad += std::memcmp(&gin[i], &want, sizeof(T)) != 0 || std::memcmp(&gerr[i], &want, sizeof(T));
  }
  EXPECT_EQ(bad, 0) << "n " << n << ": elements differing from fl(err + in)";
}

// Bit for bit the CPU semantics (one rounding per element), across the grid-stride loop
// (> 4096 blocks of 256 threads).
TEST(ErrorFeedbackApplyCuda, MatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{(1 << 21) + 7}}) {
    cuda_error_feedback<float>(n);
    cuda_error_feedback<double>(n);
  }
}

#else  // !DDPX_TEST_CUDA_KERNELS

TEST(OrthogonalizeCuda, MatchesTorchReferenceAndCpu) {
  GTEST_SKIP() << "ddpx was built without nvcc: no CUDA kernels to test";
}

#endif

}  // namespace
