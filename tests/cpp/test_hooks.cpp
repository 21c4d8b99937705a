// Tests of the ddpx communication hooks on real Gloo process groups: 1 to 4 ranks as threads
// over one in-memory c10d::HashStore (see test_utils.h).
//
// Expected values are in closed form: every rank regenerates every rank's (seeded, nonzero)
// input and takes the mean in fp64. Tolerances follow from counting roundings:
//
//   S_i = (1/W) * sum_r |x_r[i]|   (the mean of magnitudes; bounds every partial sum / W)
//   u   = unit roundoff of the wire dtype: 2^-11 fp16, 2^-8 bf16, 2^-24 fp32, 2^-53 fp64
//
// A hook rounds at most W + 2 times into the wire dtype, each rounding off by at most u * S_i:
// the compression cast (or the division by W before an allreduce), W - 1 partial sums of a
// 16-bit allreduce, and the final store. Hence |result_i - mean_i| <= (W + 2) * u * S_i.
// allreduce_hook on fp32 uses the fixed bound 1e-6 * S_i (>= (W + 2) * 2^-24 * S_i for W <= 4).
// Inputs lie in [2^-6, 2^3) in magnitude, so x / W stays clear of fp16 subnormals and overflow
// and the relative bound holds; a dedicated test covers values near the fp16 maximum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ddpx/hooks.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <random>
#include <sstream>

#include "test_utils.h"

