// Tests of PowerSGDState, powerSGD_hook and batched_powerSGD_hook on real Gloo process groups:
// 1 to 4 ranks as threads over one in-memory c10d::HashStore (see test_utils.h), fp32 and fp64
// buckets.
//
// Buckets are driven as DDP's Reducer drives them: one GradBucket per bucket of a layout (a list
// of parameter indices per bucket), runHook for buckets 0..L-1 in order, the last with
// isLast() == true, then every future waited for. The hook issues round one of bucket i and round
// two of bucket i-1 inside runHook(i), so a future completes only once a later runHook (or the
// last bucket's) ran. Every bucket carries the same parameter tensors at every step: the state
// keys its memories by parameter identity, in first-appearance order (the order of `params`).
//
// Expected values are closed forms computed in fp64 from every rank's regenerated (seeded,
// nonzero) gradients:
//   * before start_powerSGD_iter, and for rank >= min(n, m), the result is the mean over ranks;
//   * error feedback: compensated input (gradient + previous residual) == result + new residual;
//   * warm start: with Q_prev the state's Q memory and C_r rank r's compensated matrix,
//       P = orth(sum_r C_r orth(Q_prev)),  Q = (1/W) sum_r C_r^T P,  result = P Q^T,
//     and Q is what the state keeps for the next step (orth = Gram-Schmidt, i.e. QR with diag(R)
//     > 0, here torch's QR with fixed signs);
//   * compression statistics: (n + m) * r per compressed and n * m per uncompressed matrix
//     (layer-wise), 2 * side * r per bucket (batched).
// Checkpoints must continue bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ddpx/hooks.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "test_utils.h"

namespace {

using ddpx_test::bitwise_equal;

using ddpx::hooks::CommHook;
using ddpx::hooks::CommHookPtr;
using ddpx::hooks::PowerSGDOptions;
using ddpx::hooks::PowerSGDState;
using ddpx::hooks::PowerSGDStatePtr;
using ddpx_test::ProcessGroupPtr;
using ddpx_test::value_error;
using ::testing::AllOf;
using ::testing::HasSubstr;

using Shapes = std::vector<std::vector<int64_t>>;
// Parameter indices of each bucket, in bucket order. Flattened, a test's first layout lists
// 0, 1, 2, ... so that the state's key of parameter p is p.
using Layout = std::vector<std::vector<int>>;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// The matrix view torch's hook takes of a gradient: tensor.view(shape[0], -1).
std::pair<int64_t, int64_t> matrix_shape(const std::vector<int64_t>& shape) {
  const int64_t n = shape.empty() ? 1 : shape[0];
  return {n, numel_of(shape) / n};
}

// One model replica's parameters: only their identity matters to the hooks.
std::vector<at::Tensor> make_params(const Shapes& shapes, at::ScalarType dtype) {
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) params.push_back(at::zeros(s, at::TensorOptions().dtype(dtype)));
  return params;
}

// Rank `rank`'s gradient of parameter p at step `step`: seeded, nonzero, flat, in `dtype`.
// Magnitudes in [2^emin, 2^(emax+1)).
at::Tensor grad_of(uint64_t seed, int step, int rank, int p, int64_t numel, at::ScalarType dtype,
                   int emin = -2, int emax = 1) {
  const uint64_t s = ddpx_test::mix_seed(seed * 1000003 + static_cast<uint64_t>(step) * 1009 +
                                         static_cast<uint64_t>(p));
  return ddpx_test::make_tensor(
      ddpx_test::random_values(ddpx_test::rank_seed(s, rank), numel, emin, emax), dtype);
}

std::vector<at::Tensor> grads_of(uint64_t seed, int step, int rank, const Shapes& shapes,
                                 at::ScalarType dtype, int emin = -2, int emax = 1) {
  std::vector<at::Tensor> g;
  for (size_t p = 0; p < shapes.size(); ++p) {
    g.push_back(
        grad_of(seed, step, rank, static_cast<int>(p), numel_of(shapes[p]), dtype, emin, emax));
  }
  return g;
}

// Mean over the ranks of parameter p's gradient, and the mean of magnitudes, in fp64.
std::pair<at::Tensor, at::Tensor> mean_of(uint64_t seed, int step, int world, int p, int64_t numel,
                                          at::ScalarType dtype, int emin = -2, int emax = 1) {
  at::Tensor sum = at::zeros({numel}, at::kDouble), sum_abs = at::zeros({numel}, at::kDouble);
  for (int r = 0; r < world; ++r) {
    const at::Tensor g = grad_of(seed, step, r, p, numel, dtype, emin, emax).to(at::kDouble);
    sum += g;
    sum_abs += g.abs();
  }
  return {sum / world, sum_abs / world};
}

double rel_err(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kDouble).reshape({-1}), w = want.to(at::kDouble).reshape({-1});
  return (g - w).norm().item<double>() / w.norm().item<double>();
}

// Q of torch's QR with diag(R) > 0: what Gram-Schmidt computes, in fp64.
at::Tensor orth(const at::Tensor& a) {
  auto qr = at::linalg_qr(a.to(at::kDouble), "reduced");
  at::Tensor q = std::get<0>(qr), r = std::get<1>(qr);
  at::Tensor s = at::sign(r.diagonal());
  s = at::where(s == 0, at::ones_like(s), s);
  return q * s.unsqueeze(0);
}

// A state whose log lines go to `lines` (or nowhere), so that tests stay quiet.
PowerSGDStatePtr make_state(const ProcessGroupPtr& pg, const PowerSGDOptions& o,
                            std::shared_ptr<std::vector<std::string>> lines = nullptr) {
  return std::make_shared<PowerSGDState>(pg, o, [lines](const std::string& line) {
    if (lines) lines->push_back(line);
  });
}

PowerSGDOptions options(int64_t rank, double min_rate, int64_t start) {
  PowerSGDOptions o;
  o.matrix_approximation_rank = rank;
  o.min_compression_rate = min_rate;
  o.start_powerSGD_iter = start;
  return o;
}

// One step's communication on this rank (see the file comment). grads[p] is parameter p's flat
// gradient. `after_each(b)` runs after runHook of bucket b. Returns each parameter's result (flat
// copies; undefined for parameters not in `layout`), or an empty vector after a failure.
std::vector<at::Tensor> run_step(CommHook& hook, const std::vector<at::Tensor>& params,
                                 const Layout& layout, const std::vector<at::Tensor>& grads,
                                 const std::function<void(size_t)>& after_each = nullptr) {
  std::vector<at::Tensor> buffers;
  std::vector<std::unique_ptr<ddpx_test::TestBucket>> buckets;
  std::vector<FuturePtr> futs;
  for (size_t b = 0; b < layout.size(); ++b) {
    std::vector<at::Tensor> bucket_params, parts;
    for (int p : layout[b]) {
      bucket_params.push_back(params[p]);
      parts.push_back(grads[p].reshape({-1}));
    }
    buffers.push_back(at::cat(parts));
    buckets.push_back(ddpx_test::make_bucket(buffers.back(), bucket_params, b, layout.size()));
    EXPECT_EQ(buckets.back()->get().isLast(), b + 1 == layout.size());
    futs.push_back(hook.runHook(buckets.back()->get()));
    if (after_each) after_each(b);
  }
  std::vector<at::Tensor> out(params.size());
  for (size_t b = 0; b < layout.size(); ++b) {
    futs[b]->wait();
    if (futs[b]->hasError()) {
      ADD_FAILURE() << hook.name() << " bucket " << b << ": " << futs[b]->tryRetrieveErrorMessage();
      return {};
    }
    const at::Tensor value = hook.parseHookResult(futs[b]->value());
    // The result is the bucket's own buffer, all of it (also for the batched hook's padding).
    EXPECT_EQ(value.numel(), buffers[b].numel()) << hook.name() << " bucket " << b;
    EXPECT_EQ(value.scalar_type(), buffers[b].scalar_type());
    EXPECT_TRUE(bitwise_equal(value.reshape({-1}), buffers[b])) << hook.name() << " bucket " << b;
    int64_t pos = 0;
    for (int p : layout[b]) {
      const int64_t n = params[p].numel();
      out[p] = buffers[b].narrow(0, pos, n).clone();
      pos += n;
    }
  }
  return out;
}

// Parameter p's error-feedback residual in `st` (a copy, fp64), zeros when it has none yet.
at::Tensor residual(const PowerSGDState& st, int p, int64_t numel) {
  const auto memories = st.error_memories();
  auto it = memories.find(p);
  if (it == memories.end()) return at::zeros({numel}, at::kDouble);
  EXPECT_EQ(it->second.numel(), numel) << "error memory of parameter " << p;
  return it->second.to(at::kDouble).reshape({-1}).clone();
}

