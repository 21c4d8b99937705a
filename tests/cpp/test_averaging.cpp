// Tests of post-local SGD on real Gloo process groups (1 to 4 ranks as threads over one in-memory
// c10d::HashStore, see test_utils.h):
//   * ddpx::comm::average_parameters: closed-form means for every floating dtype and mixed dtypes,
//     in place, non-contiguous tensors, tensors larger than a bucket, many small tensors, stats;
//   * PeriodicModelAverager / HierarchicalModelAverager: which steps average over which group;
//   * PostLocalSGDState / PostLocalSGDHook: global then subgroup averaging, iteration counting,
//     state_dict round trips;
//   * PostLocalSGDOptimizer over torch::optim::SGD: step + averaging, save/load, zero_grad;
//   * DiLoCo (Streaming, quantized outer gradients): agreement of the global parameters, resume.
//
// Expected values are closed forms. Where a mean is checked on 3 or 4 ranks, rank r's input is
// n * v_r with v_r a small multiple of 1/4: x / n is then exact and every sum of the v_r is exact
// in every dtype (bf16 included), whatever order the group sums in, so the mean sum_r v_r is
// checked bit for bit. On 2 ranks random values are checked bit for bit too: a/2 + b/2 is exact
// in any dtype that can hold a and b, so the result is (a + b) / 2 rounded once to the dtype.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <ddpx/comm/average.h>
#include <ddpx/comm/bucketed.h>
#include <ddpx/hooks.h>
#include <ddpx/hooks/post_localsgd_hook.h>
#include <ddpx/optim/averagers.h>
#include <ddpx/optim/diloco.h>
#include <ddpx/optim/post_localsgd_optimizer.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <utility>
#include <vector>

#include "test_utils.h"

namespace {

using ddpx_test::bitwise_equal;
using ddpx_test::ProcessGroupPtr;
using ddpx_test::value_error;
using ::testing::AllOf;
using ::testing::HasSubstr;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

// ---- values ----------------------------------------------------------------------------------

// v_r for element i: a multiple of 1/4 in [-2, 2], different on every rank (13 r mod 17).
double dyadic_v(int salt, int rank, int64_t i) {
  const int64_t k = (static_cast<int64_t>(salt) * 31 + i * 7 + rank * 13) % 17;
  return static_cast<double>(k - 8) / 4.0;
}

// Rank `rank`'s input n * v_r in a world of n.
std::vector<double> dyadic_input(int salt, int rank, int n, int64_t numel) {
  std::vector<double> v(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) v[i] = n * dyadic_v(salt, rank, i);
  return v;
}

// The mean over `ranks` of the inputs dyadic_input(salt, r, n): sum_r v_r when `ranks` is the
// whole world of n; in general (1/|ranks|) sum_r n v_r (exact for |ranks| a power of two).
std::vector<double> dyadic_mean(int salt, int n, int64_t numel, const std::vector<int>& ranks) {
  std::vector<double> m(static_cast<size_t>(numel), 0.0);
  for (int64_t i = 0; i < numel; ++i) {
    for (int r : ranks) m[i] += n * dyadic_v(salt, r, i);
    m[i] /= static_cast<double>(ranks.size());
  }
  return m;
}

std::vector<int> all_ranks(int n) {
  std::vector<int> r(n);
  for (int i = 0; i < n; ++i) r[i] = i;
  return r;
}

// `values` rounded to `dtype` (round to nearest even), as doubles.
std::vector<double> rounded(const std::vector<double>& values, at::ScalarType dtype) {
  return ddpx_test::to_doubles(ddpx_test::make_tensor(values, dtype));
}

// Writes `values` (row-major over t's logical shape) into t, whatever its strides.
void fill(const at::Tensor& t, const std::vector<double>& values) {
  at::NoGradGuard no_grad;
  t.copy_(ddpx_test::make_tensor(values, t.scalar_type()).view(t.sizes()));
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// t holds exactly `expected` rounded to its dtype; names the first differing element.
::testing::AssertionResult holds(const at::Tensor& t, const std::vector<double>& expected) {
  const std::vector<double> want = rounded(expected, t.scalar_type());
  const std::vector<double> got = ddpx_test::to_doubles(t);
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "numel " << got.size() << " != " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]));
    if (!same) {
      return ::testing::AssertionFailure()
             << t.scalar_type() << " element " << i << " of " << got.size() << ": got " << got[i]
             << ", expected " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// Collects TORCH_WARN messages issued on this thread while alive (c10's handler is
// thread-local).
class CaptureWarnings : public ddpx::compat::ScopedWarningHandler {
 public:
  void on_warning(const std::string& message) override { messages.push_back(message); }
  std::string joined() const {
    std::string s;
    for (const auto& m : messages) s += m + "\n";
    return s;
  }
  std::vector<std::string> messages;
};

// ---- subgroups ---------------------------------------------------------------------------------

// Four ranks as two pairs {0, 1} and {2, 3}: pair_groups()[r] is rank r's pair group (built
// over one PrefixStore per pair on a store of its own), shared by the whole binary.
const std::vector<ProcessGroupPtr>& pair_groups() {
  static std::mutex mu;
  static std::vector<ProcessGroupPtr> groups;
  std::lock_guard<std::mutex> lock(mu);
  if (groups.empty()) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<ProcessGroupPtr> g(4);
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r) {
      threads.emplace_back([&, r] {
        auto prefixed =
            c10::make_intrusive<c10d::PrefixStore>("pair" + std::to_string(r / 2), store);
        g[r] = ddpx_test::make_gloo_group(prefixed, r % 2, 2);
      });
    }
    for (auto& t : threads) t.join();
    groups = g;
  }
  return groups;
}

std::vector<int> pair_of(int rank) { return {rank / 2 * 2, rank / 2 * 2 + 1}; }

// ======== average_parameters
// ======================================================================

enum class Layout { kContiguous, kTransposed, kStrided };

struct Spec {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  Layout layout = Layout::kContiguous;
};

// One rank's tensor for a Spec: `t` is what gets averaged; for kStrided the odd elements of
// the base (`rest`) must not be touched.
struct Param {
  at::Tensor t;
  at::Tensor rest;
  void* data = nullptr;
};

Param make_param(const Spec& s) {
  Param p;
  const auto opts = at::TensorOptions().dtype(s.dtype);
  switch (s.layout) {
    case Layout::kContiguous:
      p.t = at::empty(s.shape, opts);
      break;
    case Layout::kTransposed: {
      TORCH_CHECK(s.shape.size() == 2);
      p.t = at::empty({s.shape[1], s.shape[0]}, opts).t();
      break;
    }
    case Layout::kStrided: {
      const int64_t n = numel_of(s.shape);
      at::Tensor base = at::full({2 * n}, 3.0, opts);
      p.t = base.slice(0, 0, 2 * n, 2).view(s.shape);
      p.rest = base.slice(0, 1, 2 * n, 2);
      break;
    }
  }
  if (s.layout != Layout::kContiguous) EXPECT_FALSE(p.t.is_contiguous());
  return p;
}

// Averages tensors built from `specs` on n ranks with the dyadic inputs and checks each result
// bit for bit, in place; `check_stats` (optional) sees every rank's stats.
void check_dyadic_average(
    int n, const std::vector<Spec>& specs, const ddpx::comm::AverageOptions& opt, int salt,
    const std::function<void(const ddpx::comm::AverageStats&)>& check_stats = {}) {
  ddpx_test::run_ranks(n, [&](int rank, const ProcessGroupPtr& pg) {
    std::vector<Param> params;
    std::vector<at::Tensor> tensors;
    for (size_t k = 0; k < specs.size(); ++k) {
      Param p = make_param(specs[k]);
      fill(p.t, dyadic_input(salt + static_cast<int>(k), rank, n, p.t.numel()));
      p.data = p.t.data_ptr();
      tensors.push_back(p.t);
      params.push_back(p);
    }
    const ddpx::comm::AverageStats stats = ddpx::comm::average_parameters(tensors, pg, opt);
    for (size_t k = 0; k < specs.size(); ++k) {
      const Param& p = params[k];
      EXPECT_TRUE(holds(p.t, dyadic_mean(salt + static_cast<int>(k), n, p.t.numel(), all_ranks(n))))
          << "rank " << rank << " of " << n << ", tensor " << k << " " << specs[k].dtype;
      EXPECT_EQ(p.t.data_ptr(), p.data) << "tensor " << k << " was not averaged in place";
      EXPECT_EQ(p.t.scalar_type(), specs[k].dtype);
      if (p.rest.defined()) {
        EXPECT_TRUE(holds(p.rest, std::vector<double>(p.rest.numel(), 3.0)))
            << "tensor " << k << ": elements outside the view were written";
      }
    }
    EXPECT_EQ(stats.tensors, static_cast<int64_t>(specs.size()));
    if (check_stats) check_stats(stats);
  });
}