namespace {

using ddpx_test::bitwise_equal;

using ddpx::comm::ExchangeMode;
using ddpx::hooks::CommHookPtr;
using ddpx_test::ProcessGroupPtr;
using ::testing::AllOf;
using ::testing::HasSubstr;

// torch 1.13's Gloo has no bfloat16 reductions; newer releases have.
using ddpx::compat::kGlooReducesBf16;

enum class Hook { kAllreduce, kFp16Compress, kBf16Compress, kFp16Wrapper, kBf16Wrapper, kNoop };

const char* hook_name(Hook h) {
  switch (h) {
    case Hook::kAllreduce:
      return "allreduce_hook";
    case Hook::kFp16Compress:
      return "fp16_compress_hook";
    case Hook::kBf16Compress:
      return "bf16_compress_hook";
    case Hook::kFp16Wrapper:
      return "fp16_compress_wrapper_hook";
    case Hook::kBf16Wrapper:
      return "bf16_compress_wrapper_hook";
    case Hook::kNoop:
      return "noop_hook";
  }
  return "?";
}

// The dtype the values travel in.
at::ScalarType wire_dtype(Hook h, at::ScalarType bucket) {
  switch (h) {
    case Hook::kFp16Compress:
    case Hook::kFp16Wrapper:
      return at::kHalf;
    case Hook::kBf16Compress:
    case Hook::kBf16Wrapper:
      return at::kBFloat16;
    default:
      return bucket;
  }
}

struct HookCase {
  Hook hook;
  int world;
  int64_t n;
  at::ScalarType dtype;  // of the bucket
  ExchangeMode mode;     // of the hook (of the wrapped allreduce_hook for wrappers)
};

std::string case_name(const HookCase& c) {
  std::ostringstream os;
  os << hook_name(c.hook) << "_w" << c.world << "_n" << c.n << "_"
     << (c.dtype == at::kFloat    ? "f32"
         : c.dtype == at::kDouble ? "f64"
         : c.dtype == at::kHalf   ? "f16"
                                  : "bf16");
  if (c.hook != Hook::kNoop) os << "_" << ddpx::comm::exchange_mode_name(c.mode);
  return os.str();
}

// gtest prints parameters of failing cases with this.
void PrintTo(const HookCase& c, std::ostream* os) { *os << case_name(c); }

// kAuto goes through the public factories (the way users build hooks); explicit modes through
// the classes' constructors.
CommHookPtr make_hook(const HookCase& c, const ProcessGroupPtr& pg) {
  using namespace ddpx::hooks;
  const bool by_factory = c.mode == ExchangeMode::kAuto;
  auto inner_allreduce = [&]() -> CommHookPtr {
    return by_factory ? allreduce_hook(pg) : std::make_shared<AllreduceHook>(pg, c.mode);
  };
  switch (c.hook) {
    case Hook::kAllreduce:
      return inner_allreduce();
    case Hook::kFp16Compress:
      return by_factory ? fp16_compress_hook(pg)
                        : std::make_shared<CompressHook>(pg, at::kHalf, c.mode);
    case Hook::kBf16Compress:
      return by_factory ? bf16_compress_hook(pg)
                        : std::make_shared<CompressHook>(pg, at::kBFloat16, c.mode);
    case Hook::kFp16Wrapper:
      return fp16_compress_wrapper(inner_allreduce());
    case Hook::kBf16Wrapper:
      return bf16_compress_wrapper(inner_allreduce());
    case Hook::kNoop:
      return noop_hook();
  }
  return nullptr;
}

// Bound on |result_i - mean_i| in units of S_i (see the file comment).
double tolerance_factor(const HookCase& c) {
  if (c.hook == Hook::kNoop) return 0.0;
  const double w = c.world;
  if (c.hook == Hook::kAllreduce && c.dtype == at::kFloat) return 1e-6;
  if (c.hook == Hook::kAllreduce && c.dtype == at::kDouble && c.mode == ExchangeMode::kAllgather) {
    // The kernels take the 1/W scale as a float, so fp64 buckets summed by sum_rows are scaled
    // by float(1/W): relative error ~3e-8 for W = 3, far above fp64 rounding. A library
    // limitation (scale should be double for fp64), bounded here at fp32 level.
    return (w + 2) * ddpx_test::unit_roundoff(at::kFloat);
  }
  return (w + 2) * ddpx_test::unit_roundoff(wire_dtype(c.hook, c.dtype));
}

uint64_t case_seed(const HookCase& c) {
  return ddpx_test::mix_seed(static_cast<uint64_t>(c.hook) * 1000 + c.world * 100 +
                             static_cast<uint64_t>(c.dtype) * 10 + static_cast<uint64_t>(c.mode)) ^
         static_cast<uint64_t>(c.n);
}

// Rank r's bucket values, already rounded to the bucket dtype.
at::Tensor rank_input(uint64_t test_seed, int rank, int64_t n, at::ScalarType dtype) {
  return ddpx_test::make_tensor(ddpx_test::random_values(ddpx_test::rank_seed(test_seed, rank), n),
                                dtype);
}

// Closed-form expectation: mean over ranks and mean magnitude S, in fp64.
struct Expected {
  std::vector<double> mean;
  std::vector<double> mean_abs;
};

Expected expected_mean(uint64_t test_seed, int world, int64_t n, at::ScalarType dtype) {
  Expected e{std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (int r = 0; r < world; ++r) {
    const auto x = ddpx_test::to_doubles(rank_input(test_seed, r, n, dtype));
    for (int64_t i = 0; i < n; ++i) {
      e.mean[i] += x[i];
      e.mean_abs[i] += std::fabs(x[i]);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    e.mean[i] /= world;
    e.mean_abs[i] /= world;
  }
  return e;
}

// Checks `got` against `want` within factor * S_i per element; reports the worst element.
void expect_close(const at::Tensor& got, const Expected& want, double factor,
                  const std::string& what) {
  const auto g = ddpx_test::to_doubles(got);
  ASSERT_EQ(g.size(), want.mean.size()) << what;
  int64_t bad = 0, worst = -1;
  double worst_ratio = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double err = std::fabs(g[i] - want.mean[i]);
    const double tol = factor * want.mean_abs[i];
    if (!(err <= tol)) {  // also catches NaN
      ++bad;
      const double ratio = tol > 0 ? err / tol : INFINITY;
      if (worst < 0 || ratio > worst_ratio || std::isnan(err)) {
        worst = static_cast<int64_t>(i);
        worst_ratio = ratio;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " elements off; worst ["
                    << worst << "] got " << (worst >= 0 ? g[worst] : 0.0) << ", expected "
                    << (worst >= 0 ? want.mean[worst] : 0.0) << " +- "
                    << (worst >= 0 ? factor * want.mean_abs[worst] : 0.0);
}

class HookTest : public ::testing::TestWithParam<HookCase> {};

TEST_P(HookTest, AveragesOverRanks) {
  const HookCase c = GetParam();
  const uint64_t seed = case_seed(c);
  const std::string what = case_name(c);
  // noop_hook leaves each rank's own values; every other hook averages.
  const Expected mean =
      c.hook == Hook::kNoop ? Expected{} : expected_mean(seed, c.world, c.n, c.dtype);
  const double factor = tolerance_factor(c);
  std::vector<at::Tensor> results(c.world);

  ddpx_test::run_ranks(c.world, [&](int rank, const ProcessGroupPtr& pg) {
    CommHookPtr hook = make_hook(c, pg);
    ASSERT_NE(hook, nullptr);
    EXPECT_EQ(hook->name(), hook_name(c.hook));
    const at::Tensor input = rank_input(seed, rank, c.n, c.dtype);
    at::Tensor buffer = input.clone();
    auto bucket = ddpx_test::make_bucket(buffer);

    auto fut = hook->runHook(bucket->get());
    ASSERT_TRUE(fut);
    fut->wait();
    ASSERT_FALSE(fut->hasError()) << what << " rank " << rank << ": "
                                  << fut->tryRetrieveErrorMessage();
    const at::Tensor value = hook->parseHookResult(fut->value());

    ASSERT_EQ(value.scalar_type(), c.dtype) << what;
    ASSERT_EQ(value.numel(), c.n) << what;
    // The bucket still owns its original buffer (wrappers swap it only while starting the
    // inner hook), and that buffer holds exactly what the future returned.
    EXPECT_TRUE(bucket->get().getBuffer().is_same(buffer)) << what << ": bucket buffer replaced";
    EXPECT_TRUE(bitwise_equal(buffer, value)) << what << ": bucket buffer != future value";

    if (c.hook == Hook::kNoop) {
      EXPECT_TRUE(value.is_same(buffer)) << what;
      EXPECT_TRUE(bitwise_equal(value, input)) << what << ": noop_hook changed the values";
    } else {
      expect_close(value, mean, factor, what + " rank " + std::to_string(rank));
      EXPECT_TRUE(bitwise_equal(buffer, value));
    }
    results[rank] = value.clone();
  });

  // DDP relies on every replica applying the same gradient: all ranks must agree bit for bit.
  if (c.hook != Hook::kNoop) {
    for (int r = 1; r < c.world; ++r) {
      if (results[r].defined() && results[0].defined()) {
        EXPECT_TRUE(bitwise_equal(results[r], results[0]))
            << what << ": rank " << r << " differs from rank 0";
      }
    }
  }
}

std::vector<HookCase> all_cases() {
  const ExchangeMode modes[] = {ExchangeMode::kAuto, ExchangeMode::kAllreduce,
                                ExchangeMode::kAllgather, ExchangeMode::kReduceScatter};
  const int64_t sizes[] = {1, 1000, 65537};
  std::vector<HookCase> cases;
  for (int world = 1; world <= 4; ++world) {
    for (int64_t n : sizes) {
      // allreduce_hook: fp32/fp64 buckets, and 16-bit buckets (as inside a compress wrapper).
      for (at::ScalarType dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
        for (ExchangeMode m : modes) {
          if (dt == at::kBFloat16 && m == ExchangeMode::kAllreduce && !kGlooReducesBf16) continue;
          cases.push_back({Hook::kAllreduce, world, n, dt, m});
        }
      }
      for (Hook h :
           {Hook::kFp16Compress, Hook::kBf16Compress, Hook::kFp16Wrapper, Hook::kBf16Wrapper}) {
        for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
          for (ExchangeMode m : modes) {
            const bool bf16 = h == Hook::kBf16Compress || h == Hook::kBf16Wrapper;
            if (bf16 && m == ExchangeMode::kAllreduce && !kGlooReducesBf16) continue;
            cases.push_back({h, world, n, dt, m});
          }
        }
      }
      for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
        cases.push_back({Hook::kNoop, world, n, dt, ExchangeMode::kAuto});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Gloo, HookTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<HookCase>& info) {
                           return case_name(info.param);
                         });

// ---- behaviour beyond one bucket ------------------------------------------------------------

// Runs fp16_compress_hook on `buffer` (kAuto: the factory, as users get it; otherwise the class
// with that exchange mode) and waits for it.
c10::intrusive_ptr<c10::ivalue::Future> run_fp16_hook(const ProcessGroupPtr& pg, ExchangeMode m,
                                                      const at::Tensor& buffer) {
  CommHookPtr hook = m == ExchangeMode::kAuto
                         ? ddpx::hooks::fp16_compress_hook(pg)
                         : std::make_shared<ddpx::hooks::CompressHook>(pg, at::kHalf, m);
  auto bucket = ddpx_test::make_bucket(buffer);
  auto fut = hook->runHook(bucket->get());
  fut->wait();
  return fut;
}

// fp16_compress_hook divides *before* casting. Rank 0 holds gradients in [1.2, 1.5) * W * 32752
// (>= 65520 for W >= 2: they overflow fp16 unless divided by W first), the other ranks ordinary
// values, so that the mean fits fp16. With every rank near the top, the mean may exceed 65504:
// the allgather exchange sums in fp32 and must still return it (a 16-bit allreduce would
// overflow there, as torch's hook does); the reduce-scatter exchange sends the mean in 16 bits,
// so it returns +-inf exactly where the mean rounds beyond fp16's range, and the mean elsewhere.
TEST(HookNumerics, Fp16CompressDividesBeforeCasting) {
  for (int world : {2, 4}) {
    for (bool all_large : {false, true}) {
      const int64_t n = 4096;
      const uint64_t seed = 4242 + world * 2 + all_large;
      auto input_of = [&](int rank) {
        auto v = ddpx_test::random_values(ddpx_test::rank_seed(seed, rank), n);
        if (rank == 0 || all_large) {
          std::mt19937_64 gen(ddpx_test::rank_seed(seed + 1, rank));
          std::uniform_real_distribution<double> u(1.2, 1.5);
          for (size_t i = 0; i < v.size(); ++i) {
            const double sign = all_large ? (i % 2 ? -1.0 : 1.0) : (v[i] < 0 ? -1.0 : 1.0);
            v[i] = sign * u(gen) * world * 32752.0;
          }
        }
        return ddpx_test::make_tensor(v, at::kFloat);
      };
      Expected want{std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
      for (int r = 0; r < world; ++r) {
        const auto x = ddpx_test::to_doubles(input_of(r));
        for (int64_t i = 0; i < n; ++i) {
          want.mean[i] += x[i] / world;
          want.mean_abs[i] += std::fabs(x[i]) / world;
        }
      }
      // Not kAllreduce: Gloo's fp16 sum is wrong for some of these magnitudes (see
      // GlooFp16AllreduceBugIsAvoided below). kAuto is kAllgather on 2 ranks, kReduceScatter on 4.
      const ExchangeMode modes[] = {ExchangeMode::kAuto, ExchangeMode::kAllgather,
                                    ExchangeMode::kReduceScatter};
      ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
        for (ExchangeMode m : modes) {
          const std::string what = "fp16 near max, world " + std::to_string(world) +
                                   (all_large ? ", all ranks large, " : ", rank 0 large, ") +
                                   ddpx::comm::exchange_mode_name(m);
          at::Tensor buffer = input_of(rank);
          auto fut = run_fp16_hook(pg, m, buffer);
          ASSERT_FALSE(fut->hasError()) << fut->tryRetrieveErrorMessage();
          const bool scattered =
              m == ExchangeMode::kReduceScatter || (m == ExchangeMode::kAuto && world >= 3);
          if (!scattered || !all_large) {
            EXPECT_TRUE(at::isfinite(buffer).all().item<bool>()) << what;
            expect_close(buffer, want, (world + 2) * ddpx_test::unit_roundoff(at::kHalf), what);
            continue;
          }
          // Beyond 65520 a mean rounds to inf in fp16; below 65504 it stays finite.
          std::vector<double> got = ddpx_test::to_doubles(buffer);
          Expected in_range{std::vector<double>(n, 0.0), std::vector<double>(n, 1.0)};
          int64_t overflowed = 0, wrong = 0;
          for (int64_t i = 0; i < n; ++i) {
            const double mean = want.mean[i];
            if (std::fabs(mean) > 65520 * (1 + 1e-6)) {
              ++overflowed;
              wrong += !(std::isinf(got[i]) && (got[i] > 0) == (mean > 0));
              in_range.mean[i] = got[i] = 0.0;  // compared below as 0 == 0
            } else if (std::fabs(mean) < 65504) {
              in_range.mean[i] = mean;
              in_range.mean_abs[i] = want.mean_abs[i];
            } else {
              in_range.mean[i] = got[i] = 0.0;  // at the edge: rounds either way
            }
          }
          EXPECT_GT(overflowed, 0) << what << ": the case should reach beyond fp16's range";
          EXPECT_EQ(wrong, 0) << what << ": means beyond fp16's range must be +-inf";
          expect_close(ddpx_test::make_tensor(got, at::kDouble), in_range,
                       (world + 2) * ddpx_test::unit_roundoff(at::kHalf), what);
        }
      });
    }
  }
}

// Gloo's fp16 sum (gloo/types.h, float16::operator=) skips the assignment when the new value's
// bits equal float16(int(old value's bits)): e.g. 43712 (0x7956) + -0.0530396 (0xAACA, and
// float16(43722.0) is 0x7956) returns -0.0530396. torch's fp16_compress_hook on Gloo inherits
// this; ddpx's default exchange on Gloo (allgather + fp32 sum) must not. The explicit
// kAllreduce result is only reported, since it depends on the Gloo build.
// (The random cases of HookTest cannot trigger it: their 16-bit partial sums stay below 32,
// while the bug needs an accumulator >= 8192 in magnitude.)
TEST(HookNumerics, GlooFp16AllreduceBugIsAvoided) {
  const int world = 2;
  const int64_t n = 4096;
  // One rank sends 43712, the other -0.0530396 (both exact in fp16 after the division by 2);
  // which rank that is alternates by element, so that whichever rank accumulates an element
  // in Gloo's ring, some elements start from -0.0530396.
  auto input_of = [&](int rank) {
    at::Tensor t = at::empty({n}, at::kFloat);
    for (int64_t i = 0; i < n; ++i) {
      t[i] = ((i / 7) % 2 == rank) ? 87424.0 : -0.1060791015625;
    }
    return t;
  };
  Expected want{std::vector<double>(n, (87424.0 - 0.1060791015625) / 2),
                std::vector<double>(n, (87424.0 + 0.1060791015625) / 2)};
  std::vector<std::string> allreduce_report(world);
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    for (ExchangeMode m :
         {ExchangeMode::kAuto, ExchangeMode::kAllgather, ExchangeMode::kAllreduce}) {
      at::Tensor buffer = input_of(rank);
      auto fut = run_fp16_hook(pg, m, buffer);
      ASSERT_FALSE(fut->hasError()) << fut->tryRetrieveErrorMessage();
      if (m == ExchangeMode::kAllreduce) {
        const auto got = ddpx_test::to_doubles(buffer);
        int64_t wrong = 0;
        for (int64_t i = 0; i < n; ++i) wrong += std::fabs(got[i] - want.mean[i]) > 64;
        allreduce_report[rank] =
            std::to_string(wrong) + " of " + std::to_string(n) + " elements wrong";
      } else {
        expect_close(buffer, want, (world + 2) * ddpx_test::unit_roundoff(at::kHalf),
                     std::string("43712 + -0.0530396, ") + ddpx::comm::exchange_mode_name(m));
      }
    }
  });
  std::cout << "[ info ] explicit fp16 allreduce on Gloo, 43712 + -0.0530396: "
            << allreduce_report[0] << " (nonzero: Gloo's float16 bug)" << std::endl;
}

// Several buckets in flight at once (as DDP does), completed in reverse order.
TEST(HookNumerics, SeveralBucketsInFlight) {
  const int world = 3;
  const int64_t sizes[] = {513, 20000, 7};
  const at::ScalarType dtype = at::kFloat;
  std::vector<Expected> want;
  for (int b = 0; b < 3; ++b) want.push_back(expected_mean(900 + b, world, sizes[b], dtype));
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    for (CommHookPtr hook : {ddpx::hooks::allreduce_hook(pg), ddpx::hooks::fp16_compress_hook(pg),
                             ddpx::hooks::bf16_compress_wrapper(ddpx::hooks::allreduce_hook(pg))}) {
      std::vector<at::Tensor> buffers;
      std::vector<std::unique_ptr<ddpx_test::TestBucket>> buckets;
      std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futs;
      for (int b = 0; b < 3; ++b) {
        buffers.push_back(rank_input(900 + b, rank, sizes[b], dtype));
        buckets.push_back(ddpx_test::make_bucket(buffers.back(), b, 3));
        futs.push_back(hook->runHook(buckets.back()->get()));
      }
      const double u = hook->name() == "allreduce_hook" ? 1e-6 / (world + 2)
                       : hook->name() == "fp16_compress_hook"
                           ? ddpx_test::unit_roundoff(at::kHalf)
                           : ddpx_test::unit_roundoff(at::kBFloat16);
      for (int b = 2; b >= 0; --b) {
        futs[b]->wait();
        ASSERT_FALSE(futs[b]->hasError()) << futs[b]->tryRetrieveErrorMessage();
        expect_close(buffers[b], want[b], (world + 2) * u,
                     hook->name() + " bucket " + std::to_string(b));
      }
    }
  });
}