// ---- parametrisation: world size x bucket dtype ------------------------------------------------

using Param = std::tuple<int, at::ScalarType>;

class PowerSGDTest : public ::testing::TestWithParam<Param> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  at::ScalarType dtype() const { return std::get<1>(GetParam()); }
  double u() const { return ddpx_test::unit_roundoff(dtype()); }
  bool fp32() const { return dtype() == at::kFloat; }
  std::string label() const { return "w" + std::to_string(world()) + (fp32() ? "_f32" : "_f64"); }
  uint64_t seed(uint64_t test) const {
    return ddpx_test::mix_seed(test * 100 + world() * 10 + (fp32() ? 1 : 2));
  }
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return "w" + std::to_string(std::get<0>(info.param)) +
         (std::get<1>(info.param) == at::kFloat ? "_f32" : "_f64");
}

// Results gathered from the rank threads: [rank][step][param].
using Gathered = std::vector<std::vector<std::vector<at::Tensor>>>;

Gathered make_gathered(int world, int steps) {
  return Gathered(world, std::vector<std::vector<at::Tensor>>(steps));
}

// DDP needs every replica to apply the same gradient: all ranks' results agree bit for bit.
void expect_replicas_equal(const Gathered& g, const std::string& what) {
  for (size_t r = 1; r < g.size(); ++r) {
    for (size_t s = 0; s < g[r].size(); ++s) {
      for (size_t p = 0; p < g[r][s].size(); ++p) {
        if (!g[0][s][p].defined()) continue;
        EXPECT_TRUE(bitwise_equal(g[r][s][p], g[0][s][p]))
            << what << ": step " << s << " parameter " << p << ": rank " << r
            << " differs from rank 0";
      }
    }
  }
}

// ---- (a) plain allreduce before start_powerSGD_iter ---------------------------------------------

// Until iteration start_powerSGD_iter the hook is allreduce_hook: the mean over ranks, to the
// rounding of a divide-then-allreduce ((W + 2) u S_i, see test_hooks.cpp). The step after, a rank-1
// compression (min_compression_rate 0: everything compressed) no longer returns the mean.
TEST_P(PowerSGDTest, ExactMeanBeforeStartIter) {
  const Shapes shapes = {{8, 6}, {6}, {3, 4, 2}, {5, 5}};
  const Layout layout = {{0, 1}, {2, 3}};
  const int start = 3, steps = 4;
  const uint64_t sd = seed(1);
  Gathered got = make_gathered(world(), steps);
  ddpx_test::run_ranks(world(), [&](int rank, const ProcessGroupPtr& pg) {
    auto st = make_state(pg, options(1, 0.0, start));
    auto hook = ddpx::hooks::powerSGD_hook(st);
    const auto params = make_params(shapes, dtype());
    for (int s = 0; s < steps; ++s) {
      got[rank][s] = run_step(*hook, params, layout, grads_of(sd, s, rank, shapes, dtype()));
      ASSERT_FALSE(got[rank][s].empty());
      EXPECT_EQ(st->iter(), s + 1);
      if (s < start) {
        EXPECT_TRUE(st->error_memories().empty() && st->q_memories().empty()) << "step " << s;
        EXPECT_EQ(st->compression_stats(), std::make_tuple(0.0, int64_t{0}, int64_t{0}));
      } else {
        EXPECT_GT(std::get<1>(st->compression_stats()), 0);
      }
    }
  });
  for (int s = 0; s < steps; ++s) {
    for (size_t p = 0; p < shapes.size(); ++p) {
      const auto want = mean_of(sd, s, world(), static_cast<int>(p), numel_of(shapes[p]), dtype());
      const at::Tensor g = got[0][s][p].to(at::kDouble);
      if (s < start) {
        const double worst = ((g - want.first).abs() / want.second).max().item<double>();
        EXPECT_LE(worst, (world() + 2) * u())
            << label() << " step " << s << " parameter " << p << ": not the mean";
      } else if (p == 0) {
        // A rank-1 approximation of an 8 x 6 random matrix is far from it.
        EXPECT_GT(rel_err(g, want.first), 1e-2) << label() << ": PowerSGD did not start";
      }
    }
  }
  expect_replicas_equal(got, label());
}

// ---- (b) full rank: PowerSGD is exact --------------------------------------------------------

// With matrix_approximation_rank >= min(n, m) P spans the column space of the mean (or Q is
// square), so P P^T M == M: the mean over ranks, within the orthogonalisation's rounding, at every
// compressed step (the residuals stay at rounding level).
//
// Tolerance: Gram-Schmidt in the bucket's dtype leaves |P^T P - I| ~ u * kappa(P), P = M orth(Q)
// with Q random at the first compressed step, so the error follows kappa(P), not only kappa(M):
// fp32 errors seen here reach 1e-5 (a 3 x 4 mean with kappa 3.8 and an unlucky Q gave 9.8e-6; the
// batched 6 x 6 case 1.3e-5), fp64 ones 1.5e-14. The bounds, 1e-4 and 1e-12, stay far below the
// error of any rank-deficient result (> 1e-2 here).
TEST_P(PowerSGDTest, FullRankIsExactMean) {
  const Shapes shapes = {{6, 4}, {4, 6}, {5}, {3, 2, 2}, {1, 7}, {7, 1}, {8, 8}};
  const Layout layout = {{0, 1, 2}, {3, 4}, {5, 6}};
  const int start = 2, steps = 5;
  const double tol = fp32() ? 1e-4 : 1e-12;
  for (int64_t rank : {8, 1000}) {
    const uint64_t sd = seed(2) + rank;
    Gathered got = make_gathered(world(), steps);
    ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
      auto st = make_state(pg, options(rank, 0.0, start));
      auto hook = ddpx::hooks::powerSGD_hook(st);
      const auto params = make_params(shapes, dtype());
      for (int s = 0; s < steps; ++s) {
        got[r][s] = run_step(*hook, params, layout, grads_of(sd, s, r, shapes, dtype()));
        ASSERT_FALSE(got[r][s].empty());
      }
      // Everything is compressed (min_compression_rate 0), at rank min(n, m):
      // before = 24 + 24 + 5 + 12 + 7 + 7 + 64, after = 10*4 + 10*4 + 6*1 + 7*3 + 8*1 + 8*1 + 16*8.
      EXPECT_EQ(st->total_numel_before_compression(), 143 * (steps - start));
      EXPECT_EQ(st->total_numel_after_compression(), 251 * (steps - start));
    });
    double worst = 0;
    for (int s = start; s < steps; ++s) {
      for (size_t p = 0; p < shapes.size(); ++p) {
        const auto want =
            mean_of(sd, s, world(), static_cast<int>(p), numel_of(shapes[p]), dtype());
        const double e = rel_err(got[0][s][p], want.first);
        worst = std::max(worst, e);
        EXPECT_LE(e, tol) << label() << " rank " << rank << " step " << s << " parameter " << p
                          << " shape " << c10::IntArrayRef(shapes[p]);
      }
    }
    std::cout << "[ info ] " << label() << " matrix_approximation_rank " << rank
              << ": worst relative error vs the mean " << worst << std::endl;
    expect_replicas_equal(got, label());
  }
}

// ---- (c) error feedback ----------------------------------------------------------------------