TEST(AverageParameters, ClosedFormMeanEveryDtypeAndWorldSize) {
  const std::vector<std::vector<int64_t>> shapes = {{1}, {7}, {3, 5}, {64}, {300}};
  for (int n = 1; n <= 4; ++n) {
    for (at::ScalarType dtype : kDtypes) {
      std::vector<Spec> specs;
      for (const auto& s : shapes) specs.push_back({s, dtype});
      for (int64_t cap : {ddpx::comm::kDefaultBucketBytes, int64_t{256}}) {
        SCOPED_TRACE(::testing::Message() << n << " ranks, " << dtype << ", cap " << cap);
        check_dyadic_average(n, specs, {cap}, 10 * n, [&](const ddpx::comm::AverageStats& st) {
          if (n == 1) return;
          EXPECT_EQ(st.inplace_tensors + st.staged_tensors, st.tensors);
          EXPECT_LE(st.staging_bytes, 2 * cap);
          EXPECT_GE(st.collectives, 1);
          if (cap == ddpx::comm::kDefaultBucketBytes) {
            // Everything fits one bucket: a single allreduce.
            EXPECT_EQ(st.collectives, 1);
            EXPECT_EQ(st.staged_tensors, st.tensors);
          }
        });
      }
    }
  }
}

// Promotion as torch.cat: the common dtype of {fp16, bf16} is fp32, anything with fp64 is fp64.
TEST(AverageParameters, MixedDtypesPromoteAndCastBack) {
  const std::vector<std::vector<Spec>> lists = {
      {{{9}, at::kHalf}, {{4, 3}, at::kFloat}, {{20}, at::kBFloat16}, {{5}, at::kDouble}},
      {{{33}, at::kHalf}, {{17}, at::kBFloat16}},
      {{{70}, at::kFloat}, {{6}, at::kHalf}},
      {{{2, 40}, at::kDouble}, {{40}, at::kFloat}}};
  for (int n = 2; n <= 4; ++n) {
    for (size_t l = 0; l < lists.size(); ++l) {
      for (int64_t cap : {ddpx::comm::kDefaultBucketBytes, int64_t{128}}) {
        SCOPED_TRACE(::testing::Message() << n << " ranks, list " << l << ", cap " << cap);
        check_dyadic_average(n, lists[l], {cap}, 100 + n, [&](const ddpx::comm::AverageStats& st) {
          EXPECT_EQ(st.inplace_tensors + st.staged_tensors, st.tensors);
          EXPECT_LE(st.staging_bytes, 2 * cap);
        });
      }
    }
  }
}

// Random (non-dyadic) values on 2 ranks: (a + b) / 2 rounded once, for single and mixed dtypes.
TEST(AverageParameters, TwoRanksRandomValuesBitExact) {
  std::vector<std::vector<Spec>> lists;
  for (at::ScalarType d : kDtypes) lists.push_back({{{50}, d}, {{8, 9}, d}, {{3}, d}});
  lists.push_back({{{50}, at::kHalf}, {{8, 9}, at::kFloat}, {{31}, at::kBFloat16}});
  lists.push_back({{{50}, at::kHalf}, {{8, 9}, at::kDouble}, {{31}, at::kFloat}});
  lists.push_back({{{50}, at::kHalf}, {{31}, at::kBFloat16}});
  for (size_t l = 0; l < lists.size(); ++l) {
    for (int64_t cap : {ddpx::comm::kDefaultBucketBytes, int64_t{96}}) {
      SCOPED_TRACE(::testing::Message() << "list " << l << ", cap " << cap);
      const auto& specs = lists[l];
      auto input = [&](size_t k, int rank) {
        return rounded(ddpx_test::random_values(ddpx_test::rank_seed(1000 + l * 10 + k, rank),
                                                numel_of(specs[k].shape)),
                       specs[k].dtype);
      };
      ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
        std::vector<at::Tensor> tensors;
        for (size_t k = 0; k < specs.size(); ++k) {
          tensors.push_back(
              ddpx_test::make_tensor(input(k, rank), specs[k].dtype).view(specs[k].shape));
        }
        ddpx::comm::average_parameters(tensors, pg, {cap});
        for (size_t k = 0; k < specs.size(); ++k) {
          const auto a = input(k, 0), b = input(k, 1);
          std::vector<double> mean(a.size());
          for (size_t i = 0; i < a.size(); ++i) mean[i] = (a[i] + b[i]) / 2;
          EXPECT_TRUE(holds(tensors[k], mean)) << "rank " << rank << ", tensor " << k;
        }
      });
    }
  }
}

TEST(AverageParameters, NonContiguousTensors) {
  // Small and larger-than-bucket (cap 256 bytes = 64 fp32) views, among contiguous tensors.
  const std::vector<Spec> specs = {
      {{6, 5}, at::kFloat, Layout::kTransposed}, {{40}, at::kFloat, Layout::kContiguous},
      {{7}, at::kFloat, Layout::kStrided},       {{30, 20}, at::kFloat, Layout::kTransposed},
      {{300}, at::kFloat, Layout::kStrided},     {{11, 13}, at::kHalf, Layout::kTransposed},
      {{5}, at::kDouble, Layout::kStrided}};
  for (int n : {2, 3, 4}) {
    for (int64_t cap : {ddpx::comm::kDefaultBucketBytes, int64_t{256}}) {
      SCOPED_TRACE(::testing::Message() << n << " ranks, cap " << cap);
      check_dyadic_average(n, specs, {cap}, 300 + n, [&](const ddpx::comm::AverageStats& st) {
        EXPECT_EQ(st.inplace_tensors + st.staged_tensors, st.tensors);
      });
    }
  }
}

TEST(AverageParameters, TensorsLargerThanTheBucket) {
  // cap 256 bytes: 64 fp32 elements, in-place threshold a quarter bucket (16 fp32).
  const int64_t cap = 256;
  // Common dtype fp32: the contiguous fp32 tensors of >= 16 elements are reduced in place, the
  // fp16 ones (and the small fp32 one) travel through staging buckets, in 64-element chunks.
  const std::vector<Spec> specs = {{{1000}, at::kFloat},
                                   {{10}, at::kFloat},
                                   {{500}, at::kHalf},
                                   {{16}, at::kFloat},
                                   {{3, 100}, at::kBFloat16}};
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE(::testing::Message() << n << " ranks");
    check_dyadic_average(n, specs, {cap}, 400 + n, [&](const ddpx::comm::AverageStats& st) {
      EXPECT_EQ(st.inplace_tensors, 2);  // {1000} and {16}
      EXPECT_EQ(st.staged_tensors, 3);
      EXPECT_GT(st.staging_bytes, 0);
      EXPECT_LE(st.staging_bytes, 2 * cap);
      // Staged: 10 + 500 + 300 = 810 fp32 values = 3240 bytes -> at least 13 buckets.
      const int64_t min_buckets = (810 * 4 + cap - 1) / cap;
      EXPECT_GE(st.collectives, 2 + min_buckets);
      EXPECT_LE(st.collectives, 2 + min_buckets + 3);
    });
  }
  // A single huge fp64 tensor in a tiny bucket, and a single fp16 tensor spanning many buckets.
  for (const Spec& s : {Spec{{4096}, at::kDouble}, Spec{{2049}, at::kHalf}}) {
    check_dyadic_average(4, {s}, {64}, 450, [&](const ddpx::comm::AverageStats& st) {
      EXPECT_LE(st.staging_bytes, 2 * 64);
      EXPECT_EQ(st.inplace_tensors + st.staged_tensors, 1);
    });
  }
}

TEST(AverageParameters, ManySmallTensors) {
  std::vector<Spec> specs;
  int64_t total = 0;
  for (int k = 0; k < 300; ++k) {
    specs.push_back({{1 + k % 5}, at::kFloat});
    total += 1 + k % 5;
  }
  const int64_t cap = 256;
  for (int n : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << n << " ranks");
    check_dyadic_average(n, specs, {cap}, 500 + n, [&](const ddpx::comm::AverageStats& st) {
      EXPECT_EQ(st.staged_tensors, 300);
      EXPECT_EQ(st.inplace_tensors, 0);
      EXPECT_LE(st.staging_bytes, 2 * cap);
      // Packed, not one collective per tensor.
      const int64_t min_buckets = (total * 4 + cap - 1) / cap;
      EXPECT_GE(st.collectives, min_buckets);
      EXPECT_LE(st.collectives, min_buckets + 2);
    });
    // Default bucket: all in one allreduce.
    check_dyadic_average(n, specs, {}, 600 + n,
                         [&](const ddpx::comm::AverageStats& st) { EXPECT_EQ(st.collectives, 1); });
  }
}