// DDP's Reducer owns hooks through SharedCommHook; it must forward runHook and parseHookResult.
TEST(HookApi, SharedCommHookForwards) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  auto shared = std::make_unique<ddpx::hooks::SharedCommHook>(ddpx::hooks::fp16_compress_hook(pg));
  EXPECT_EQ(shared->hook()->name(), "fp16_compress_hook");
  at::Tensor buffer = rank_input(77, 0, 100, at::kFloat);
  const at::Tensor input = buffer.clone();
  auto bucket = ddpx_test::make_bucket(buffer);
  auto fut = shared->runHook(bucket->get());
  fut->wait();
  at::Tensor out = shared->parseHookResult(fut->value());
  EXPECT_TRUE(out.is_same(buffer));
  // World size 1: the result is the input rounded to fp16.
  EXPECT_TRUE(bitwise_equal(out, input.to(at::kHalf).to(at::kFloat)));
}

TEST(HookApi, ParseHookResultAcceptsTensorOrSingletonList) {
  CommHookPtr hook = ddpx::hooks::noop_hook();
  at::Tensor t = at::ones({3});
  EXPECT_TRUE(hook->parseHookResult(c10::IValue(t)).is_same(t));
  c10::List<at::Tensor> one({t});
  EXPECT_TRUE(hook->parseHookResult(c10::IValue(one)).is_same(t));
  c10::List<at::Tensor> two({t, t});
  EXPECT_THAT(ddpx_test::error_message([&] { hook->parseHookResult(c10::IValue(two)); }),
              AllOf(HasSubstr("noop_hook"), HasSubstr("one tensor")));
  EXPECT_THAT(ddpx_test::error_message([&] { hook->parseHookResult(c10::IValue(int64_t{3})); }),
              HasSubstr("noop_hook"));
}

