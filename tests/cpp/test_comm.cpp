// Tests of the collective layer (ddpx::comm) on real Gloo process groups (1 to 4 ranks as threads
// over one in-memory store, see test_utils.h), beyond what average_parameters' tests cover:
//   * run_bucketed with Broadcast: every dtype (integers too: no promotion), in place, staged,
//     non-contiguous and larger-than-a-bucket tensors, any root; bit for bit;
//   * DeferredCollective: the issue order it promises, and failures routed to their own bucket;
//   * compat::make_reducer: DDP's C++ Reducer built through ddpx's factory, with a ddpx hook,
//     averages gradients (the base of a C++ DistributedDataParallel).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <ddpx/comm/bucketed.h>
#include <ddpx/comm/exchange_mode.h>
#include <ddpx/hooks.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/deferred.h"
#include "comm/exchange.h"
#include "common/compat_internal.h"
#include "test_utils.h"

namespace {

using ddpx::comm::Broadcast;
using ddpx::comm::BucketOptions;
using ddpx::comm::run_bucketed;
using ddpx_test::bitwise_equal;
using ddpx_test::ProcessGroupPtr;
using ::testing::HasSubstr;

// Rank `rank`'s tensors: every dtype, shapes that take each path of the engine with a bucket of
// 64 bytes (in place: contiguous and >= a quarter bucket; staged: small or of another dtype;
// chunked: larger than a bucket; transposes: dense non-contiguous; a strided slice: non-dense).
std::vector<at::Tensor> broadcast_inputs(int rank) {
  at::manual_seed(1000 + rank);
  std::vector<at::Tensor> t;
  t.push_back(at::randn({40}, at::kFloat));                // in place, > a bucket
  t.push_back(at::randn({3}, at::kFloat));                 // staged
  t.push_back(at::randn({5, 7}, at::kDouble).t());         // dense transpose
  t.push_back(at::randn({50}, at::kHalf));                 // fp16 (no sum: own dtype)
  t.push_back(at::randn({9}, at::kBFloat16));              // bf16
  t.push_back(at::randint(-1000, 1000, {33}, at::kLong));  // integers travel exactly
  t.push_back(at::randint(0, 100, {6}, at::kInt));
  t.push_back(at::randn({64, 3}, at::kFloat).slice(1, 0, 3, 2));  // strided, non-dense
  t.push_back(at::randn({0}, at::kFloat));                        // empty
  return t;
}

TEST(RunBucketed, BroadcastFromEveryRootBitForBit) {
  for (int world : {2, 3, 4}) {
    for (int root = 0; root < world; ++root) {
      std::vector<std::vector<at::Tensor>> before(world), after(world);
      ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
        std::vector<at::Tensor> mine = broadcast_inputs(rank);
        for (const auto& t : mine) before[rank].push_back(t.clone());
        std::vector<void*> storage;
        for (const auto& t : mine) storage.push_back(t.data_ptr());
        BucketOptions options;
        options.bucket_cap_bytes = 64;
        const auto stats = run_bucketed(mine, pg, Broadcast(root), options);
        EXPECT_EQ(stats.tensors, static_cast<int64_t>(mine.size()));
        EXPECT_GT(stats.inplace_tensors, 0);
        EXPECT_GT(stats.staged_tensors, 0);
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT_EQ(mine[i].data_ptr(), storage[i]) << "tensor " << i << " was rebound";
        }
        after[rank] = mine;
      });
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < after[r].size(); ++i) {
          EXPECT_TRUE(bitwise_equal(after[r][i], before[root][i]))
              << "world " << world << " root " << root << " rank " << r << " tensor " << i;
        }
      }
    }
  }
}

TEST(RunBucketed, BadArguments) {
  ddpx_test::run_ranks(2, [&](int, const ProcessGroupPtr& pg) {
    std::vector<at::Tensor> t{at::ones({4})};
    EXPECT_THAT(ddpx_test::error_message([&] { run_bucketed(t, pg, Broadcast(2)); }),
                HasSubstr("root 2 is not a rank of a group of 2"));
    EXPECT_THAT(ddpx_test::error_message([&] { Broadcast(-1); }), HasSubstr("root"));
    BucketOptions zero;
    zero.bucket_cap_bytes = 0;
    EXPECT_THAT(ddpx_test::error_message([&] { run_bucketed(t, pg, Broadcast(0), zero); }),
                HasSubstr("bucket_cap_bytes must be positive"));
    std::vector<at::Tensor> undefined{at::Tensor()};
    EXPECT_THAT(ddpx_test::error_message([&] { run_bucketed(undefined, pg, Broadcast(0)); }),
                HasSubstr("tensor 0 is undefined"));
  });
  // A null group: not a member, nothing happens.
  at::Tensor t = at::ones({4});
  EXPECT_EQ(run_bucketed({t}, ProcessGroupPtr(), Broadcast(0)).tensors, 0);
}