// Parameters are leaves that require grad, as a model's: averaging must not trip autograd.
TEST(AverageParameters, LeavesThatRequireGrad) {
  ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
    std::vector<at::Tensor> tensors;
    for (int k = 0; k < 3; ++k) {
      at::Tensor t = at::empty({k == 0 ? 100 : 4}, at::kFloat);
      fill(t, dyadic_input(700 + k, rank, 3, t.numel()));
      tensors.push_back(t.requires_grad_());
    }
    ddpx::comm::average_parameters(tensors, pg, {256});
    for (int k = 0; k < 3; ++k) {
      EXPECT_TRUE(tensors[k].requires_grad());
      EXPECT_TRUE(tensors[k].is_leaf());
      EXPECT_TRUE(
          holds(tensors[k].detach(), dyadic_mean(700 + k, 3, tensors[k].numel(), all_ranks(3))));
    }
  });
}

// Peak bytes allocated through c10's CPU allocator on this thread while alive, above the level
// at construction (c10's profiler hook: the allocator reports each allocation and free to the
// thread's PROFILER_STATE debug info).
class PeakCpuMemory : public ddpx::compat::MemoryReporter {
 public:
  void on_memory(int64_t alloc_size, c10::Device device) override {
    if (!device.is_cpu()) return;
    current += alloc_size;
    peak = std::max(peak, current);
  }
  bool memoryProfilingEnabled() const override { return true; }
  int64_t current = 0;
  int64_t peak = 0;
};

// The extra memory is bounded by about two buckets whatever the model (average.h): staging
// buckets are reused, dense non-contiguous tensors (transposes) are reduced in place in memory
// order, and a non-dense one (a strided slice) needs a temporary copy of itself only when it is
// larger than a bucket (one at a time). 1 KiB buckets, 64 tensors of 2 or 4 KiB each.
TEST(AverageParameters, ExtraMemoryIsAboutTwoBuckets) {
  const int64_t cap = 1024;
  struct Case {
    const char* name;
    std::vector<int64_t> shape;  // of the storage; transposed views swap it
    at::ScalarType dtype;
    bool transposed;
    int64_t allowed_copy;  // a temporary copy the header allows (non-dense > a bucket)
    bool strided = false;  // every other column of a {rows, 2 * cols} storage
  };
  const std::vector<Case> cases = {
      {"contiguous fp32 (in place)", {32, 32}, at::kFloat, false, 0},
      {"contiguous fp16 (staged)", {32, 32}, at::kHalf, false, 0},
      {"transposed fp32, smaller than a bucket", {8, 16}, at::kFloat, true, 0},
      {"transposed fp32, 4x a bucket (in place)", {32, 32}, at::kFloat, true, 0},
      {"strided fp32, smaller than a bucket", {8, 16}, at::kFloat, false, 0, true},
      {"strided fp32, 4x a bucket", {32, 32}, at::kFloat, false, 4096, true}};
  for (const Case& c : cases) {
    ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
      std::vector<at::Tensor> tensors;
      for (int k = 0; k < 64; ++k) {
        at::Tensor t =
            c.strided
                ? at::empty({c.shape[0], 2 * c.shape[1]}, c.dtype).slice(1, 0, 2 * c.shape[1], 2)
                : at::empty(c.shape, c.dtype);
        if (c.transposed) t = t.t();
        fill(t, dyadic_input(1100 + k, rank, 2, t.numel()));
        tensors.push_back(t);
      }
      auto reporter = std::make_shared<PeakCpuMemory>();
      {
        c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, reporter);
        ddpx::comm::average_parameters(tensors, pg, {cap});
      }
      for (int k = 0; k < 64; ++k) {
        EXPECT_TRUE(holds(tensors[k], dyadic_mean(1100 + k, 2, tensors[k].numel(), all_ranks(2))))
            << c.name << ", tensor " << k;
      }
      // 2 buckets, the allowed copy, and 1 KiB of slack for bookkeeping.
      EXPECT_LE(reporter->peak, 2 * cap + c.allowed_copy + 1024)
          << c.name << ", rank " << rank << ": peak extra CPU memory " << reporter->peak
          << " bytes (the tensors hold " << 64 * tensors[0].nbytes() << ")";
    });
  }
}

// Tensors are reduced in their own storage (dense non-contiguous ones in memory order) only when
// every rank lays them out alike; here rank 0 holds a transpose and the other ranks contiguous
// tensors of the same logical values, so everything goes through the buckets in logical order
// (and every rank must still issue the same collectives): the means must still be right.
TEST(AverageParameters, MismatchedLayoutsAcrossRanksFallBackToLogicalOrder) {
  for (int n : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << n << " ranks");
    ddpx_test::run_ranks(n, [&](int rank, const ProcessGroupPtr& pg) {
      at::Tensor t = rank == 0 ? at::empty({24, 40}, at::kFloat).t() : at::empty({40, 24});
      fill(t, dyadic_input(1300, rank, n, t.numel()));
      at::Tensor same = at::empty({40, 24}).t();  // alike on every rank
      fill(same, dyadic_input(1301, rank, n, same.numel()));
      const auto st = ddpx::comm::average_parameters({t, same}, pg, {256});
      EXPECT_TRUE(holds(t, dyadic_mean(1300, n, t.numel(), all_ranks(n))));
      EXPECT_TRUE(holds(same, dyadic_mean(1301, n, same.numel(), all_ranks(n))));
      EXPECT_EQ(st.inplace_tensors, 0);
      EXPECT_EQ(st.staged_tensors, 2);
      // Alike on every rank: both transposes are reduced in place.
      const auto alike = ddpx::comm::average_parameters({t.t().contiguous().t(), same}, pg, {256});
      EXPECT_EQ(alike.inplace_tensors, 2);
    });
  }
}

TEST(AverageParameters, NullGroupEmptyListAndBadOptions) {
  at::Tensor t = at::arange(5, at::kFloat);
  const at::Tensor before = t.clone();
  const ddpx::comm::AverageStats st = ddpx::comm::average_parameters({t}, ProcessGroupPtr());
  EXPECT_TRUE(bitwise_equal(t, before));
  EXPECT_EQ(st.collectives, 0);
  EXPECT_EQ(st.staging_bytes, 0);

  // Empty list: no collective on any rank (a collective issued by some ranks only would hang
  // the next test's collectives, which run on the same groups).
  ddpx_test::run_ranks(2, [&](int, const ProcessGroupPtr& pg) {
    const ddpx::comm::AverageStats s = ddpx::comm::average_parameters({}, pg);
    EXPECT_EQ(s.tensors, 0);
    EXPECT_EQ(s.collectives, 0);
  });

  const auto& pg = ddpx_test::shared_gloo_world(2)[0];
  EXPECT_THAT(value_error([&] { ddpx::comm::average_parameters({t}, pg, {0}); }),
              AllOf(HasSubstr("average_parameters"), HasSubstr("bucket_cap_bytes")));
  // Refused before any collective (so one rank alone may try), naming the tensor.
  at::Tensor indices = at::zeros({1, 1}, at::kLong);
  const std::vector<std::pair<at::Tensor, std::string>> bad = {
      {at::Tensor(), "tensor 1 is undefined"},
      {at::sparse_coo_tensor(indices, at::ones({1}), {4}), "tensor 1 is not a dense tensor"},
      {at::ones({4}, at::kInt), "tensor 1 has dtype Int; only floating-point values average"},
  };
  for (const auto& b : bad) {
    EXPECT_THAT(value_error([&] {
                  ddpx::comm::average_parameters({t, b.first}, pg);
                }),
                AllOf(HasSubstr("average_parameters: "), HasSubstr(b.second)));
  }
  EXPECT_THAT(value_error([&] { ddpx::comm::average_parameters({t}, pg, {-5}); }),
              HasSubstr("bucket_cap_bytes"));
}

TEST(AverageParameters, ParamsWithGrad) {
  at::Tensor a = at::zeros({2}).requires_grad_();
  at::Tensor b = at::zeros({3}).requires_grad_();
  at::Tensor c = at::zeros({4});
  a.mutable_grad() = at::ones({2});
  c.mutable_grad() = at::ones({4});
  const auto out = ddpx::comm::params_with_grad({a, b, c});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[0].is_same(a));
  EXPECT_TRUE(out[1].is_same(c));
  EXPECT_TRUE(ddpx::comm::params_with_grad({}).empty());
  EXPECT_TRUE(ddpx::comm::params_with_grad({b}).empty());
}