TEST(HookApi, ExchangeModeNamesRoundTrip) {
  using ddpx::comm::exchange_mode_name;
  using ddpx::comm::parse_exchange_mode;
  for (ExchangeMode m : {ExchangeMode::kAuto, ExchangeMode::kAllreduce, ExchangeMode::kAllgather}) {
    EXPECT_EQ(parse_exchange_mode(exchange_mode_name(m)), m);
  }
  EXPECT_THAT(ddpx_test::error_message([] { parse_exchange_mode("ring"); }),
              AllOf(HasSubstr("exchange"), HasSubstr("ring")));
}

TEST(HookApi, AutoExchangeResolvesByDtypeOnGloo) {
  using ddpx::comm::resolve_exchange_mode;
  const auto& pg = *ddpx_test::shared_gloo_world(1)[0];
  EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAuto, pg, at::kHalf, at::kCPU),
            ExchangeMode::kAllgather);
  EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAuto, pg, at::kBFloat16, at::kCPU),
            ExchangeMode::kAllgather);
  EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAuto, pg, at::kFloat, at::kCPU),
            ExchangeMode::kAllreduce);
  EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAuto, pg, at::kDouble, at::kCPU),
            ExchangeMode::kAllreduce);
  EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAllreduce, pg, at::kHalf, at::kCPU),
            ExchangeMode::kAllreduce);
  EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAllgather, pg, at::kFloat, at::kCPU),
            ExchangeMode::kAllgather);
  // The one 16-bit rule everything asks (the hooks' exchange, parameter averaging's dtype).
  using ddpx::comm::backend_sums_natively;
  EXPECT_FALSE(backend_sums_natively(pg, at::kHalf, at::kCPU));
  EXPECT_FALSE(backend_sums_natively(pg, at::kBFloat16, at::kCPU));
  EXPECT_TRUE(backend_sums_natively(pg, at::kFloat, at::kCPU));
  EXPECT_TRUE(backend_sums_natively(pg, at::kDouble, at::kCPU));
}