// ---- DeferredCollective -------------------------------------------------------------------------

TEST(DeferredCollective, IssuesEachStepAtTheNextSubmitAndTheLastAtOnce) {
  ddpx::comm::DeferredCollective deferred;
  std::vector<std::string> log;
  auto step = [&](const std::string& name) {
    return ddpx::comm::DeferredCollective::Step{
        [&log, name] { log.push_back("2(" + name + ")"); },
        [&log, name](std::exception_ptr) { log.push_back("fail(" + name + ")"); }};
  };
  // What a hook does per bucket: its first collective, then submit its second.
  for (const char* b : {"a", "b", "c"}) {
    log.push_back(std::string("1(") + b + ")");
    deferred.submit(step(b), /*last=*/std::string(b) == "c");
    EXPECT_EQ(deferred.pending(), std::string(b) != "c");
  }
  EXPECT_THAT(log, ::testing::ElementsAre("1(a)", "1(b)", "2(a)", "1(c)", "2(b)", "2(c)"));
  log.clear();
  deferred.submit(step("x"), false);
  deferred.flush();  // another path of runHook: the deferred step goes first
  deferred.flush();  // nothing left
  EXPECT_THAT(log, ::testing::ElementsAre("2(x)"));
  EXPECT_FALSE(deferred.pending());
}

TEST(DeferredCollective, AFailingStepGoesToItsOwnBucket) {
  ddpx::comm::DeferredCollective deferred;
  std::string failed;
  deferred.submit({[] { throw std::runtime_error("round one failed"); },
                   [&](std::exception_ptr e) {
                     try {
                       std::rethrow_exception(e);
                     } catch (const std::exception& ex) {
                       failed = ex.what();
                     }
                   }},
                  false);
  bool next_ran = false;
  // The failure surfaces when the next bucket issues it, to the failed step's handler only.
  deferred.submit({[&] { next_ran = true; }, [](std::exception_ptr) { FAIL(); }}, true);
  EXPECT_EQ(failed, "round one failed");
  EXPECT_TRUE(next_ran);
  deferred.submit({[] {}, [](std::exception_ptr) {}}, false);
  deferred.clear();
  EXPECT_FALSE(deferred.pending());
}

// ---- compat::make_reducer ----------------------------------------------------------------------

// Two ranks train y = W x one step through DDP's C++ Reducer made by ddpx's factory, with ddpx's
// allreduce hook registered on it: each rank's gradient is then the mean of both ranks' own
// gradients, bit for bit (x / 2 + y / 2 on two ranks is exact).
TEST(Reducer, MadeByTheCompatFactoryAveragesGradientsWithAHook) {
  const int world = 2;
  std::vector<at::Tensor> local_grad(world), ddp_grad(world);
  // A private world: the Reducer's own collectives must not interleave with other tests'.
  const auto pgs = ddpx_test::make_gloo_world(world);
  ddpx_test::run_ranks(pgs, [&](int rank, const ProcessGroupPtr& pg) {
    at::manual_seed(7);  // the same initial weights on every rank
    at::Tensor w = at::randn({4, 3}, at::kFloat).requires_grad_(true);
    at::Tensor b = at::randn({4}, at::kFloat).requires_grad_(true);
    at::manual_seed(100 + rank);  // different data per rank
    const at::Tensor x = at::randn({5, 3}, at::kFloat);
    auto loss_of = [&] { return (at::matmul(x, w.t()) + b).pow(2).sum(); };
    // The rank's own gradient, without DDP.
    {
      at::Tensor loss = loss_of();
      torch::autograd::backward({loss});
      local_grad[rank] = at::cat({w.grad().reshape({-1}), b.grad().reshape({-1})}).clone();
      w.mutable_grad() = at::Tensor();
      b.mutable_grad() = at::Tensor();
    }
    ddpx::compat::ReducerArgs args;
    args.params = {w, b};
    args.bucket_indices = {{0, 1}};
    args.per_bucket_size_limits = {25 * 1024 * 1024};
    args.process_group = pg;
    args.expect_sparse_gradients = {false, false};
    auto reducer = ddpx::compat::make_reducer(std::move(args));
    reducer->register_comm_hook(
        std::make_unique<ddpx::hooks::SharedCommHook>(ddpx::hooks::allreduce_hook(pg)));
    reducer->prepare_for_forward();
    at::Tensor loss = loss_of();
    reducer->prepare_for_backward({loss});
    torch::autograd::backward({loss});
    ddp_grad[rank] = at::cat({w.grad().reshape({-1}), b.grad().reshape({-1})}).clone();
  });
  const at::Tensor mean = local_grad[0] / 2 + local_grad[1] / 2;
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(ddp_grad[r].defined()) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(ddp_grad[r], mean)) << "rank " << r;
  }
}