// Parameters that share memory: a 2M-element parameter listed twice must not be divided by one
// in-place job while the other's allreduce is in flight on it (which puts values far off the
// mean). Each element must be averaged once: listed twice, a view listed with
// its base (either order), a transpose, views that overlap partly, interleaved strided views.
// Expected: every element some listed tensor touches equals its mean over the ranks (computed
// by averaging an unaliased copy), every other element keeps its value.
TEST(AverageParameters, TensorsSharingMemoryAverageEachElementOnce) {
  constexpr int64_t n = 2'000'000;
  using Views = std::function<std::vector<at::Tensor>(const at::Tensor&)>;
  const std::vector<std::pair<const char*, Views>> cases = {
      {"twice",
       [](const at::Tensor& b) {
         return std::vector<at::Tensor>{b, b};
       }},
      {"base then view",
       [](const at::Tensor& b) {
         return std::vector<at::Tensor>{b, b.narrow(0, 10, 1000)};
       }},
      {"view then base",
       [](const at::Tensor& b) {
         return std::vector<at::Tensor>{b.narrow(0, 10, 1000), b};
       }},
      {"transpose and base",
       [](const at::Tensor& b) {
         return std::vector<at::Tensor>{b.view({2000, 1000}).t(), b};
       }},
      {"partial overlap",
       [](const at::Tensor& b) {
         return std::vector<at::Tensor>{b.narrow(0, 0, 1'200'000), b.narrow(0, 800'000, 1'200'000)};
       }},
      {"interleaved",
       [](const at::Tensor& b) {
         return std::vector<at::Tensor>{b.slice(0, 0, b.numel(), 2), b.slice(0, 1, b.numel(), 2)};
       }},
      {"two small views",
       [](const at::Tensor& b) {
         return std::vector<at::Tensor>{b.narrow(0, 100, 500), b.narrow(0, 300, 500)};
       }},
  };
  const std::set<std::string> partial = {"partial overlap", "interleaved", "two small views"};
  for (int world : {2, 4}) {
    for (const auto& c : cases) {
      ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
        at::manual_seed(500 + rank);
        at::Tensor base = at::randn({n}, at::kFloat);
        at::Tensor mean = base.clone();
        ddpx::comm::average_parameters({mean}, pg);  // the mean, without aliasing
        at::Tensor touched = at::zeros({n}, at::kBool);
        for (const at::Tensor& v : c.second(touched)) v.fill_(true);
        const at::Tensor want = at::where(touched, mean, base);
        ddpx::comm::average_parameters(c.second(base), pg);
        const std::string where = std::string(c.first) + ", world " + std::to_string(world) +
                                  ", rank " + std::to_string(rank);
        // Memory a partial overlap shares is exchanged from a private copy: the same mean, summed
        // by the backend in another order (bit for bit on 2 ranks, where the order cannot
        // matter). Everything else is exact, and untouched elements keep their bits.
        if (partial.count(c.first) && world > 2) {
          // (the rounding of a 4-term sum of values up to ~5: well under 1e-5 absolute, where
          // the bug this test guards against was off by orders of magnitude)
          EXPECT_TRUE(at::allclose(base, want, /*rtol=*/1e-5, /*atol=*/1e-5))
              << where << ": max |diff| " << (base - want).abs().max().item<float>();
          EXPECT_TRUE(bitwise_equal(base.masked_select(~touched), want.masked_select(~touched)))
              << where;
        } else {
          EXPECT_TRUE(bitwise_equal(base, want)) << where;
        }
      });
    }
  }
}

// Ranks that pass different tensors would abort the process inside Gloo (or hang) if they
// reached it: every rank must raise a ValueError instead, and the group stays usable.
TEST(AverageParameters, RanksPassingDifferentTensorsRaiseOnEveryRank) {
  const std::vector<std::pair<const char*, std::function<std::vector<at::Tensor>(int)>>> cases = {
      {"sizes", [](int rank) { return std::vector<at::Tensor>{at::ones({10 + rank})}; }},
      {"count",
       [](int rank) {
         return rank == 0 ? std::vector<at::Tensor>{at::ones({4}), at::ones({4})}
                          : std::vector<at::Tensor>{at::ones({4})};
       }},
      {"dtypes",
       [](int rank) {
         return std::vector<at::Tensor>{at::ones({4}, rank == 0 ? at::kFloat : at::kDouble)};
       }},
      {"aliasing",
       [](int rank) {
         at::Tensor p = at::ones({4});
         return rank == 0 ? std::vector<at::Tensor>{p, p}
                          : std::vector<at::Tensor>{p, at::ones({4})};
       }},
  };
  for (const auto& c : cases) {
    ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
      EXPECT_THAT(value_error([&] { ddpx::comm::average_parameters(c.second(rank), pg); }),
                  AllOf(HasSubstr("average_parameters"), HasSubstr("passed different tensors")))
          << c.first << ", rank " << rank;
    });
  }
  // The groups are still in step.
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    at::Tensor t = at::full({3}, static_cast<float>(rank));
    ddpx::comm::average_parameters({t}, pg);
    EXPECT_TRUE(bitwise_equal(t, at::full({3}, 0.5f)));
  });
}

// ======== PeriodicModelAverager ==================================================================

// A replica: parameters with gradients (averaged) and one without (never averaged).
struct Replica {
  std::vector<at::Tensor> with_grad;
  at::Tensor without_grad;
  std::vector<at::Tensor> all() const {
    auto v = with_grad;
    v.push_back(without_grad);
    return v;
  }
};

Replica make_replica() {
  Replica r;
  r.with_grad = {at::zeros({5}).requires_grad_(), at::zeros({2, 3}).requires_grad_()};
  for (auto& p : r.with_grad) p.mutable_grad() = at::zeros_like(p);
  r.without_grad = at::zeros({4}).requires_grad_();
  return r;
}

// Makes the ranks diverge: step-dependent dyadic inputs.
void diverge(const Replica& r, int step, int rank, int n) {
  for (size_t k = 0; k < r.with_grad.size(); ++k) {
    fill(r.with_grad[k],
         dyadic_input(step * 10 + static_cast<int>(k), rank, n, r.with_grad[k].numel()));
  }
  fill(r.without_grad, dyadic_input(step * 10 + 9, rank, n, r.without_grad.numel()));
}

// Checks the replica after a step: averaged over `group` (all ranks listed) or left as it was.
void expect_replica(const Replica& r, int step, int rank, int n, const std::vector<int>& group,
                    bool averaged) {
  for (size_t k = 0; k < r.with_grad.size(); ++k) {
    const int salt = step * 10 + static_cast<int>(k);
    const int64_t numel = r.with_grad[k].numel();
    EXPECT_TRUE(holds(r.with_grad[k].detach(), averaged ? dyadic_mean(salt, n, numel, group)
                                                        : dyadic_input(salt, rank, n, numel)))
        << "rank " << rank << " step " << step << " param " << k
        << (averaged ? " (should be averaged)" : " (should be untouched)");
  }
  EXPECT_TRUE(
      holds(r.without_grad.detach(), dyadic_input(step * 10 + 9, rank, n, r.without_grad.numel())))
      << "rank " << rank << " step " << step << ": a parameter without grad was averaged";
}

TEST(PeriodicModelAverager, AveragesAtWarmupPlusMultiplesOfPeriod) {
  struct Case {
    int n;
    int64_t period, warmup;
  };
  for (const Case c : {Case{2, 3, 2}, Case{3, 2, 0}, Case{4, 1, 3}, Case{2, 4, 5}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.n << " ranks, period " << c.period << ", warmup " << c.warmup);
    ddpx_test::run_ranks(c.n, [&](int rank, const ProcessGroupPtr& pg) {
      CaptureWarnings warnings;  // period 1 warns
      ddpx::optim::PeriodicModelAverager avg(c.period, c.warmup, pg, {64});
      EXPECT_EQ(avg.period(), c.period);
      EXPECT_EQ(avg.warmup_steps(), c.warmup);
      EXPECT_EQ(avg.step(), 0);
      Replica r = make_replica();
      for (int s = 0; s < 12; ++s) {
        diverge(r, s, rank, c.n);
        avg.average_parameters(r.all());
        const bool due = s >= c.warmup && (s - c.warmup) % c.period == 0;
        expect_replica(r, s, rank, c.n, all_ranks(c.n), due);
        EXPECT_EQ(avg.step(), s + 1);
        EXPECT_EQ(avg.last_stats().tensors, due ? 2 : 0) << "step " << s;
        EXPECT_EQ(avg.last_stats().collectives > 0, due) << "step " << s;
      }
    });
  }
}