// ---- bad input: a c10::Error that names the hook ----------------------------------------------

std::vector<CommHookPtr> hooks_that_check_buckets(const ProcessGroupPtr& pg) {
  using namespace ddpx::hooks;
  return {allreduce_hook(pg), fp16_compress_hook(pg), bf16_compress_hook(pg),
          fp16_compress_wrapper(allreduce_hook(pg)), bf16_compress_wrapper(allreduce_hook(pg))};
}

// Sparse buckets (nn.Embedding(sparse=True)): the compression hooks refuse them, naming the hooks
// that do take them; allreduce_hook averages them as torch's does (a sparse allreduce).
TEST(HookErrors, SparseBucketIsRejectedByCompression) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  at::Tensor indices = at::zeros({1, 2}, at::kLong);
  indices[0][1] = 3;
  at::Tensor sparse = at::sparse_coo_tensor(indices, at::ones({2}), {8});
  for (const auto& hook : hooks_that_check_buckets(pg)) {
    if (hook->name() == "allreduce_hook") continue;
    auto bucket = ddpx_test::make_bucket(sparse);
    EXPECT_THAT(ddpx_test::error_message([&] { hook->runHook(bucket->get()); }),
                AllOf(HasSubstr(hook->name()), HasSubstr("sparse gradients cannot be compressed"),
                      HasSubstr("allreduce_hook")));
  }
}