// Each step, per rank and parameter: gradient + previous residual == result + new residual,
// elementwise to two roundings (err += grad; err -= result). The residual of a compressed matrix
// is far from zero at rank 1 (so the identity is not trivially met), and uncompressed tensors
// keep residual = local compensated value - mean.
TEST_P(PowerSGDTest, ErrorFeedbackConservesTheGradient) {
  // Compressed at rank 1, rate 2: {16,12} (28*2 < 192), {4,4,3} (n 4, m 12: 16*2 < 48).
  // Uncompressed: {12} (13*2 >= 12), {3,3} (6*2 >= 9), {20,1} (21*2 >= 20).
  const Shapes shapes = {{16, 12}, {12}, {4, 4, 3}, {3, 3}, {20, 1}};
  const Layout layout = {{0, 1}, {2, 3}, {4}};
  const int start = 2, steps = 6;
  const uint64_t sd = seed(3);
  Gathered got = make_gathered(world(), steps);
  ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
    auto st = make_state(pg, options(1, 2.0, start));
    auto hook = ddpx::hooks::powerSGD_hook(st);
    const auto params = make_params(shapes, dtype());
    for (int s = 0; s < steps; ++s) {
      const auto grads = grads_of(sd, s, r, shapes, dtype());
      std::vector<at::Tensor> before;
      for (size_t p = 0; p < shapes.size(); ++p) {
        before.push_back(residual(*st, static_cast<int>(p), numel_of(shapes[p])));
      }
      got[r][s] = run_step(*hook, params, layout, grads);
      ASSERT_FALSE(got[r][s].empty());
      if (s < start) {
        EXPECT_TRUE(st->error_memories().empty()) << "step " << s;
        continue;
      }
      EXPECT_EQ(st->error_memories().size(), shapes.size());
      for (size_t p = 0; p < shapes.size(); ++p) {
        const at::Tensor in = grads[p].to(at::kDouble), out = got[r][s][p].to(at::kDouble);
        const at::Tensor after = residual(*st, static_cast<int>(p), numel_of(shapes[p]));
        const at::Tensor gap = (in + before[p] - out - after).abs();
        const at::Tensor bound = 4 * u() * (in.abs() + before[p].abs() + out.abs());
        EXPECT_TRUE(at::all(gap <= bound).item<bool>())
            << label() << " rank " << r << " step " << s << " parameter " << p
            << ": gradient + residual != result + new residual, worst gap "
            << gap.max().item<double>();
        if (p == 0 || p == 2) {
          EXPECT_GT(after.norm().item<double>(), 1e-2 * in.norm().item<double>())
              << "parameter " << p << ": a rank-1 residual vanished";
        }
      }
    }
  });
  expect_replicas_equal(got, label());
}

// ---- (d) compression statistics ----------------------------------------------------------------

// torch's rule per matrix (n = shape[0], m = numel / n, r = min(n, m, rank)): compressed iff
// (n + m) * r * min_compression_rate < n * m; then (n + m) * r elements travel, else n * m.
// Batched: per bucket 2 * side * min(side, rank), side = ceil(sqrt(numel)). Counted on every
// compressed step, never before start_powerSGD_iter.
TEST_P(PowerSGDTest, CompressionStatsInClosedForm) {
  const Shapes shapes = {{16, 8}, {8}, {4, 3, 5}, {32, 32}, {2, 2}, {40, 6}};
  const Layout layout = {{0, 1, 2}, {3}, {4, 5}};
  // before: 128 + 8 + 60 + 1024 + 4 + 240 = 1464 for every configuration.
  struct Case {
    bool batched;
    int64_t rank;
    double rate;
    int64_t after;  // per step
  };
  const Case cases[] = {
      // {16,8} 24*2=48, 96 < 128: compressed | {8} 9*2 >= 8 | {4,3,5}: n 4, m 15, 19*2=38,
      // 76 >= 60 | {32,32} 64*2=128 | {2,2} 4*2=8, 16 >= 4 | {40,6} 46*2=92, 184 < 240.
      {false, 2, 2.0, 48 + 8 + 60 + 128 + 4 + 92},
      // rate 0: all compressed at r = 1: 24 + 9 + 19 + 64 + 4 + 46.
      {false, 1, 0.0, 24 + 9 + 19 + 64 + 4 + 46},
      // Buckets of 196 (side 14), 1024 (side 32), 244 (side 16).
      {true, 2, 2.0, 2 * 2 * (14 + 32 + 16)},
      {true, 1, 2.0, 2 * 1 * (14 + 32 + 16)},
  };
  const int start = 2, steps = 5;
  for (const Case& c : cases) {
    const std::string what = label() + (c.batched ? " batched" : " layer-wise") + " rank " +
                             std::to_string(c.rank) + " rate " + std::to_string(c.rate);
    ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
      auto st = make_state(pg, options(c.rank, c.rate, start));
      auto hook =
          c.batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
      const auto params = make_params(shapes, dtype());
      for (int s = 0; s < steps; ++s) {
        ASSERT_FALSE(
            run_step(*hook, params, layout, grads_of(seed(4), s, r, shapes, dtype())).empty());
        const int64_t k = std::max(0, s + 1 - start);  // compressed steps so far
        const auto stats = st->compression_stats();
        EXPECT_EQ(std::get<1>(stats), 1464 * k) << what << " step " << s;
        EXPECT_EQ(std::get<2>(stats), c.after * k) << what << " step " << s;
        EXPECT_DOUBLE_EQ(std::get<0>(stats), k ? 1464.0 / static_cast<double>(c.after) : 0.0)
            << what;
        EXPECT_EQ(st->total_numel_before_compression(), std::get<1>(stats));
        EXPECT_EQ(st->total_numel_after_compression(), std::get<2>(stats));
      }
    });
  }
}

// A whole compressed step that compressed nothing (every matrix below min_compression_rate) is
// said once, on every rank: the hook then costs its work and saves no byte.
TEST_P(PowerSGDTest, WarnsOnceWhenAStepCompressesNothing) {
  const Shapes shapes = {{16, 8}, {8}, {40, 6}};
  const Layout layout = {{0, 1}, {2}};
  class CaptureWarnings : public ddpx::compat::ScopedWarningHandler {
   public:
    void on_warning(const std::string& message) override { messages.push_back(message); }
    std::vector<std::string> messages;
  };
  for (const double rate : {1000.0, 2.0}) {
    ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
      auto st = make_state(pg, options(2, rate, 2));
      auto hook = ddpx::hooks::powerSGD_hook(st);
      const auto params = make_params(shapes, dtype());
      CaptureWarnings warnings;
      for (int s = 0; s < 5; ++s) {
        ASSERT_FALSE(
            run_step(*hook, params, layout, grads_of(seed(9), s, r, shapes, dtype())).empty());
      }
      if (rate > 100) {
        ASSERT_EQ(warnings.messages.size(), 1u) << label();
        EXPECT_THAT(warnings.messages[0], HasSubstr("no gradient of step 2 was compressed"));
      } else {
        EXPECT_TRUE(warnings.messages.empty()) << label();
      }
    });
  }
}

// ---- (e) iterations ----------------------------------------------------------------------------

// iter() grows by one per step, on the last bucket only, before and after start_powerSGD_iter;
// "Start to apply PowerSGD" is logged as torch's hook logs it (on every maybe_increase_iter call
// that leaves iter at start: the last bucket of step start - 1, then every other bucket of step
// start), compression stats every
// compression_stats_logging_frequency iterations from the first compressed step.
TEST_P(PowerSGDTest, CountsIterationsOncePerStep) {
  const Shapes shapes = {{12, 4}, {4}, {6, 6}};
  for (const Layout& layout : {Layout{{0}, {1}, {2}}, Layout{{0, 1, 2}}}) {
    for (bool batched : {false, true}) {
      const int start = 2, steps = 7;
      ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
        auto lines = std::make_shared<std::vector<std::string>>();
        PowerSGDOptions o = options(1, 2.0, start);
        o.compression_stats_logging_frequency = 2;
        auto st = make_state(pg, o, lines);
        auto hook =
            batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
        const auto params = make_params(shapes, dtype());
        for (int s = 0; s < steps; ++s) {
          ASSERT_FALSE(run_step(*hook, params, layout, grads_of(seed(5), s, r, shapes, dtype()),
                                [&](size_t b) {
                                  const bool last = b + 1 == layout.size();
                                  EXPECT_EQ(st->iter(), last ? s + 1 : s)
                                      << "step " << s << " after bucket " << b;
                                })
                           .empty());
        }
        EXPECT_EQ(st->iter(), steps);
        auto count = [&](const std::string& prefix) {
          return std::count_if(lines->begin(), lines->end(),
                               [&](const std::string& l) { return l.rfind(prefix, 0) == 0; });
        };
        EXPECT_EQ(count("PowerSGD config: matrix_approximation_rank = 1; start_powerSGD_iter = 2"),
                  1);
        const auto starts = static_cast<std::ptrdiff_t>(layout.size());
        EXPECT_EQ(count("Start to apply PowerSGD after 2 iterations."), starts);
        // Reported at iterations 2, 4 and 6.
        EXPECT_EQ(count("Compression stats: iter "), 3);
        EXPECT_EQ(count("Compression stats: iter 2,"), 1);
        EXPECT_EQ(count("Compression stats: iter 6,"), 1);
        EXPECT_EQ(st->next_stats_report(), 8);
        EXPECT_EQ(lines->size(), 4u + layout.size());
      });
    }
  }
}

// ---- (f) warm start -----------------------------------------------------------------------------