TEST(PeriodicModelAverager, SetStepAndParamGroups) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    ddpx::optim::PeriodicModelAverager avg(4, 10, pg);
    Replica r = make_replica();
    avg.set_step(14);  // 14 = 10 + 4: due
    diverge(r, 0, rank, 2);
    avg.average_parameters(r.all());
    expect_replica(r, 0, rank, 2, all_ranks(2), true);
    EXPECT_EQ(avg.step(), 15);
    diverge(r, 1, rank, 2);
    avg.average_parameters(r.all());  // 15: not due
    expect_replica(r, 1, rank, 2, all_ranks(2), false);

    // Optimizer parameter groups: parameters without grad are skipped, in any group.
    avg.set_step(18);
    diverge(r, 2, rank, 2);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{r.with_grad[0], r.without_grad});
    groups.emplace_back(std::vector<at::Tensor>{r.with_grad[1]});
    avg.average_parameters(groups);
    expect_replica(r, 2, rank, 2, all_ranks(2), true);
    EXPECT_EQ(avg.last_stats().tensors, 2);
    EXPECT_EQ(avg.step(), 19);
  });
}

// period and warmup_steps are settable mid-run, as torch's attributes are; the next
// call follows the new schedule.
TEST(PeriodicModelAverager, PeriodAndWarmupChangeMidRun) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    ddpx::optim::PeriodicModelAverager avg(2, 0, pg);
    at::Tensor p = at::zeros({4}).requires_grad_();
    p.mutable_grad() = at::zeros({4});
    std::vector<int64_t> averaged;
    for (int64_t step = 0; step < 12; ++step) {
      if (step == 4) avg.set_period(3);         // steps 6, 9 (step - warmup divisible by 3)
      if (step == 9) avg.set_warmup_steps(10);  // then nothing before step 10, then 10 and 13
      avg.average_parameters(std::vector<at::Tensor>{p});
      if (avg.last_stats().collectives > 0) averaged.push_back(step);
    }
    EXPECT_EQ(averaged, (std::vector<int64_t>{0, 2, 6, 10})) << "rank " << rank;
    EXPECT_EQ(avg.period(), 3);
    EXPECT_THAT(value_error([&] { avg.set_period(0); }), HasSubstr("period"));
    EXPECT_THAT(value_error([&] { avg.set_warmup_steps(-1); }), HasSubstr("warmup_steps"));
  });
}

TEST(PeriodicModelAverager, InvalidArguments) {
  const auto& pg = ddpx_test::shared_gloo_world(2)[0];
  EXPECT_THAT(value_error([&] { ddpx::optim::PeriodicModelAverager(0, 0, pg); }),
              HasSubstr("period"));
  EXPECT_THAT(value_error([&] { ddpx::optim::PeriodicModelAverager(-3, 0, pg); }),
              HasSubstr("period"));
  EXPECT_THAT(value_error([&] { ddpx::optim::PeriodicModelAverager(2, -1, pg); }),
              HasSubstr("warmup_steps"));
  ddpx::optim::PeriodicModelAverager avg(2, 0, pg);
  EXPECT_THAT(ddpx_test::error_message([&] { avg.set_options({0}); }),
              HasSubstr("bucket_cap_bytes"));
  {
    CaptureWarnings w;
    ddpx::optim::PeriodicModelAverager one(1, 0, pg);
    EXPECT_THAT(w.joined(), HasSubstr("period")) << "period 1 should warn";
  }
  {
    CaptureWarnings w;
    ddpx::optim::PeriodicModelAverager two(2, 0, pg);
    EXPECT_TRUE(w.messages.empty()) << w.joined();
  }
}

// averagers.h: a null process_group means this rank is not a member: steps count, nothing is
// averaged, no collective is issued.
TEST(PeriodicModelAverager, NullProcessGroupMeansNotAMember) {
  ddpx::optim::PeriodicModelAverager avg(1, 0, ProcessGroupPtr());
  at::Tensor p = at::arange(8, at::kFloat);
  p.mutable_grad() = at::ones_like(p);
  const at::Tensor before = p.clone();
  avg.average_parameters(std::vector<at::Tensor>{p});
  EXPECT_TRUE(at::equal(p, before));
  EXPECT_EQ(avg.step(), 1);
  EXPECT_EQ(avg.last_stats().collectives, 0);
}

// ======== HierarchicalModelAverager
// ===============================================================

TEST(HierarchicalModelAverager, PairsEveryTwoWorldEveryFour) {
  const auto& pairs = pair_groups();
  for (int64_t warmup : {0, 3}) {
    SCOPED_TRACE(::testing::Message() << "warmup " << warmup);
    ddpx_test::run_ranks(4, [&](int rank, const ProcessGroupPtr& pg) {
      ddpx::optim::HierarchicalModelAverager avg({{2, pairs[rank]}, {4, pg}}, warmup, pg, {128});
      ASSERT_EQ(avg.period_groups().size(), 2u);
      EXPECT_EQ(avg.warmup_steps(), warmup);
      const std::vector<int64_t> index = {1, -1, 0, -1, 1, -1, 0, -1, 1, -1, 0};
      for (int64_t s = 0; s < static_cast<int64_t>(index.size()); ++s) {
        EXPECT_EQ(avg.group_index_for_step(s), index[s]) << "step " << s;
      }
      Replica r = make_replica();
      for (int s = 0; s < 11; ++s) {
        diverge(r, s, rank, 4);
        avg.average_parameters(r.all());
        const int64_t g = s < warmup ? -1 : index[s];
        expect_replica(r, s, rank, 4, g == 1 ? all_ranks(4) : pair_of(rank), g >= 0);
        EXPECT_EQ(avg.step(), s + 1);
      }
    });
  }
}

// A rank outside a level's group (null there) skips that level; the members still average.
TEST(HierarchicalModelAverager, NullGroupOnNonMembers) {
  const auto& pairs = pair_groups();
  ddpx_test::run_ranks(4, [&](int rank, const ProcessGroupPtr& pg) {
    ProcessGroupPtr first_pair = rank < 2 ? pairs[rank] : ProcessGroupPtr();
    ddpx::optim::HierarchicalModelAverager avg({{2, first_pair}, {3, pg}}, 0, pg);
    Replica r = make_replica();
    for (int s = 0; s < 7; ++s) {
      diverge(r, s, rank, 4);
      avg.average_parameters(r.all());
      // 0: world (3 | 0); 2, 4: pair {0, 1}; 3, 6: world.
      const bool world = s % 3 == 0;
      const bool pair = !world && s % 2 == 0 && rank < 2;
      expect_replica(r, s, rank, 4, world ? all_ranks(4) : pair_of(rank), world || pair);
    }
  });
}

TEST(HierarchicalModelAverager, InvalidArguments) {
  const auto& pg = ddpx_test::shared_gloo_world(4)[0];
  const auto& pair = pair_groups()[0];
  using PG = std::vector<std::pair<int64_t, ProcessGroupPtr>>;
  EXPECT_THAT(value_error([&] { ddpx::optim::HierarchicalModelAverager(PG{}, 0, pg); }),
              HasSubstr("empty"));
  EXPECT_THAT(value_error([&] {
                ddpx::optim::HierarchicalModelAverager(PG{{0, pair}, {4, pg}}, 0, pg);
              }),
              HasSubstr("period"));
  EXPECT_THAT(value_error([&] {
                ddpx::optim::HierarchicalModelAverager(PG{{2, pair}, {-4, pg}}, 0, pg);
              }),
              HasSubstr("period"));
  EXPECT_THAT(value_error([&] {
                ddpx::optim::HierarchicalModelAverager(PG{{2, pair}}, 0, pg);
              }),
              AllOf(HasSubstr("2"), HasSubstr("4")));
  EXPECT_THAT(value_error([&] {
                ddpx::optim::HierarchicalModelAverager(PG{{2, pair}, {4, pg}}, -1, pg);
              }),
              HasSubstr("warmup_steps"));
  EXPECT_THAT(
      ddpx_test::error_message([&] {
        ddpx::optim::HierarchicalModelAverager(PG{{2, pair}, {4, pg}}, 0, ProcessGroupPtr());
      }),
      HasSubstr("process_group"));
  // The top level spans every rank: it cannot be null on any.
  EXPECT_THAT(
      ddpx_test::error_message([&] {
        ddpx::optim::HierarchicalModelAverager(PG{{2, pair}, {4, ProcessGroupPtr()}}, 0, pg);
      }),
      HasSubstr("process_group"));
  {
    CaptureWarnings w;
    ddpx::optim::HierarchicalModelAverager one(PG{{1, pg}}, 0, pg);
    EXPECT_FALSE(w.messages.empty()) << "largest period 1 should warn";
  }
}

// ======== PostLocalSGDState / PostLocalSGDHook ===================================================