TEST(HookErrors, SparseBucketIsAveragedByAllreduce) {
  at::Tensor indices = at::zeros({1, 2}, at::kLong);
  indices[0][1] = 3;
  for (int world : {1, 2}) {
    ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
      at::Tensor sparse =
          at::sparse_coo_tensor(indices, at::full({2}, static_cast<float>(rank + 1)), {8});
      auto bucket = ddpx_test::make_bucket(sparse);
      auto fut = ddpx::hooks::allreduce_hook(pg)->runHook(bucket->get());
      fut->wait();
      ASSERT_FALSE(fut->hasError()) << fut->tryRetrieveErrorMessage();
      const at::Tensor got = fut->value().toTensor().to_dense();
      // Elements 0 and 3 hold the mean of rank + 1 over the ranks (1, or 1.5 on two ranks).
      at::Tensor want = at::zeros({8});
      want[0] = want[3] = world == 1 ? 1.0f : 1.5f;
      EXPECT_TRUE(bitwise_equal(got, want)) << "world " << world << " rank " << rank << ": " << got;
    });
  }
}

TEST(HookErrors, IntegerBucketIsRejected) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  for (at::ScalarType dt : {at::kInt, at::kLong, at::kByte}) {
    for (const auto& hook : hooks_that_check_buckets(pg)) {
      at::Tensor buffer = at::ones({16}, dt);
      auto bucket = ddpx_test::make_bucket(buffer);
      EXPECT_THAT(ddpx_test::error_message([&] { hook->runHook(bucket->get()); }),
                  AllOf(HasSubstr(hook->name()), HasSubstr("floating-point")))
          << dt;
      EXPECT_TRUE(bitwise_equal(buffer, at::ones({16}, dt))) << "rejected bucket was modified";
    }
  }
}