// A torch 2.x group of several backends: the exchange rule asks the backend of the tensors'
// device, not the group's default. Here the default says "nccl" while CPU
// and CUDA tensors go to Gloo, so 16-bit CUDA values must take the gather (Gloo's 16-bit sums
// are slow and, in 1.13, refused); asking the default would have sent them to Gloo's allreduce.
TEST(ExchangeMode, AsksTheBackendOfTheTensorsDevice) {
#if !DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  GTEST_SKIP() << "a torch 1.13 group is one backend";
#else
  auto store = c10::make_intrusive<c10d::HashStore>();
  ProcessGroupPtr pg = ddpx_test::make_gloo_group(store, 0, 1);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  ASSERT_EQ(ddpx::compat::backend_name(*pg), "nccl");
  EXPECT_EQ(ddpx::compat::backend_name(*pg, c10::DeviceType::CPU), "gloo");
  EXPECT_EQ(ddpx::compat::backend_name(*pg, c10::DeviceType::CUDA), "gloo");
  const c10::Device gpu(c10::DeviceType::CUDA, 0);
  EXPECT_FALSE(ddpx::comm::backend_sums_natively(*pg, at::kHalf, gpu));
  EXPECT_EQ(
      ddpx::comm::resolve_exchange_mode(ddpx::comm::ExchangeMode::kAuto, *pg, at::kBFloat16, gpu),
      ddpx::comm::ExchangeMode::kAllgather);
  EXPECT_TRUE(ddpx::comm::backend_sums_natively(*pg, at::kFloat, gpu));
  // A device type the group has no backend for falls back to the default's name.
  auto cpu_only = ddpx::compat::process_group_of(pg->getBackend(c10::DeviceType::CPU), store, 0, 1,
                                                 {c10::DeviceType::CPU});
  cpu_only->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  EXPECT_EQ(ddpx::compat::backend_name(*cpu_only, c10::DeviceType::CUDA), "nccl");
#endif
}

// kAuto on Gloo for 16-bit values: the reduce-scatter exchange only for a caller that can defer
// its second collective and only from 3 ranks on; sum_into, which issues one collective, refuses
// it when asked for it explicitly (it would need the second from a callback: order mismatches).
TEST(ExchangeMode, ReduceScatterOnlyWhereTwoRoundsFitAndFromThreeRanks) {
  using ddpx::comm::ExchangeMode;
  using ddpx::comm::resolve_exchange_mode;
  const c10::Device cpu(c10::DeviceType::CPU);
  for (int world : {1, 2, 3, 4}) {
    ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
      const bool scatter = world >= 3;
      for (at::ScalarType dt : {at::kHalf, at::kBFloat16}) {
        EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAuto, *pg, dt, cpu, true),
                  scatter ? ExchangeMode::kReduceScatter : ExchangeMode::kAllgather);
        EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAuto, *pg, dt, cpu, false),
                  ExchangeMode::kAllgather);
      }
      EXPECT_EQ(resolve_exchange_mode(ExchangeMode::kAuto, *pg, at::kFloat, cpu, true),
                ExchangeMode::kAllreduce);
      if (rank == 0) {
        at::Tensor t = at::ones({8}, at::kHalf);
        try {
          ddpx::comm::sum_into(pg, t, t, 1.0, ExchangeMode::kReduceScatter);
          ADD_FAILURE() << "sum_into took kReduceScatter";
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("reduce_scatter exchange needs a hook"),
                    std::string::npos)
              << e.what();
        }
      }
    });
  }
  EXPECT_EQ(ddpx::comm::parse_exchange_mode("reduce_scatter"), ExchangeMode::kReduceScatter);
  EXPECT_STREQ(ddpx::comm::exchange_mode_name(ExchangeMode::kReduceScatter), "reduce_scatter");
}