using ddpx::hooks::PostLocalSGDHook;
using ddpx::hooks::PostLocalSGDState;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// Rank `rank`'s gradient for bucket b of step s.
at::Tensor grad_input(int s, int b, int rank, at::ScalarType dtype) {
  return ddpx_test::make_tensor(
      ddpx_test::random_values(ddpx_test::rank_seed(2000 + s * 10 + b, rank), 37 + 11 * b), dtype);
}

// Runs `hook` over `count` buckets of step s as DDP does (runHook for 0..count-1, the last with
// isLast(), then waits), returning the results.
std::vector<at::Tensor> run_step(ddpx::hooks::CommHook& hook, int s, int rank, int count,
                                 at::ScalarType dtype, std::vector<at::Tensor>* buffers = nullptr) {
  std::vector<std::unique_ptr<ddpx_test::TestBucket>> buckets;
  std::vector<FuturePtr> futs;
  std::vector<at::Tensor> bufs;
  for (int b = 0; b < count; ++b) {
    bufs.push_back(grad_input(s, b, rank, dtype));
    buckets.push_back(ddpx_test::make_bucket(bufs.back(), b, count));
    futs.push_back(hook.runHook(buckets.back()->get()));
  }
  std::vector<at::Tensor> out;
  for (auto& f : futs) {
    f->wait();
    out.push_back(hook.parseHookResult(f->value()));
  }
  if (buffers) *buffers = bufs;
  return out;
}

TEST(PostLocalSGDHook, GlobalThenSubgroupMean) {
  const auto& pairs = pair_groups();
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(::testing::Message() << dtype);
    ddpx_test::run_ranks(4, [&](int rank, const ProcessGroupPtr& pg) {
      std::vector<std::string> lines;
      auto state = std::make_shared<PostLocalSGDState>(
          pg, pairs[rank], 2, true, [&](const std::string& l) { lines.push_back(l); });
      auto hook = ddpx::hooks::post_localSGD_hook(state);
      EXPECT_EQ(hook->name(), "post_localSGD_hook");
      ddpx::hooks::AllreduceHook reference(pg);
      for (int s = 0; s < 4; ++s) {
        std::vector<at::Tensor> buffers;
        const auto got = run_step(*hook, s, rank, 2, dtype, &buffers);
        EXPECT_EQ(state->iter(), std::min(s + 1, 2)) << "step " << s;
        EXPECT_EQ(state->local_phase(), s + 1 >= 2);
        for (int b = 0; b < 2; ++b) {
          EXPECT_EQ(got[b].data_ptr(), buffers[b].data_ptr()) << "result not in the bucket";
        }
        if (s < 2) {
          const auto want = run_step(reference, s, rank, 2, dtype);
          for (int b = 0; b < 2; ++b) {
            EXPECT_TRUE(bitwise_equal(got[b], want[b]))
                << "rank " << rank << " step " << s << " bucket " << b << ": not allreduce_hook's";
          }
        } else {
          const auto p = pair_of(rank);
          for (int b = 0; b < 2; ++b) {
            const auto x = ddpx_test::to_doubles(grad_input(s, b, p[0], dtype));
            const auto y = ddpx_test::to_doubles(grad_input(s, b, p[1], dtype));
            std::vector<double> mean(x.size());
            for (size_t i = 0; i < x.size(); ++i) mean[i] = (x[i] + y[i]) / 2;
            EXPECT_TRUE(holds(got[b], mean))
                << "rank " << rank << " step " << s << " bucket " << b << ": not the pair mean";
          }
        }
      }
      int starts = 0;
      for (const auto& l : lines) starts += l.find("Start to apply local SGD") != std::string::npos;
      EXPECT_EQ(starts, 1);
      ASSERT_FALSE(lines.empty());
      EXPECT_THAT(lines[0], HasSubstr("2"));
    });
  }
}

TEST(PostLocalSGDHook, NoPostLocalAllreduceLeavesTheBuffer) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto state = std::make_shared<PostLocalSGDState>(pg, ProcessGroupPtr(), 1, false,
                                                     [](const std::string&) {});
    PostLocalSGDHook hook(state);
    std::vector<at::Tensor> buffers;
    auto got = run_step(hook, 0, rank, 1, at::kFloat, &buffers);
    const auto x = ddpx_test::to_doubles(grad_input(0, 0, 0, at::kFloat));
    const auto y = ddpx_test::to_doubles(grad_input(0, 0, 1, at::kFloat));
    std::vector<double> mean(x.size());
    for (size_t i = 0; i < x.size(); ++i) mean[i] = (x[i] + y[i]) / 2;
    EXPECT_TRUE(holds(got[0], mean));
    for (int s = 1; s < 3; ++s) {
      got = run_step(hook, s, rank, 2, at::kFloat, &buffers);
      for (int b = 0; b < 2; ++b) {
        EXPECT_TRUE(got[b].is_same(buffers[b]) || got[b].data_ptr() == buffers[b].data_ptr());
        EXPECT_TRUE(bitwise_equal(got[b], grad_input(s, b, rank, at::kFloat)))
            << "step " << s << ": the local phase changed the gradient";
      }
      EXPECT_EQ(state->iter(), 1);
    }
  });
}

TEST(PostLocalSGDHook, IterCountsOnTheLastBucketAndStopsAtStart) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  std::vector<std::string> lines;
  auto state = std::make_shared<PostLocalSGDState>(
      pg, pg, 3, true, [&](const std::string& l) { lines.push_back(l); });
  PostLocalSGDHook hook(state);
  for (int s = 0; s < 6; ++s) {
    std::vector<std::unique_ptr<ddpx_test::TestBucket>> buckets;
    std::vector<at::Tensor> bufs;
    for (int b = 0; b < 3; ++b) {
      bufs.push_back(grad_input(s, b, 0, at::kFloat));
      buckets.push_back(ddpx_test::make_bucket(bufs.back(), b, 3));
      const int64_t before = state->iter();
      hook.runHook(buckets.back()->get())->wait();
      const bool counts = b == 2 && before < 3;
      EXPECT_EQ(state->iter(), before + (counts ? 1 : 0)) << "step " << s << " bucket " << b;
    }
  }
  EXPECT_EQ(state->iter(), 3);
  int starts = 0;
  for (const auto& l : lines) starts += l.find("Start to apply local SGD") != std::string::npos;
  EXPECT_EQ(starts, 1);

  // maybe_increase_iter itself.
  PostLocalSGDState st(pg, pg, 5, true, [](const std::string&) {});
  st.maybe_increase_iter(false);
  EXPECT_EQ(st.iter(), 0);
  st.maybe_increase_iter(true);
  EXPECT_EQ(st.iter(), 1);

  // start 0: local from the first step, nothing counted.
  auto zero = std::make_shared<PostLocalSGDState>(pg, pg, 0, true, [](const std::string&) {});
  PostLocalSGDHook zero_hook(zero);
  run_step(zero_hook, 0, 0, 2, at::kFloat);
  EXPECT_EQ(zero->iter(), 0);
  EXPECT_TRUE(zero->local_phase());
}

TEST(PostLocalSGDHook, NullSubgroupErrorsOnceLocal) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  auto state = std::make_shared<PostLocalSGDState>(pg, ProcessGroupPtr(), 1, true,
                                                   [](const std::string&) {});
  PostLocalSGDHook hook(state);
  run_step(hook, 0, 0, 1, at::kFloat);  // global phase: fine
  at::Tensor buf = grad_input(1, 0, 0, at::kFloat);
  auto bucket = ddpx_test::make_bucket(buf, 0, 1);
  EXPECT_THAT(value_error([&] { hook.runHook(bucket->get()); }),
              AllOf(HasSubstr("subgroup"), HasSubstr("post_local_gradient_allreduce")));
}

TEST(PostLocalSGDState, ArgumentsAndSetters) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  auto quiet = [](const std::string&) {};
  EXPECT_THAT(value_error([&] { PostLocalSGDState(pg, pg, -1, true, quiet); }),
              HasSubstr("start_localSGD_iter"));
  EXPECT_THAT(
      ddpx_test::error_message([&] { PostLocalSGDState(ProcessGroupPtr(), pg, 1, true, quiet); }),
      HasSubstr("process_group"));
  EXPECT_THAT(ddpx_test::error_message([&] { PostLocalSGDHook(nullptr); }), HasSubstr("state"));
  PostLocalSGDState st(pg, ProcessGroupPtr(), 4, false, quiet);
  EXPECT_EQ(st.start_localSGD_iter(), 4);
  EXPECT_FALSE(st.post_local_gradient_allreduce());
  EXPECT_EQ(st.iter(), 0);
  EXPECT_FALSE(st.local_phase());
  st.set_iter(4);
  EXPECT_TRUE(st.local_phase());
  EXPECT_THAT(value_error([&] { st.set_iter(-2); }), HasSubstr("iter"));
  EXPECT_THAT(value_error([&] { st.set_start_localSGD_iter(-2); }),
              HasSubstr("start_localSGD_iter"));
  EXPECT_THAT(ddpx_test::error_message([&] { st.set_process_group(ProcessGroupPtr()); }),
              HasSubstr("process_group"));
  EXPECT_EQ(st.iter(), 4);
  EXPECT_EQ(st.start_localSGD_iter(), 4);
}