// The Q memory after a step is the allreduced Q / W; at the next step it is orthogonalised and
// reused: the result and the new Q follow from the memory and the compensated inputs in closed
// form (file comment). With warm_start = false Q is drawn afresh and the same prediction fails.
TEST_P(PowerSGDTest, WarmStartReusesTheAllreducedQ) {
  // Compressed at rank 2, rate 1: {12,10} (44 < 120), {10,12}, {9,3,2} (n 9, m 6: 30 < 54).
  // {7} (8 >= 7) is not.
  const Shapes shapes = {{12, 10}, {10, 12}, {9, 3, 2}, {7}};
  const Layout layout = {{0, 1}, {2, 3}};
  const int64_t rank = 2;
  const int start = 2, steps = 6;
  const double tol = fp32() ? 1e-4 : 1e-10;
  for (bool warm : {true, false}) {
    const uint64_t sd = seed(6) + warm;
    // [rank][step][param], fp64.
    Gathered compensated = make_gathered(world(), steps), q_before = make_gathered(world(), steps),
             q_after = make_gathered(world(), steps), got = make_gathered(world(), steps);
    ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
      PowerSGDOptions o = options(rank, 1.0, start);
      o.warm_start = warm;
      auto st = make_state(pg, o);
      auto hook = ddpx::hooks::powerSGD_hook(st);
      const auto params = make_params(shapes, dtype());
      for (int s = 0; s < steps; ++s) {
        const auto grads = grads_of(sd, s, r, shapes, dtype());
        for (int p = 0; p < 3; ++p) {
          compensated[r][s].push_back(grads[p].to(at::kDouble) +
                                      residual(*st, p, numel_of(shapes[p])));
          const auto memories = st->q_memories();
          auto it = memories.find(p);
          q_before[r][s].push_back(it == memories.end() ? at::Tensor()
                                                        : it->second.to(at::kDouble).clone());
        }
        got[r][s] = run_step(*hook, params, layout, grads);
        ASSERT_FALSE(got[r][s].empty());
        if (s < start) {
          EXPECT_TRUE(st->q_memories().empty());
          continue;
        }
        // One Q (m x r) per compressed matrix, none for {7}.
        ASSERT_EQ(st->q_memories().size(), 3u);
        const int64_t q_numel[] = {10 * rank, 12 * rank, 6 * rank};
        for (int p = 0; p < 3; ++p) {
          ASSERT_EQ(st->q_memories().at(p).numel(), q_numel[p]);
          q_after[r][s].push_back(st->q_memories().at(p).to(at::kDouble).clone());
        }
      }
    });
    if (HasFailure()) return;
    expect_replicas_equal(got, label());
    expect_replicas_equal(q_after, label() + " Q memory");
    double worst_out = 0, worst_q = 0;
    for (int s = start + 1; s < steps; ++s) {
      for (int p = 0; p < 3; ++p) {
        const auto nm = matrix_shape(shapes[p]);
        const int64_t n = nm.first, m = nm.second;
        // The memory read before step s is what step s-1 left.
        ASSERT_TRUE(bitwise_equal(q_before[0][s][p], q_after[0][s - 1][p]));
        const at::Tensor q_hat = orth(q_before[0][s][p].view({m, rank}));
        at::Tensor psum = at::zeros({n, rank}, at::kDouble);
        at::Tensor cbar = at::zeros({n, m}, at::kDouble);
        for (int r = 0; r < world(); ++r) {
          const at::Tensor c = compensated[r][s][p].view({n, m});
          psum += at::mm(c, q_hat);
          cbar += c / world();
        }
        const at::Tensor p_hat = orth(psum);
        const at::Tensor q_new = at::mm(cbar.t(), p_hat);
        const at::Tensor want = at::mm(p_hat, q_new.t());
        const double e_out = rel_err(got[0][s][p], want);
        const double e_q = rel_err(q_after[0][s][p].view({m, rank}), q_new);
        if (warm) {
          worst_out = std::max(worst_out, e_out);
          worst_q = std::max(worst_q, e_q);
          EXPECT_LE(e_out, tol) << label() << " step " << s << " parameter " << p;
          EXPECT_LE(e_q, tol) << label() << " step " << s << " parameter " << p << ": Q memory";
        } else {
          // A fresh random Q spans another subspace.
          EXPECT_GT(e_out, 1e-2) << label() << " step " << s << " parameter " << p
                                 << ": warm_start = false reused Q";
        }
      }
    }
    if (warm) {
      std::cout << "[ info ] " << label() << " warm start: worst relative error of the result "
                << worst_out << ", of Q " << worst_q << std::endl;
    }
  }
}

// ---- (g) batched_powerSGD_hook -----------------------------------------------------------------

// The whole bucket as one zero-padded side x side matrix: the result has the bucket's length,
// all replicas agree, error feedback holds per parameter, and the statistics are 2 * side * r.
TEST_P(PowerSGDTest, BatchedHookCompressesWholeBuckets) {
  const Shapes shapes = {{5, 3}, {7}, {2, 2, 2}};  // 30 elements
  struct Case {
    Layout layout;
    int64_t after;  // per step
  };
  // One bucket of 30 (side 6), or buckets of 22 (side 5) and 8 (side 3); rank 2.
  const Case cases[] = {{{{0, 1, 2}}, 2 * 6 * 2}, {{{0, 1}, {2}}, 2 * 5 * 2 + 2 * 3 * 2}};
  const int start = 2, steps = 5;
  for (const Case& c : cases) {
    const uint64_t sd = seed(7) + c.layout.size();
    Gathered got = make_gathered(world(), steps);
    ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
      auto st = make_state(pg, options(2, 2.0, start));
      auto hook = ddpx::hooks::batched_powerSGD_hook(st);
      EXPECT_EQ(hook->name(), "batched_powerSGD_hook");
      const auto params = make_params(shapes, dtype());
      for (int s = 0; s < steps; ++s) {
        const auto grads = grads_of(sd, s, r, shapes, dtype());
        std::vector<at::Tensor> before;
        for (size_t p = 0; p < shapes.size(); ++p) {
          before.push_back(residual(*st, static_cast<int>(p), numel_of(shapes[p])));
        }
        got[r][s] = run_step(*hook, params, c.layout, grads);
        ASSERT_FALSE(got[r][s].empty());
        if (s < start) continue;
        for (size_t p = 0; p < shapes.size(); ++p) {
          const at::Tensor in = grads[p].to(at::kDouble), out = got[r][s][p].to(at::kDouble);
          const at::Tensor after = residual(*st, static_cast<int>(p), numel_of(shapes[p]));
          const at::Tensor gap = (in + before[p] - out - after).abs();
          const at::Tensor bound = 4 * u() * (in.abs() + before[p].abs() + out.abs());
          EXPECT_TRUE(at::all(gap <= bound).item<bool>())
              << label() << " step " << s << " parameter " << p << ": worst gap "
              << gap.max().item<double>();
        }
      }
      EXPECT_EQ(st->total_numel_before_compression(), 30 * (steps - start));
      EXPECT_EQ(st->total_numel_after_compression(), c.after * (steps - start));
    });
    expect_replicas_equal(got, label() + " batched");
  }
}

// Exact when the rank covers the padded matrix's rank: a square bucket (36 = 6 x 6) at rank 6 (or
// more, clamped to the side), or 30 elements (one all-zero padding row: rank <= 5) at rank 5.
// (At rank 6 the 30-element bucket is NOT exact, in torch's hook as here: the sixth column of P
// is rounding noise inside the span of the first five, normalised to a unit vector.) Tolerances
// as in FullRankIsExactMean.
TEST_P(PowerSGDTest, BatchedHookAtFullRankIsExactMean) {
  const Shapes shapes30 = {{5, 3}, {7}, {2, 2, 2}};
  const Shapes shapes36 = {{5, 3}, {7}, {2, 2, 2}, {6}};
  struct Case {
    const Shapes* shapes;
    int64_t rank;
    int64_t after;  // per step: 2 * side * min(side, rank)
  };
  const Case cases[] = {
      {&shapes30, 5, 2 * 6 * 5}, {&shapes36, 6, 2 * 6 * 6}, {&shapes36, 100, 2 * 6 * 6}};
  const int start = 2, steps = 5;
  const double tol = fp32() ? 1e-4 : 1e-12;
  for (const Case& c : cases) {
    const Shapes& shapes = *c.shapes;
    Layout layout(1);
    for (size_t p = 0; p < shapes.size(); ++p) layout[0].push_back(static_cast<int>(p));
    const uint64_t sd = seed(8) + c.rank;
    Gathered got = make_gathered(world(), steps);
    ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
      auto st = make_state(pg, options(c.rank, 2.0, start));
      auto hook = ddpx::hooks::batched_powerSGD_hook(st);
      const auto params = make_params(shapes, dtype());
      for (int s = 0; s < steps; ++s) {
        got[r][s] = run_step(*hook, params, layout, grads_of(sd, s, r, shapes, dtype()));
        ASSERT_FALSE(got[r][s].empty());
      }
      EXPECT_EQ(st->total_numel_after_compression(), c.after * (steps - start));
    });
    double worst = 0;
    for (int s = start; s < steps; ++s) {
      for (size_t p = 0; p < shapes.size(); ++p) {
        const auto want =
            mean_of(sd, s, world(), static_cast<int>(p), numel_of(shapes[p]), dtype());
        const double e = rel_err(got[0][s][p], want.first);
        worst = std::max(worst, e);
        EXPECT_LE(e, tol) << label() << " " << shapes.size() << " params, rank " << c.rank
                          << " step " << s << " parameter " << p;
      }
    }
    std::cout << "[ info ] " << label() << " batched, " << shapes.size() << " params, rank "
              << c.rank << ": worst relative error vs the mean " << worst << std::endl;
    expect_replicas_equal(got, label() + " batched");
  }
}