TEST(BackendKind, EveryNcclClassAndGlooByName) {
  using ddpx::compat::backend_kind_of;
  using ddpx::compat::BackendKind;
  EXPECT_EQ(backend_kind_of("gloo"), BackendKind::kGloo);
  EXPECT_EQ(backend_kind_of("nccl"), BackendKind::kNccl);
  EXPECT_EQ(backend_kind_of("nccl2"), BackendKind::kNccl2);
  EXPECT_EQ(backend_kind_of("nccl-lazy"), BackendKind::kNcclLazy);
  EXPECT_EQ(backend_kind_of("mpi"), BackendKind::kOther);
  EXPECT_EQ(backend_kind_of("custom"), BackendKind::kOther);
  EXPECT_EQ(backend_kind_of(""), BackendKind::kNone);
  for (auto k : {BackendKind::kNccl, BackendKind::kNccl2, BackendKind::kNcclLazy}) {
    EXPECT_TRUE(ddpx::compat::is_nccl(k));
  }
  for (auto k : {BackendKind::kGloo, BackendKind::kOther, BackendKind::kNone}) {
    EXPECT_FALSE(ddpx::compat::is_nccl(k));
  }
}

#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
// A backend that has only a name: what ddpx's backend decisions read.
class NamedBackend final : public ddpx::compat::Backend {
 public:
  explicit NamedBackend(std::string name) : Backend(0, 1), name_(std::move(name)) {}
  const std::string getBackendName() const override { return name_; }

 private:
  std::string name_;
};
#endif

// torch 2.15's "nccl" is another class (nccl2, named so; "nccl-lazy" its lazy variant), and
// "nccl2"/"nccl-lazy" groups are custom backends whose ProcessGroup reports "custom". The
// decisions taken for CUDA tensors must be the same for the three NCCL classes: 16-bit values
// summed by the backend itself (an allreduce), the group named by its backend, not "custom".
TEST(BackendKind, DecisionsAreTheSameForEveryNcclClass) {
#if !DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  GTEST_SKIP() << "a torch 1.13 group is one backend";
#else
  using ddpx::compat::BackendKind;
  using Type = c10d::ProcessGroup::BackendType;
  const c10::Device gpu(c10::DeviceType::CUDA, 0);
  const std::vector<std::pair<std::string, BackendKind>> classes = {
      {"nccl", BackendKind::kNccl},
      {"nccl2", BackendKind::kNccl2},
      {"nccl-lazy", BackendKind::kNcclLazy}};
  for (const auto& [name, kind] : classes) {
    SCOPED_TRACE(name);
    auto store = c10::make_intrusive<c10d::HashStore>();
    // "cpu:gloo,cuda:<name>", as init_process_group assembles a group of two backends.
    ProcessGroupPtr pg = ddpx::compat::process_group_of(
        ddpx_test::make_gloo_group(store, 0, 1)->getBackend(c10::DeviceType::CPU), store, 0, 1,
        {c10::DeviceType::CPU});
    const Type type = name == "nccl" ? Type::NCCL : Type::CUSTOM;
    pg->setBackend(c10::DeviceType::CUDA, type, c10::make_intrusive<NamedBackend>(name));
    pg->setDefaultBackend(type);
    EXPECT_EQ(ddpx::compat::backend_kind(*pg, c10::DeviceType::CUDA), kind);
    EXPECT_EQ(ddpx::compat::backend_kind(*pg, c10::DeviceType::CPU), BackendKind::kGloo);
    EXPECT_EQ(ddpx::compat::backend_name(*pg), name);  // not "custom"
    EXPECT_TRUE(ddpx::comm::backend_sums_natively(*pg, at::kHalf, gpu));
    EXPECT_EQ(
        ddpx::comm::resolve_exchange_mode(ddpx::comm::ExchangeMode::kAuto, *pg, at::kBFloat16, gpu),
        ddpx::comm::ExchangeMode::kAllreduce);
    // CPU tensors of the same group still take Gloo's rule (16-bit values gathered).
    EXPECT_FALSE(ddpx::comm::backend_sums_natively(*pg, at::kHalf, c10::Device(c10::kCPU)));
  }
  // A device type without a backend is kNone.
  auto store = c10::make_intrusive<c10d::HashStore>();
  ProcessGroupPtr cpu_only = ddpx_test::make_gloo_group(store, 0, 1);
  auto gloo_cpu = ddpx::compat::process_group_of(cpu_only->getBackend(c10::DeviceType::CPU), store,
                                                 0, 1, {c10::DeviceType::CPU});
  EXPECT_EQ(ddpx::compat::backend_kind(*gloo_cpu, c10::DeviceType::CUDA), BackendKind::kNone);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  at::set_num_threads(1);  // rank threads are the parallelism here
  return RUN_ALL_TESTS();
}