TEST(PostLocalSGDState, StateDictRoundTripAndBadDicts) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  auto quiet = [](const std::string&) {};
  PostLocalSGDState a(pg, pg, 7, false, quiet);
  a.set_iter(5);
  const c10::impl::GenericDict d = a.state_dict();
  PostLocalSGDState b(pg, pg, 0, true, quiet);
  b.load_state_dict(d);
  EXPECT_EQ(b.iter(), 5);
  EXPECT_EQ(b.start_localSGD_iter(), 7);
  EXPECT_FALSE(b.post_local_gradient_allreduce());
  EXPECT_TRUE(b.process_group().get() == pg.get());

  for (const char* key : {"iter", "start_localSGD_iter", "post_local_gradient_allreduce"}) {
    c10::impl::GenericDict missing = d.copy();
    ASSERT_EQ(missing.erase(c10::IValue(std::string(key))), 1u);
    PostLocalSGDState c(pg, pg, 1, true, quiet);
    EXPECT_THAT(ddpx_test::error_message([&] { c.load_state_dict(missing); }),
                AllOf(HasSubstr(key), HasSubstr("missing")));
    EXPECT_EQ(c.start_localSGD_iter(), 1) << "a failed load must not change the state";
    EXPECT_EQ(c.iter(), 0);
  }
  {
    c10::impl::GenericDict bad = d.copy();
    bad.insert_or_assign(c10::IValue(std::string("iter")), c10::IValue(std::string("five")));
    PostLocalSGDState c(pg, pg, 1, true, quiet);
    EXPECT_THAT(ddpx_test::error_message([&] { c.load_state_dict(bad); }), HasSubstr("iter"));
    EXPECT_EQ(c.iter(), 0);
  }
  {
    c10::impl::GenericDict bad = d.copy();
    bad.insert_or_assign(c10::IValue(std::string("iter")), c10::IValue(int64_t{-1}));
    PostLocalSGDState c(pg, pg, 1, true, quiet);
    EXPECT_THAT(ddpx_test::error_message([&] { c.load_state_dict(bad); }), HasSubstr("iter"));
  }
  {
    c10::impl::GenericDict bad = d.copy();
    bad.insert_or_assign(c10::IValue(std::string("post_local_gradient_allreduce")),
                         c10::IValue(int64_t{1}));
    PostLocalSGDState c(pg, pg, 1, true, quiet);
    EXPECT_THAT(ddpx_test::error_message([&] { c.load_state_dict(bad); }),
                HasSubstr("post_local_gradient_allreduce"));
    EXPECT_TRUE(c.post_local_gradient_allreduce());
  }
}

// ======== PostLocalSGDOptimizer
// ===================================================================

TEST(PostLocalSGDOptimizer, StepIsLocalStepThenAveraging) {
  const int n = 2;
  const double lr = 0.25;
  const int64_t period = 2, warmup = 1;
  const int64_t numel = 6;
  // Closed form of both replicas, in doubles (all values dyadic with small denominators: exact).
  auto grad_of = [&](int s, int rank) { return dyadic_input(800 + s, rank, n, numel); };
  std::vector<std::vector<double>> x(n);
  for (int r = 0; r < n; ++r) x[r] = dyadic_input(799, r, n, numel);
  std::vector<std::vector<std::vector<double>>> expected;  // [step][rank]
  for (int s = 0; s < 7; ++s) {
    for (int r = 0; r < n; ++r) {
      const auto g = grad_of(s, r);
      for (int64_t i = 0; i < numel; ++i) x[r][i] -= lr * g[i];
    }
    if (s >= warmup && (s - warmup) % period == 0) {
      for (int64_t i = 0; i < numel; ++i) {
        const double m = (x[0][i] + x[1][i]) / 2;
        x[0][i] = x[1][i] = m;
      }
    }
    expected.push_back(x);
  }

  ddpx_test::run_ranks(n, [&](int rank, const ProcessGroupPtr& pg) {
    at::Tensor p = at::empty({numel}, at::kFloat);
    fill(p, dyadic_input(799, rank, n, numel));
    p.requires_grad_();
    at::Tensor frozen = at::full({3}, 1.0 + rank).requires_grad_();  // never gets a grad
    auto sgd = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{p, frozen},
                                                   torch::optim::SGDOptions(lr));
    auto avg = std::make_shared<ddpx::optim::PeriodicModelAverager>(period, warmup, pg);
    ddpx::optim::PostLocalSGDOptimizer opt(sgd, avg);
    EXPECT_EQ(opt.optimizer(), sgd);
    EXPECT_EQ(opt.averager(), avg);
    EXPECT_EQ(&opt.param_groups(), &sgd->param_groups());
    for (int s = 0; s < 7; ++s) {
      opt.zero_grad();
      EXPECT_FALSE(p.grad().defined());
      p.mutable_grad() = ddpx_test::make_tensor(grad_of(s, rank), at::kFloat);
      int calls = 0;
      at::Tensor loss;
      if (s % 2 == 0) {
        loss = opt.step([&] {
          ++calls;
          return at::scalar_tensor(3.5);
        });
        EXPECT_EQ(calls, 1);
        ASSERT_TRUE(loss.defined());
        EXPECT_EQ(loss.item<double>(), 3.5);
      } else {
        loss = opt.step();
      }
      EXPECT_EQ(avg->step(), s + 1);
      EXPECT_TRUE(holds(p.detach(), expected[s][rank])) << "rank " << rank << " step " << s;
      EXPECT_TRUE(holds(frozen.detach(), std::vector<double>(3, 1.0 + rank)));
    }
  });
}

TEST(PostLocalSGDOptimizer, ZeroGradAndParamGroups) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  at::Tensor p = at::ones({3}).requires_grad_();
  at::Tensor q = at::ones({2}).requires_grad_();
  auto sgd = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                                 torch::optim::SGDOptions(0.1));
  ddpx::optim::PostLocalSGDOptimizer opt(
      sgd, std::make_shared<ddpx::optim::PeriodicModelAverager>(2, 0, pg));
  p.mutable_grad() = at::full({3}, 2.0);
  opt.zero_grad(false);
  ASSERT_TRUE(p.grad().defined());
  EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
  opt.zero_grad(true);
  EXPECT_FALSE(p.grad().defined());
  p.mutable_grad() = at::full({3}, 2.0);
  opt.zero_grad();
  EXPECT_FALSE(p.grad().defined()) << "zero_grad() should default to set_to_none";

  opt.add_param_group(torch::optim::OptimizerParamGroup({q}));
  ASSERT_EQ(sgd->param_groups().size(), 2u);
  ASSERT_EQ(opt.param_groups().size(), 2u);
  EXPECT_TRUE(opt.param_groups()[1].params()[0].is_same(q));
  const ddpx::optim::PostLocalSGDOptimizer& cref = opt;
  EXPECT_EQ(cref.param_groups().size(), 2u);
}

TEST(PostLocalSGDOptimizer, NullArguments) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  at::Tensor p = at::ones({3}).requires_grad_();
  auto sgd = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                                 torch::optim::SGDOptions(0.1));
  auto avg = std::make_shared<ddpx::optim::PeriodicModelAverager>(2, 0, pg);
  EXPECT_THAT(value_error([&] { ddpx::optim::PostLocalSGDOptimizer(nullptr, avg); }),
              HasSubstr("optim"));
  EXPECT_THAT(value_error([&] { ddpx::optim::PostLocalSGDOptimizer(sgd, nullptr); }),
              HasSubstr("averager"));
}