TEST(HookErrors, NonContiguousBucketIsRejected) {
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  for (const auto& hook : hooks_that_check_buckets(pg)) {
    at::Tensor strided = at::ones({32}).slice(0, 0, 32, 2);
    auto bucket = ddpx_test::make_bucket(strided);
    EXPECT_THAT(ddpx_test::error_message([&] { hook->runHook(bucket->get()); }),
                AllOf(HasSubstr(hook->name()), HasSubstr("contiguous")));
  }
}

TEST(HookErrors, NullProcessGroupIsRejected) {
  using namespace ddpx::hooks;
  const ProcessGroupPtr null_pg;
  EXPECT_THAT(ddpx_test::error_message([&] { allreduce_hook(null_pg); }),
              AllOf(HasSubstr("allreduce_hook"), HasSubstr("process_group")));
  EXPECT_THAT(ddpx_test::error_message([&] { AllreduceHook(null_pg, ExchangeMode::kAllgather); }),
              AllOf(HasSubstr("allreduce_hook"), HasSubstr("process_group")));
  EXPECT_THAT(ddpx_test::error_message([&] { fp16_compress_hook(null_pg); }),
              AllOf(HasSubstr("fp16_compress_hook"), HasSubstr("process_group")));
  EXPECT_THAT(ddpx_test::error_message([&] { bf16_compress_hook(null_pg); }),
              AllOf(HasSubstr("bf16_compress_hook"), HasSubstr("process_group")));
  EXPECT_THAT(ddpx_test::error_message([&] { fp16_compress_wrapper(nullptr); }),
              AllOf(HasSubstr("fp16_compress_wrapper_hook"), HasSubstr("hook")));
  EXPECT_THAT(ddpx_test::error_message([&] { bf16_compress_wrapper(nullptr); }),
              HasSubstr("bf16_compress_wrapper_hook"));
  EXPECT_THAT(ddpx_test::error_message([&] { SharedCommHook(nullptr); }),
              HasSubstr("SharedCommHook"));
}

TEST(HookErrors, BadCompressDtypeIsRejected) {
  using namespace ddpx::hooks;
  const auto& pg = ddpx_test::shared_gloo_world(1)[0];
  for (at::ScalarType dt : {at::kFloat, at::kDouble, at::kInt}) {
    EXPECT_THAT(ddpx_test::error_message([&] { CompressHook(pg, dt); }),
                AllOf(HasSubstr("CompressHook"), HasSubstr("float16"), HasSubstr("bfloat16")))
        << dt;
    EXPECT_THAT(ddpx_test::error_message([&] { CompressWrapper(allreduce_hook(pg), dt); }),
                AllOf(HasSubstr("CompressWrapper"), HasSubstr("float16")))
        << dt;
  }
}