// ---- (h) checkpoints ---------------------------------------------------------------------------

// Three copies of one training run on every rank, from step K on:
//   A: the uninterrupted state, layout X throughout;
//   C: the uninterrupted state, buckets rebuilt into layout Y at step K (memories follow their
//      parameters into the new layout);
//   B: a new state, load()ed from A.save() at step K, new parameter tensors, layout Y (the
//      parameters first appear in the same order as in A's first step).
// B continues bit for bit as C (same arithmetic, same collective layout). B also matches A bit
// for bit on up to 2 ranks; on 3+ ranks Gloo's ring sums an element in an order that depends on
// its position in the collective's buffer, so A (layout X) agrees to rounding only.
TEST_P(PowerSGDTest, CheckpointContinuesBitForBitInAnotherLayout) {
  // Compressed at rank 2, rate 1: {10,6}, {4,5}, {8,8}; {6} and {3} travel uncompressed.
  const Shapes shapes = {{10, 6}, {6}, {4, 5}, {8, 8}, {3}};
  const Layout x = {{0, 1, 2}, {3, 4}};
  const Layout y = {{0, 1}, {2, 3, 4}};
  const int k_steps = 4, steps = 7;
  const uint64_t sd = seed(9);
  const double tol = fp32() ? 1e-4 : 1e-10;
  ddpx_test::run_ranks(world(), [&](int r, const ProcessGroupPtr& pg) {
    const PowerSGDOptions o = options(2, 1.0, 2);
    auto st_a = make_state(pg, o), st_c = make_state(pg, o);
    auto hook_a = ddpx::hooks::powerSGD_hook(st_a), hook_c = ddpx::hooks::powerSGD_hook(st_c);
    const auto params_a = make_params(shapes, dtype()), params_c = make_params(shapes, dtype());
    for (int s = 0; s < k_steps; ++s) {
      const auto grads = grads_of(sd, s, r, shapes, dtype());
      const auto out_a = run_step(*hook_a, params_a, x, grads);
      const auto out_c = run_step(*hook_c, params_c, x, grads);
      ASSERT_FALSE(out_a.empty() || out_c.empty());
      for (size_t p = 0; p < shapes.size(); ++p) ASSERT_TRUE(bitwise_equal(out_a[p], out_c[p]));
    }
    const std::vector<char> bytes = st_a->save();
    // Constructed with other options: load() restores the checkpoint's.
    auto st_b = make_state(pg, PowerSGDOptions{});
    st_b->load(bytes);
    EXPECT_EQ(st_b->options().matrix_approximation_rank, 2);
    EXPECT_EQ(st_b->options().min_compression_rate, 1.0);
    EXPECT_EQ(st_b->options().start_powerSGD_iter, 2);
    EXPECT_EQ(st_b->iter(), k_steps);
    EXPECT_EQ(st_b->compression_stats(), st_a->compression_stats());
    // The memories wait, per parameter key, for the new model's buckets.
    const auto dict = st_b->state_dict();
    EXPECT_EQ(dict.at("error").toGenericDict().size(), shapes.size());
    EXPECT_EQ(dict.at("q").toGenericDict().size(), 3u);
    auto hook_b = ddpx::hooks::powerSGD_hook(st_b);
    const auto params_b = make_params(shapes, dtype());
    for (int s = k_steps; s < steps; ++s) {
      const auto grads = grads_of(sd, s, r, shapes, dtype());
      const auto out_a = run_step(*hook_a, params_a, x, grads);
      const auto out_c = run_step(*hook_c, params_c, y, grads);
      const auto out_b = run_step(*hook_b, params_b, y, grads);
      ASSERT_FALSE(out_a.empty() || out_b.empty() || out_c.empty());
      for (size_t p = 0; p < shapes.size(); ++p) {
        EXPECT_TRUE(bitwise_equal(out_b[p], out_c[p]))
            << label() << " rank " << r << " step " << s << " parameter " << p
            << ": restored state != rebuilt uninterrupted state, relative difference "
            << rel_err(out_b[p], out_c[p]);
        if (world() <= 2) {
          EXPECT_TRUE(bitwise_equal(out_b[p], out_a[p]))
              << label() << " rank " << r << " step " << s << " parameter " << p
              << ": restored state != uninterrupted state, relative difference "
              << rel_err(out_b[p], out_a[p]);
        } else {
          EXPECT_LE(rel_err(out_b[p], out_a[p]), tol)
              << label() << " rank " << r << " step " << s << " parameter " << p;
        }
      }
    }
    EXPECT_EQ(st_b->iter(), steps);
    EXPECT_EQ(st_b->compression_stats(), st_a->compression_stats());
    for (int p = 0; p < static_cast<int>(shapes.size()); ++p) {
      EXPECT_TRUE(bitwise_equal(st_b->error_memories().at(p), st_c->error_memories().at(p)))
          << "error memory of parameter " << p;
    }
    for (int p : {0, 2, 3}) {
      EXPECT_TRUE(bitwise_equal(st_b->q_memories().at(p), st_c->q_memories().at(p)))
          << "Q memory of parameter " << p;
    }
  });
}

// A state saved at step `k_steps` of `steps` and load()ed into a new state with new parameter
// tensors and the same layout continues bit for bit as the uninterrupted state (same collective
// layout, so on any number of ranks). Returns the number of differing parameter results.
int checkpoint_mismatches(int world, at::ScalarType dtype, const Shapes& shapes, const Layout& x,
                          const PowerSGDOptions& o, bool batched, int k_steps, int steps,
                          uint64_t sd, const std::string& what) {
  std::vector<int> mismatches(world, 0);
  ddpx_test::run_ranks(world, [&](int r, const ProcessGroupPtr& pg) {
    auto st_a = make_state(pg, o);
    auto hook_a =
        batched ? ddpx::hooks::batched_powerSGD_hook(st_a) : ddpx::hooks::powerSGD_hook(st_a);
    const auto params_a = make_params(shapes, dtype);
    for (int s = 0; s < k_steps; ++s) {
      ASSERT_FALSE(run_step(*hook_a, params_a, x, grads_of(sd, s, r, shapes, dtype)).empty());
    }
    auto st_b = make_state(pg, PowerSGDOptions{});
    st_b->load(st_a->save());
    auto hook_b =
        batched ? ddpx::hooks::batched_powerSGD_hook(st_b) : ddpx::hooks::powerSGD_hook(st_b);
    const auto params_b = make_params(shapes, dtype);
    for (int s = k_steps; s < steps; ++s) {
      const auto grads = grads_of(sd, s, r, shapes, dtype);
      const auto out_a = run_step(*hook_a, params_a, x, grads);
      const auto out_b = run_step(*hook_b, params_b, x, grads);
      ASSERT_FALSE(out_a.empty() || out_b.empty());
      for (size_t p = 0; p < shapes.size(); ++p) {
        if (bitwise_equal(out_b[p], out_a[p])) continue;
        ++mismatches[r];
        ADD_FAILURE() << what << " rank " << r << " step " << s << " parameter " << p
                      << ": restored != uninterrupted, relative difference "
                      << rel_err(out_b[p], out_a[p]);
      }
    }
  });
  int total = 0;
  for (int m : mismatches) total += m;
  return total;
}