// save() / load() through an archive in memory: the averager's step and the wrapped
// optimizer's state (momentum buffers) come back; training continues bit for bit.
TEST(PostLocalSGDOptimizer, SaveLoadRoundTrip) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto make = [&](const at::Tensor& init, std::shared_ptr<ddpx::optim::ModelAverager> avg) {
      at::Tensor p = init.clone().requires_grad_();
      auto sgd = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                                     torch::optim::SGDOptions(0.125).momentum(0.5));
      return std::make_pair(p, std::make_shared<ddpx::optim::PostLocalSGDOptimizer>(sgd, avg));
    };
    auto grad = [&](int s) {
      return ddpx_test::make_tensor(dyadic_input(900 + s, rank, 2, 8), at::kFloat);
    };
    at::Tensor init = ddpx_test::make_tensor(dyadic_input(899, rank, 2, 8), at::kFloat);
    auto a = make(init, std::make_shared<ddpx::optim::PeriodicModelAverager>(3, 1, pg));
    for (int s = 0; s < 3; ++s) {
      a.second->zero_grad();
      a.first.mutable_grad() = grad(s);
      a.second->step();
    }
    EXPECT_EQ(a.second->averager()->step(), 3);
    std::stringstream stream;
    {
      torch::serialize::OutputArchive out;
      a.second->save(out);
      out.save_to(stream);
    }
    auto b = make(a.first.detach(), std::make_shared<ddpx::optim::PeriodicModelAverager>(3, 1, pg));
    {
      torch::serialize::InputArchive in;
      in.load_from(stream);
      CaptureWarnings w;
      b.second->load(in);
      EXPECT_TRUE(w.messages.empty()) << w.joined();
    }
    EXPECT_EQ(b.second->averager()->step(), 3);
    // Steps 3 (not due), 4 (due: 4 = 1 + 3), 5: both copies in lockstep.
    for (int s = 3; s < 6; ++s) {
      for (auto* x : {&a, &b}) {
        x->second->zero_grad();
        x->first.mutable_grad() = grad(s);
        x->second->step();
      }
      EXPECT_TRUE(bitwise_equal(a.first.detach(), b.first.detach()))
          << "rank " << rank << " step " << s;
    }
    EXPECT_EQ(b.second->averager()->step(), 6);
  });
}

TEST(PostLocalSGDOptimizer, LoadWithoutStepWarnsAndRestartsAtZero) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  at::Tensor p = at::ones({3}).requires_grad_();
  auto sgd = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                                 torch::optim::SGDOptions(0.1));
  std::stringstream stream;
  {
    torch::serialize::OutputArchive out;
    sgd->save(out);  // a plain optimizer's archive: no averager step
    out.save_to(stream);
  }
  auto avg = std::make_shared<ddpx::optim::PeriodicModelAverager>(2, 0, pg);
  avg->set_step(5);
  ddpx::optim::PostLocalSGDOptimizer opt(sgd, avg);
  torch::serialize::InputArchive in;
  in.load_from(stream);
  CaptureWarnings w;
  opt.load(in);
  EXPECT_EQ(avg->step(), 0);
  ASSERT_FALSE(w.messages.empty()) << "loading without the step should warn";
  EXPECT_THAT(w.joined(), HasSubstr("step"));

  // A step of the wrong type is an error, not a silent reset.
  std::stringstream bad;
  {
    torch::serialize::OutputArchive out;
    sgd->save(out);
    out.write(ddpx::optim::PostLocalSGDOptimizer::kStepKey, c10::IValue(std::string("seven")));
    out.save_to(bad);
  }
  avg->set_step(5);
  torch::serialize::InputArchive bad_in;
  bad_in.load_from(bad);
  EXPECT_THAT(ddpx_test::error_message([&] { opt.load(bad_in); }),
              HasSubstr(ddpx::optim::PostLocalSGDOptimizer::kStepKey));
  EXPECT_EQ(avg->step(), 5);
}

}  // namespace

// ddpx::optim::DiLoCo over torch::optim::Adam, Streaming (2 fragments, delay 1, alpha 0.25) with
// 4-bit outer gradients: the global parameters are bit-identical on both ranks at every step
// and move at the fragments' outer steps only; a copy loaded from save() at step 6 (a fragment's
// exchange pending, residuals held) continues in lockstep with the original, bit for bit.
TEST(DiLoCo, GlobalParametersAgreeAndLoadResumesBitForBit) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    ddpx::optim::DiLoCoOptions o;
    o.sync_every = 4;
    o.fragments = 2;
    o.fragment_sync_delay = 1;
    o.fragment_update_alpha = 0.25;
    o.bits = 4;
    o.block_size = 64;
    struct Run {
      std::vector<at::Tensor> params;
      std::unique_ptr<ddpx::optim::DiLoCo> opt;
    };
    auto make = [&](const std::vector<at::Tensor>& init) {
      Run r;
      for (const auto& t : init) r.params.push_back(t.detach().clone().requires_grad_());
      auto adam = std::make_shared<torch::optim::Adam>(r.params, torch::optim::AdamOptions(1e-2));
      r.opt = std::make_unique<ddpx::optim::DiLoCo>(adam, pg, o);
      return r;
    };
    // Generators of their own: the rank threads share the default one.
    auto gen0 = at::detail::createCPUGenerator(7);  // the same initial values on both ranks
    const std::vector<at::Tensor> init = {at::randn({16, 12}, gen0), at::randn({16}, gen0),
                                          at::randn({3, 16}, gen0)};
    auto loss_step = [&](Run& r, int s) {
      auto gen = at::detail::createCPUGenerator(100 * rank + s);  // per-rank data
      const at::Tensor x = at::randn({8, 12}, gen);
      const at::Tensor y = at::randn({8, 3}, gen);
      r.opt->zero_grad();
      at::Tensor h = at::tanh(at::addmm(r.params[1], x, r.params[0].t()));
      at::mse_loss(at::mm(h, r.params[2].t()), y).backward();
      r.opt->step();
    };
    Run a = make(init);
    std::vector<std::vector<at::Tensor>> globals;
    std::stringstream stream;
    for (int s = 0; s < 6; ++s) loss_step(a, s);
    EXPECT_FALSE(a.opt->sync().pending().empty()) << "nothing in flight at the checkpoint";
    {
      torch::serialize::OutputArchive out;
      a.opt->save(out);
      out.save_to(stream);
    }
    std::vector<at::Tensor> at6;
    for (const auto& p : a.params) at6.push_back(p.detach().clone());
    Run b = make(at6);
    {
      torch::serialize::InputArchive in;
      in.load_from(stream);
      b.opt->load(in);
    }
    for (int s = 6; s < 12; ++s) {
      for (Run* r : {&a, &b}) loss_step(*r, s);
      for (size_t i = 0; i < a.params.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(a.params[i].detach(), b.params[i].detach()))
            << "rank " << rank << " step " << s << " parameter " << i;
      }
      std::vector<at::Tensor> g;
      for (const auto& t : a.opt->sync().global_params()) g.push_back(t.clone());
      globals.push_back(g);
    }
    EXPECT_EQ(a.opt->sync().step(), 12);
    // Both ranks' global parameters, bit for bit: all-gathered through the group.
    for (size_t k = 0; k < globals.size(); ++k) {
      at::Tensor mine =
          at::cat({globals[k][0].reshape(-1), globals[k][1], globals[k][2].reshape(-1)});
      std::vector<std::vector<at::Tensor>> out(1);
      for (int r = 0; r < 2; ++r) out[0].push_back(at::empty_like(mine));
      std::vector<at::Tensor> in{mine};
      pg->allgather(out, in)->wait();
      EXPECT_TRUE(bitwise_equal(out[0][0], out[0][1])) << "step " << k + 7;
    }
    // Fragment 0 (parameter 0) takes new global values at steps 2 + 1, 6 + 1, 10 + 1 (globals[k]:
    // after step 7 + k), and keeps them in between.
    EXPECT_TRUE(bitwise_equal(globals[0][0], globals[3][0]));   // steps 7 to 10
    EXPECT_FALSE(bitwise_equal(globals[3][0], globals[4][0]));  // the outer step at step 11
  });
}

TEST(DiLoCo, BadOptionsNameTheOption) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  at::Tensor p = at::zeros({4}).requires_grad_();
  auto make = [&](ddpx::optim::DiLoCoOptions o) {
    auto sgd = std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                                   torch::optim::SGDOptions(0.1));
    ddpx::optim::DiLoCo opt(sgd, pg, o);
  };
  ddpx::optim::DiLoCoOptions o;
  EXPECT_THROW(make(o), c10::ValueError);  // sync_every 0
  o.sync_every = 2;
  EXPECT_NO_THROW(make(o));
  o.fragments = 2;  // one parameter
  EXPECT_THAT([&] { make(o); }, ::testing::ThrowsMessage<c10::ValueError>(
                                    ::testing::HasSubstr("number of parameters")));
  o.fragments = 1;
  o.bits = 3;
  EXPECT_THAT([&] { make(o); },
              ::testing::ThrowsMessage<c10::ValueError>(::testing::HasSubstr("bits")));
}

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  // Rank threads are the parallelism here; intra-op threads would only oversubscribe.
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