// A collective that fails must fail the hook's future, never complete it with unreduced values
// (sum_into's continuations begin with `f.value()`, which rethrows: Future::then does not forward
// a parent's error by itself). A real backend's failure: torch 1.13's Gloo rejects bfloat16
// reductions asynchronously ("Invalid scalar type", reported through the work's future). On
// 2.x, where Gloo reduces bf16, FailedCollectiveFailsEveryHookPath below covers the same paths.
TEST(HookErrors, CollectiveErrorReachesTheFuture) {
  if (kGlooReducesBf16) {
    GTEST_SKIP() << "Gloo reduces bfloat16 in this torch: no failing collective to inject";
  }
  // A private world: a failed collective must not leave the shared groups out of step.
  const auto pgs = ddpx_test::make_gloo_world(2);
  ddpx_test::run_ranks(pgs, [&](int rank, const ProcessGroupPtr& pg) {
    using namespace ddpx::hooks;
    const at::Tensor input = rank_input(31, rank, 1000, at::kFloat);
    for (CommHookPtr hook :
         {CommHookPtr(std::make_shared<CompressHook>(pg, at::kBFloat16, ExchangeMode::kAllreduce)),
          bf16_compress_wrapper(std::make_shared<AllreduceHook>(pg, ExchangeMode::kAllreduce))}) {
      at::Tensor buffer = input.clone();
      auto bucket = ddpx_test::make_bucket(buffer);
      auto fut = hook->runHook(bucket->get());
      fut->wait();
      EXPECT_TRUE(fut->hasError()) << hook->name() << " rank " << rank
                                   << ": Gloo's bf16 allreduce failed, the future did not";
    }
  });
}

// The same on every torch, with a process group whose collectives fail (test_utils.h), through
// every exchange path: allreduce, the gather, and the chunked gather (> 2^21 elements), whose
// result future is built from several chunk futures.
TEST(HookErrors, FailedCollectiveFailsEveryHookPath) {
  using namespace ddpx::hooks;
  const auto pg = ddpx_test::make_failing_group(0, 2, "injected collective failure");
  struct Case {
    const char* what;
    CommHookPtr hook;
    int64_t numel;
  };
  const std::vector<Case> cases = {
      {"allreduce_hook", std::make_shared<AllreduceHook>(pg, ExchangeMode::kAllreduce), 1000},
      {"fp16 allreduce", std::make_shared<CompressHook>(pg, at::kHalf, ExchangeMode::kAllreduce),
       1000},
      {"bf16 gather", std::make_shared<CompressHook>(pg, at::kBFloat16, ExchangeMode::kAuto), 1000},
      {"fp16 chunked gather",
       std::make_shared<CompressHook>(pg, at::kHalf, ExchangeMode::kAllgather), (1 << 21) + 7},
      {"bf16 wrapper(allreduce)",
       bf16_compress_wrapper(std::make_shared<AllreduceHook>(pg, ExchangeMode::kAllreduce)), 1000},
  };
  for (const auto& c : cases) {
    at::Tensor buffer = rank_input(37, 0, c.numel, at::kFloat);
    auto bucket = ddpx_test::make_bucket(buffer);
    auto fut = c.hook->runHook(bucket->get());
    fut->wait();
    ASSERT_TRUE(fut->hasError()) << c.what << ": the collective failed, the future did not";
    EXPECT_THAT(fut->tryRetrieveErrorMessage(), HasSubstr("injected collective failure")) << c.what;
  }
}

// A hook that fails while starting: the wrapper must give the bucket its buffer back.
class ThrowingHook final : public ddpx::hooks::CommHook {
 public:
  std::string name() const override { return "throwing_hook"; }
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket&) override {
    TORCH_CHECK(false, "throwing_hook: refused");
  }
};

TEST(HookErrors, WrapperRestoresBufferWhenInnerHookThrows) {
  auto wrapper = ddpx::hooks::fp16_compress_wrapper(std::make_shared<ThrowingHook>());
  at::Tensor buffer = rank_input(5, 0, 64, at::kFloat);
  const at::Tensor before = buffer.clone();
  auto bucket = ddpx_test::make_bucket(buffer);
  EXPECT_THAT(ddpx_test::error_message([&] { wrapper->runHook(bucket->get()); }),
              HasSubstr("throwing_hook: refused"));
  EXPECT_TRUE(bucket->get().getBuffer().is_same(buffer));
  EXPECT_TRUE(bitwise_equal(buffer, before));
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  // Rank threads are the parallelism here; intra-op threads would only oversubscribe.
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