// Without warm start every step draws Q from the state's generator: a checkpoint must carry the
// generator's position (and, taken before start_powerSGD_iter, nothing else). Layer-wise with
// and without warm start, saved before and after compression starts; batched without error
// feedback after it starts (its Q memory), with error feedback before it starts (see
// BatchedCheckpointKeepsThePaddingResidual for after).
TEST_P(PowerSGDTest, CheckpointRestoresTheGenerator) {
  // Buckets of 86 (side 10) and 67 (side 9) elements: both zero-padded when batched.
  const Shapes shapes = {{10, 6}, {6}, {4, 5}, {8, 8}, {3}};
  const Layout x = {{0, 1, 2}, {3, 4}};
  for (bool batched : {false, true}) {
    for (bool warm : {false, true}) {
      for (int k_steps : {1, 3}) {
        PowerSGDOptions o = options(1, 1.0, 2);
        o.warm_start = warm;
        o.random_seed = 12345;
        const std::string what = label() + (batched ? " batched" : " layer-wise") + " warm_start " +
                                 std::to_string(warm) + " error_feedback " +
                                 std::to_string(o.use_error_feedback) + " saved at " +
                                 std::to_string(k_steps);
        EXPECT_EQ(checkpoint_mismatches(world(), dtype(), shapes, x, o, batched, k_steps, 6,
                                        seed(10) + k_steps, what),
                  0)
            << what;
      }
    }
  }
}

// batched_powerSGD_hook with error feedback keeps the residual of the whole zero-padded
// side x side matrix (like torch's error_dict[bucket_index]), and the padding's share is nonzero
// (the low-rank result is nonzero there): a checkpoint must carry it (batched_error_pad) for the
// restored state to continue bit for bit.
TEST_P(PowerSGDTest, BatchedCheckpointKeepsThePaddingResidual) {
  const Shapes shapes = {{10, 6}, {6}, {4, 5}, {8, 8}, {3}};  // buckets of 86 and 67: padded
  const Layout x = {{0, 1, 2}, {3, 4}};
  for (bool warm : {false, true}) {
    PowerSGDOptions o = options(1, 1.0, 2);
    o.warm_start = warm;
    const std::string what = label() + " batched warm_start " + std::to_string(warm);
    EXPECT_EQ(checkpoint_mismatches(world(), dtype(), shapes, x, o, true, 3, 6, seed(11), what), 0)
        << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Gloo, PowerSGDTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(at::kFloat, at::kDouble)),
                         param_name);

// ---- (i) errors --------------------------------------------------------------------------------

TEST(PowerSGDErrors, OptionsAreValidated) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  auto state_with = [&](const std::function<void(PowerSGDOptions&)>& edit) {
    return [&pg, edit] {
      PowerSGDOptions o;
      edit(o);
      make_state(pg, o);
    };
  };
  EXPECT_THAT(value_error(state_with([](PowerSGDOptions& o) { o.matrix_approximation_rank = 0; })),
              HasSubstr("matrix_approximation_rank must be >= 1, got 0"));
  EXPECT_THAT(value_error(state_with([](PowerSGDOptions& o) { o.min_compression_rate = -1; })),
              HasSubstr("min_compression_rate must be >= 0, got -1"));
  EXPECT_THAT(
      value_error(state_with([](PowerSGDOptions& o) { o.orthogonalization_epsilon = -1e-8; })),
      HasSubstr("orthogonalization_epsilon must be >= 0"));
  EXPECT_THAT(value_error(state_with([](PowerSGDOptions& o) { o.random_seed = -1; })),
              HasSubstr("random_seed must be between 0 and 2**32 - 1"));
  EXPECT_THAT(value_error(state_with([](PowerSGDOptions& o) { o.random_seed = 1ll << 32; })),
              HasSubstr("random_seed"));
  // torch's condition and text: error feedback or warm start need start_powerSGD_iter > 1.
  const char* kStartMessage =
      "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled";
  EXPECT_THAT(value_error(state_with([](PowerSGDOptions& o) { o.start_powerSGD_iter = 1; })),
              HasSubstr(kStartMessage));
  EXPECT_THAT(value_error(state_with([](PowerSGDOptions& o) {
                o.start_powerSGD_iter = 1;
                o.warm_start = false;
              })),
              HasSubstr(kStartMessage));
  EXPECT_THAT(value_error(state_with([](PowerSGDOptions& o) {
                o.start_powerSGD_iter = 0;
                o.use_error_feedback = false;
              })),
              HasSubstr(kStartMessage));
  // Neither memory: compression may start at once.
  EXPECT_NO_THROW(state_with([](PowerSGDOptions& o) {
    o.start_powerSGD_iter = 1;
    o.use_error_feedback = false;
    o.warm_start = false;
  })());
  // set_options validates too and keeps the old options on error.
  auto st = make_state(pg, options(3, 2.0, 10));
  PowerSGDOptions bad = st->options();
  bad.matrix_approximation_rank = -2;
  EXPECT_THAT(value_error([&] { st->set_options(bad); }),
              HasSubstr("matrix_approximation_rank must be >= 1, got -2"));
  EXPECT_EQ(st->options().matrix_approximation_rank, 3);
}

TEST(PowerSGDErrors, NullArgumentsAreRejected) {
  EXPECT_THROW(make_state(ProcessGroupPtr(), PowerSGDOptions{}), c10::TypeError);
  EXPECT_THAT(ddpx_test::error_message([] { ddpx::hooks::powerSGD_hook(nullptr); }),
              HasSubstr("powerSGD_hook: state must be a PowerSGDState"));
  EXPECT_THAT(ddpx_test::error_message([] { ddpx::hooks::batched_powerSGD_hook(nullptr); }),
              HasSubstr("batched_powerSGD_hook: state must be a PowerSGDState"));
}

// An integer bucket is refused before any collective, both hooks, before and after
// start_powerSGD_iter; a bucket left pending by the previous runHook still completes.
TEST(PowerSGDErrors, IntegerBucketIsRejected) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  for (bool batched : {false, true}) {
    for (int64_t start : {2, 1000}) {
      auto st = make_state(pg, options(1, 0.0, start));
      st->set_iter(2);
      CommHookPtr hook =
          batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
      const auto params = make_params({{4, 4}, {3}}, at::kFloat);
      at::Tensor first = ddpx_test::make_tensor(ddpx_test::random_values(1, 16), at::kFloat);
      auto b0 = ddpx_test::make_bucket(first, {params[0]}, 0, 2);
      FuturePtr f0 = hook->runHook(b0->get());
      at::Tensor ints = at::arange(1, 4, at::kInt);
      auto b1 = ddpx_test::make_bucket(ints, {params[1]}, 1, 2);
      EXPECT_THAT(ddpx_test::error_message([&] { hook->runHook(b1->get()); }),
                  AllOf(HasSubstr(hook->name()), HasSubstr("floating-point")));
      f0->wait();
      EXPECT_FALSE(f0->hasError()) << f0->tryRetrieveErrorMessage();
      EXPECT_FALSE(st->round_two_pending()) << "round two of bucket 0 was not issued";
    }
  }
}

// After one whole step, a parameter the state has not seen means another model reached it.
TEST(PowerSGDErrors, StateOfAnotherModelIsRejected) {
  for (int world : {1, 2}) {
    ddpx_test::run_ranks(world, [&](int r, const ProcessGroupPtr& pg) {
      for (bool batched : {false, true}) {
        auto st = make_state(pg, options(1, 2.0, 2));
        CommHookPtr hook =
            batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
        const Shapes shapes = {{6, 5}, {5}};
        const auto model_a = make_params(shapes, at::kFloat);
        const auto model_b = make_params(shapes, at::kFloat);
        // Parameters first seen in the second bucket of the first step are the same model.
        for (int s = 0; s < 3; ++s) {
          ASSERT_FALSE(
              run_step(*hook, model_a, {{0}, {1}}, grads_of(11, s, r, shapes, at::kFloat)).empty());
        }
        at::Tensor buffer = ddpx_test::make_tensor(ddpx_test::random_values(2, 30), at::kFloat);
        auto bucket = ddpx_test::make_bucket(buffer, {model_b[0]}, 0, 2);
        const std::string msg = value_error([&] { hook->runHook(bucket->get()); });
        EXPECT_THAT(msg, AllOf(HasSubstr(hook->name()), HasSubstr("another DDP model")));
        // The first model still works with the same state.
        EXPECT_FALSE(
            run_step(*hook, model_a, {{0}, {1}}, grads_of(11, 3, r, shapes, at::kFloat)).empty());
      }
    });
  }
}

// Memories keyed by raw TensorImpl addresses held without a reference would be wrong: once a
// model is freed, a new model's parameters can take the same addresses, and the old model's
// error feedback and Q factors would then be silently applied to them. A state whose model is
// gone must refuse a new model as it refuses any other one.
TEST(PowerSGDErrors, ParametersAtAFreedModelsAddressesAreANewModel) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  for (bool batched : {false, true}) {
    auto st = make_state(pg, options(1, 2.0, 2));
    CommHookPtr hook =
        batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
    const Shapes shapes = {{6, 5}, {5}};
    std::set<const void*> old_addresses;
    {
      const auto model_a = make_params(shapes, at::kFloat);
      for (int s = 0; s < 3; ++s) {
        ASSERT_FALSE(
            run_step(*hook, model_a, {{0}, {1}}, grads_of(11, s, 0, shapes, at::kFloat)).empty());
      }
      for (const auto& p : model_a) old_addresses.insert(p.unsafeGetTensorImpl());
    }  // model A is freed here
    // Tensors of A's shapes: the allocator hands freed blocks out again, so one may land on an
    // address of A's (without pinning, the first one does). Any that does must be refused. (The
    // state pins the addresses it keys, so none lands there.)
    std::vector<at::Tensor> candidates;
    int reused = 0;
    for (int i = 0; i < 4096; ++i) {
      candidates.push_back(at::zeros(shapes[0], at::kFloat));
      if (!old_addresses.count(candidates.back().unsafeGetTensorImpl())) continue;
      ++reused;
      at::Tensor buffer = ddpx_test::make_tensor(ddpx_test::random_values(2, 30), at::kFloat);
      auto bucket = ddpx_test::make_bucket(buffer, {candidates.back()}, 0, 2);
      EXPECT_THAT(value_error([&] { hook->runHook(bucket->get()); }),
                  HasSubstr("another DDP model"))
          << "batched " << batched << ": a tensor at a freed parameter's address was accepted";
    }
    // The state pins the addresses it keys: none was handed out again.
    EXPECT_EQ(reused, 0) << "batched " << batched;
  }
}

// The options are settable mid-run, as torch's attributes are, and must apply at the next step:
// a cached bucket layout is rebuilt when they change (reused as it was, a new rank or
// min_compression_rate would keep the old layout's values, and turning use_error_feedback on
// would make every later step fail with a buffer mismatch).
TEST(PowerSGDOptionsMidRun, ApplyAtTheNextStep) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  const Shapes shapes = {{40, 30}, {30}, {20, 25}};
  const Layout layout = {{0, 1}, {2}};
  for (bool batched : {false, true}) {
    auto st = make_state(pg, options(1, 2.0, 2));
    CommHookPtr hook =
        batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
    const auto params = make_params(shapes, at::kFloat);
    int step = 0;
    // Elements sent by one step: the growth of total_numel_after_compression.
    auto sent_by_step = [&] {
      const int64_t before = st->total_numel_after_compression();
      EXPECT_FALSE(
          run_step(*hook, params, layout, grads_of(3, step, 0, shapes, at::kFloat)).empty())
          << "step " << step;
      ++step;
      return st->total_numel_after_compression() - before;
    };
    for (int i = 0; i < 3; ++i) sent_by_step();
    // Layer-wise: (40 + 30) r + 30 + (20 + 25) r; batched: buckets of 1230 and 500 elements as
    // 36 x 36 and 23 x 23 matrices, 2 * side * r each.
    auto expected = [&](int64_t r) {
      return batched ? 2 * (36 + 23) * r : (40 + 30) * r + 30 + (20 + 25) * r;
    };
    EXPECT_EQ(sent_by_step(), expected(1)) << "batched " << batched;

    PowerSGDOptions o = st->options();
    o.matrix_approximation_rank = 2;
    st->set_options(o);
    EXPECT_EQ(sent_by_step(), expected(2)) << "batched " << batched << ": the new rank was ignored";
    if (!batched) {
      EXPECT_EQ(st->q_memories().at(0).numel(), 30 * 2);
      EXPECT_EQ(st->q_memories().at(2).numel(), 25 * 2);
      EXPECT_EQ(st->p_memories().at(0).numel(), 40 * 2);
      EXPECT_EQ(st->p_memories().at(2).numel(), 20 * 2);
      // Nothing worth compressing at rate 100: everything travels as it is.
      o.min_compression_rate = 100;
      st->set_options(o);
      EXPECT_EQ(sent_by_step(), 40 * 30 + 30 + 20 * 25) << "min_compression_rate was ignored";
    }
  }
}

TEST(PowerSGDOptionsMidRun, ErrorFeedbackTurnedOnAndOff) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  const Shapes shapes = {{40, 30}, {20, 25}};
  const Layout layout = {{0}, {1}};
  for (bool batched : {false, true}) {
    PowerSGDOptions o = options(1, 2.0, 2);
    o.use_error_feedback = false;
    o.warm_start = false;
    auto st = make_state(pg, o);
    CommHookPtr hook =
        batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
    const auto params = make_params(shapes, at::kFloat);
    int step = 0;
    auto run = [&] {
      auto grads = grads_of(5, step, 0, shapes, at::kFloat);
      auto out = run_step(*hook, params, layout, grads);
      ++step;
      return std::make_pair(grads, out);
    };
    for (int i = 0; i < 3; ++i) ASSERT_FALSE(run().second.empty());
    EXPECT_TRUE(st->error_memories().empty());
    o.use_error_feedback = true;
    st->set_options(o);
    // On one rank, the first step with error feedback leaves input = output + residual.
    for (int i = 0; i < 2; ++i) {
      const auto [grads, out] = run();
      ASSERT_FALSE(out.empty()) << "batched " << batched << ": a step failed after turning "
                                << "use_error_feedback on";
      if (i > 0) break;
      const auto residuals = st->error_memories();
      for (size_t p = 0; p < shapes.size(); ++p) {
        ASSERT_TRUE(residuals.count(static_cast<int64_t>(p))) << "no residual for " << p;
        const at::Tensor back = out[p].to(at::kDouble) +
                                residuals.at(static_cast<int64_t>(p)).reshape({-1}).to(at::kDouble);
        EXPECT_TRUE(at::allclose(back, grads[p].reshape({-1}).to(at::kDouble), 1e-5, 1e-6))
            << "batched " << batched << " parameter " << p;
      }
    }
    o.use_error_feedback = false;
    st->set_options(o);
    EXPECT_FALSE(run().second.empty());
  }
}

// After a step with a NaN gradient, the memories (error feedback, warm-start Q) hold
// NaN and every later step's result is NaN, as with torch's hook; clear_memories() is the way
// out: the next step is finite again.
TEST(PowerSGDNonFinite, ClearMemoriesRecoversFromANaNStep) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  const Shapes shapes = {{40, 30}, {20, 25}};
  const Layout layout = {{0}, {1}};
  for (bool batched : {false, true}) {
    auto st = make_state(pg, options(1, 2.0, 2));
    CommHookPtr hook =
        batched ? ddpx::hooks::batched_powerSGD_hook(st) : ddpx::hooks::powerSGD_hook(st);
    const auto params = make_params(shapes, at::kFloat);
    auto all_finite = [](const std::vector<at::Tensor>& out) {
      bool ok = !out.empty();
      for (const auto& t : out) ok = ok && at::isfinite(t).all().item<bool>();
      return ok;
    };
    int step = 0;
    for (; step < 3; ++step) {
      ASSERT_TRUE(
          all_finite(run_step(*hook, params, layout, grads_of(4, step, 0, shapes, at::kFloat))));
    }
    auto bad = grads_of(4, step++, 0, shapes, at::kFloat);
    bad[0].view({-1})[7] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_FALSE(all_finite(run_step(*hook, params, layout, bad)));
    // The NaN stays in the memories: the next, finite gradients still come back non-finite.
    EXPECT_FALSE(
        all_finite(run_step(*hook, params, layout, grads_of(4, step++, 0, shapes, at::kFloat))))
        << "batched " << batched;
    st->clear_memories();
    EXPECT_TRUE(st->error_memories().empty() && st->q_memories().empty());
    EXPECT_TRUE(
        all_finite(run_step(*hook, params, layout, grads_of(4, step++, 0, shapes, at::kFloat))))
        << "batched " << batched << ": still non-finite after clear_memories()";
    // Cleared memories must not come back as "valid" ones when a layout is rebuilt (here by a
    // new min_compression_rate with the same compression decisions): zero Q factors would
    // make every compressed result zero.
    st->clear_memories();
    PowerSGDOptions o = st->options();
    o.min_compression_rate = 1.9;
    st->set_options(o);
    const auto out = run_step(*hook, params, layout, grads_of(4, step++, 0, shapes, at::kFloat));
    ASSERT_TRUE(all_finite(out));
    EXPECT_GT(out[0].abs().max().item<float>(), 0.0f)
        << "batched " << batched << ": a compressed result is all zeros after clear_memories()";
  }
}

// The config record prints booleans as torch's does (True/False), not 1/0.
TEST(PowerSGDState, ConfigRecordLikeTorchs) {
  auto lines = std::make_shared<std::vector<std::string>>();
  PowerSGDOptions o = options(1, 2.0, 2);
  o.warm_start = false;
  auto st = make_state(ddpx_test::shared_gloo_world(1)[0], o, lines);
  ASSERT_EQ(lines->size(), 1u);
  EXPECT_THAT(lines->front(), AllOf(HasSubstr("use_error_feedback = True; warm_start = False;"),
                                    HasSubstr("batch_tensors_with_same_shape = False")));
}

TEST(PowerSGDErrors, CheckpointMisuseIsRejected) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  auto st = make_state(pg, options(1, 0.0, 2));
  st->set_iter(5);
  auto hook = ddpx::hooks::powerSGD_hook(st);
  const auto params = make_params({{4, 4}, {3}}, at::kFloat);
  // Between two buckets of a step the first bucket's round two is still to be issued.
  at::Tensor first = ddpx_test::make_tensor(ddpx_test::random_values(3, 16), at::kFloat);
  auto b0 = ddpx_test::make_bucket(first, {params[0]}, 0, 2);
  FuturePtr f0 = hook->runHook(b0->get());
  EXPECT_THAT(ddpx_test::error_message([&] { st->save(); }), HasSubstr("during backward"));
  at::Tensor second = ddpx_test::make_tensor(ddpx_test::random_values(4, 3), at::kFloat);
  auto b1 = ddpx_test::make_bucket(second, {params[1]}, 1, 2);
  FuturePtr f1 = hook->runHook(b1->get());
  f0->wait();
  f1->wait();
  EXPECT_NO_THROW(st->save());

  auto fresh = make_state(pg, PowerSGDOptions{});
  EXPECT_THAT(value_error([&] { fresh->load(torch::jit::pickle_save(c10::IValue(int64_t{3}))); }),
              HasSubstr("not a ddpx PowerSGDState checkpoint"));
  c10::impl::GenericDict partial(c10::StringType::get(), c10::AnyType::get());
  partial.insert("format", std::string("ddpx.PowerSGDState/1"));
  EXPECT_THAT(value_error([&] { fresh->load_state_dict(partial); }), HasSubstr("missing key"));
  c10::impl::GenericDict foreign(c10::StringType::get(), c10::AnyType::get());
  foreign.insert("format", std::string("something else"));
  EXPECT_THAT(value_error([&] { fresh->load_state_dict(foreign); }),
              HasSubstr("not a ddpx PowerSGDState checkpoint"));
}

// A checkpoint whose error memory does not have its parameter's size (a corrupt checkpoint, or
// one saved for a model with other shapes) must not be accepted silently with its error feedback
// dropped. Q memories may legitimately be dropped (the rank changed); an error
// memory always has its parameter's size. Strict by default: the first step raises, naming the
// parameter and both sizes; load_state_dict(d, /*strict=*/false) keeps the old lenient load.
TEST(PowerSGDErrors, CheckpointForOtherShapesIsRejectedUnlessLenient) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  const Layout layout = {{0, 1}};
  auto saved = make_state(pg, options(1, 2.0, 2));
  {
    auto hook = ddpx::hooks::powerSGD_hook(saved);
    const Shapes shapes = {{8, 6}, {6}};
    const auto params = make_params(shapes, at::kFloat);
    for (int s = 0; s < 4; ++s) {
      ASSERT_FALSE(run_step(*hook, params, layout, grads_of(9, s, 0, shapes, at::kFloat)).empty());
    }
  }
  const auto checkpoint = saved->state_dict();
  const Shapes other = {{8, 5}, {6}};  // parameter 0 has 40 elements, not 48
  for (bool strict : {true, false}) {
    auto st = make_state(pg, PowerSGDOptions{});
    st->load_state_dict(checkpoint, strict);
    auto hook = ddpx::hooks::powerSGD_hook(st);
    const auto params = make_params(other, at::kFloat);
    const auto grads = grads_of(9, 4, 0, other, at::kFloat);
    at::Tensor buffer = at::cat({grads[0].reshape({-1}), grads[1].reshape({-1})});
    auto bucket = ddpx_test::make_bucket(buffer, params, 0, 1);
    if (strict) {
      EXPECT_THAT(value_error([&] { hook->runHook(bucket->get()); }),
                  AllOf(HasSubstr("parameter 0"), HasSubstr("48"), HasSubstr("[8, 5]"),
                        HasSubstr("strict=False")));
    } else {
      FuturePtr f = hook->runHook(bucket->get());
      f->wait();
      EXPECT_FALSE(f->hasError()) << f->tryRetrieveErrorMessage();
    }
  }
}

// Error-feedback memories are one rank's own: a checkpoint that says another rank (or a world of
// another size) saved them is refused with what to do instead, unless allow_reshard; one that
// records no rank (an older ddpx's) loads as it is.
TEST(PowerSGDErrors, CheckpointOfAnotherRankIsRejectedUnlessResharding) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  auto saved = make_state(pg, options(1, 2.0, 2));
  {
    auto hook = ddpx::hooks::powerSGD_hook(saved);
    const Shapes shapes = {{8, 6}, {6}};
    const auto params = make_params(shapes, at::kFloat);
    for (int s = 0; s < 4; ++s) {
      ASSERT_FALSE(
          run_step(*hook, params, {{0, 1}}, grads_of(9, s, 0, shapes, at::kFloat)).empty());
    }
  }
  const auto own = saved->state_dict();
  EXPECT_EQ(own.at("rank").toInt(), 0);
  EXPECT_EQ(own.at("world_size").toInt(), 1);
  ASSERT_FALSE(own.at("error").toGenericDict().empty());
  EXPECT_NO_THROW(make_state(pg, PowerSGDOptions{})->load_state_dict(own));

  c10::impl::GenericDict other = own.copy();
  other.insert_or_assign("rank", int64_t{1});
  other.insert_or_assign("world_size", int64_t{2});
  EXPECT_THAT(value_error([&] { make_state(pg, PowerSGDOptions{})->load_state_dict(other); }),
              AllOf(HasSubstr("saved by rank 1 of 2, and this is rank 0 of 1"),
                    HasSubstr("one file per rank"), HasSubstr("allow_reshard=True")));
  EXPECT_NO_THROW(make_state(pg, PowerSGDOptions{})
                      ->load_state_dict(other, /*strict=*/true, /*allow_reshard=*/true));

  c10::impl::GenericDict older = own.copy();
  static_cast<void>(older.erase("rank"));
  static_cast<void>(older.erase("world_size"));
  EXPECT_NO_THROW(make_state(pg, PowerSGDOptions{})->load_state_dict(older));
}

// Wrong value types in a checkpoint must not reach an internal assert ("please report a bug to
// PyTorch"): a TypeError naming the key instead.
TEST(PowerSGDErrors, CheckpointValuesOfTheWrongTypeNameTheKey) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  const auto good = make_state(pg, options(1, 2.0, 2))->state_dict();
  const std::vector<std::pair<std::string, c10::IValue>> bad = {
      {"iter", c10::IValue(std::string("5"))},
      {"matrix_approximation_rank", c10::IValue(1.5)},
      {"use_error_feedback", c10::IValue(int64_t{1})},
      {"rng", c10::IValue(int64_t{0})},
      {"error", c10::IValue(int64_t{0})},
      {"min_compression_rate", c10::IValue(std::string("2"))},
  };
  for (const auto& kv : bad) {
    c10::impl::GenericDict d = good.copy();
    d.insert_or_assign(kv.first, kv.second);
    auto st = make_state(pg, PowerSGDOptions{});
    const std::string msg = ddpx_test::error_message([&] { st->load_state_dict(d); });
    EXPECT_THAT(msg, AllOf(HasSubstr("'" + kv.first + "'"), ::testing::Not(HasSubstr("PyTorch"))))
        << kv.first;
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  // Rank threads are the parallelism here; intra-op threads would only oversubscribe.
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
