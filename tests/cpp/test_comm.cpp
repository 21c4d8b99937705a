// Tests of the collective layer (ddpx::comm) on real Gloo process groups (1 to 4 ranks as threads
// over one in-memory store, see test_utils.h), beyond what average_parameters' tests cover:
//   * run_bucketed with Broadcast: every dtype (integers too: no promotion), in place, staged,
//     non-contiguous and larger-than-a-bucket tensors, any root; bit for bit;
//   * Packer, the one packer under run_bucketed and ZeRO's exchange: its plan (which tensors
//     travel in their own storage, how buckets are cut), pack/unpack round trips with casts,
//     temporaries, and tensors whose data are rebound after planning;
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
#include <tuple>
#include <vector>

#include "comm/deferred.h"
#include "comm/exchange.h"
#include "comm/packer.h"
#include "comm/sharded_exchange.h"
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

// ---- Packer ---------------------------------------------------------------------------------

using ddpx::comm::OwnStorage;
using ddpx::comm::Packer;
using ddpx::comm::PackMessage;

// Tensors taking each path with 64-byte buckets of fp32 (16 elements; own storage from 16 bytes):
// contiguous and large, small, a dense transpose larger than a bucket, a non-dense slice that fits
// a bucket, a non-dense one larger than a bucket, fp64 (never in its own storage: another dtype),
// an empty one.
std::vector<at::Tensor> packer_inputs() {
  at::manual_seed(7);
  return {at::randn({40}),
          at::randn({3}),
          at::randn({5, 7}).t(),
          at::randn({8, 3}).slice(1, 0, 3, 2),
          at::randn({30, 3}).slice(1, 0, 3, 2),
          at::randn({20}, at::kDouble),
          at::randn({0})};
}

// Every source's elements, in logical order, exactly once over the messages; each source listed
// in starting_in() of the message carrying its first element.
void expect_covers_each_element_once(const Packer& packer) {
  const auto& tensors = packer.tensors();
  std::vector<int64_t> seen(tensors.size(), 0);
  std::vector<int> starts(tensors.size(), 0);
  for (size_t m = 0; m < packer.messages().size(); ++m) {
    const PackMessage& msg = packer.messages()[m];
    for (size_t s : packer.starting_in(m)) {
      EXPECT_EQ(seen[s], 0) << "source " << s << " starts in message " << m << " but came earlier";
      ++starts[s];
    }
    if (msg.own_source >= 0) {
      EXPECT_TRUE(msg.segments.empty());
      EXPECT_EQ(msg.numel, tensors[msg.own_source].numel());
      seen[msg.own_source] += msg.numel;
      continue;
    }
    int64_t offset = 0;
    for (const auto& seg : msg.segments) {
      EXPECT_EQ(seg.dst_offset, offset);
      EXPECT_EQ(seg.src_offset, seen[seg.source]) << "source " << seg.source << " out of order";
      seen[seg.source] += seg.len;
      offset += seg.len;
    }
    EXPECT_EQ(offset, msg.numel);
    EXPECT_LE(msg.numel, packer.max_staged());
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(seen[i], tensors[i].numel()) << "source " << i;
    EXPECT_EQ(starts[i], tensors[i].numel() > 0 ? 1 : 0) << "source " << i;
  }
}

TEST(Packer, OwnStorageThresholdIsAQuarterBucketAtMost256KiB) {
  EXPECT_EQ(ddpx::comm::own_storage_min_bytes(64), 16);
  EXPECT_EQ(ddpx::comm::own_storage_min_bytes(1 << 20), 256 * 1024);
  EXPECT_EQ(ddpx::comm::own_storage_min_bytes(ddpx::comm::kDefaultBucketBytes), 256 * 1024);
  EXPECT_EQ(ddpx::comm::own_storage_min_bytes(3), 1);
}

TEST(Packer, PlansWhichTensorsTravelInTheirOwnStorage) {
  const auto inputs = packer_inputs();
  auto owners = [](const Packer& p) {
    std::vector<int64_t> own;
    for (const auto& m : p.messages()) {
      if (m.own_source >= 0) own.push_back(m.own_source);
    }
    return own;
  };
  const Packer never(inputs, at::kFloat, 64, OwnStorage::kNever);
  const Packer contiguous(inputs, at::kFloat, 64, OwnStorage::kContiguous);
  const Packer dense(inputs, at::kFloat, 64, OwnStorage::kDense);
  EXPECT_TRUE(owners(never).empty());
  EXPECT_EQ(owners(contiguous), (std::vector<int64_t>{0}));
  EXPECT_EQ(owners(dense), (std::vector<int64_t>{0, 2}));
  for (const Packer* p : {&never, &contiguous, &dense}) {
    expect_covers_each_element_once(*p);
    EXPECT_LE(p->max_staged(), 16);  // 64 bytes of fp32
  }
  // Staged: 3 + 35 + 12 + 30 + 20 (+ 40 + 35 with kNever) elements of 16 per bucket; a tensor
  // larger than a bucket starts one of its own.
  EXPECT_EQ(never.staged_sources(), 6);
  EXPECT_EQ(contiguous.staged_sources(), 5);
  EXPECT_EQ(dense.staged_sources(), 4);
  // The slice larger than a bucket (30 elements) starts a bucket: 16 + 14.
  for (const auto& m : contiguous.messages()) {
    for (const auto& seg : m.segments) {
      if (seg.source == 4 && seg.src_offset == 0) EXPECT_EQ(seg.dst_offset, 0);
    }
  }
}

// Packs every message, scales the buckets by 2 (what a collective might do), unpacks into the
// same tensors: every element doubled, in its own dtype, through every access path and a cast.
TEST(Packer, PackUnpackRoundTripsThroughEveryPath) {
  for (at::ScalarType wire : {at::kFloat, at::kDouble}) {
    for (OwnStorage own : {OwnStorage::kNever, OwnStorage::kContiguous, OwnStorage::kDense}) {
      auto inputs = packer_inputs();
      std::vector<at::Tensor> expected;  // the fp64 tensor through an fp32 wire: rounded
      for (const auto& t : inputs) expected.push_back((t.to(wire) * 2).to(t.scalar_type()));
      Packer packer(inputs, wire, 64, own);
      for (size_t m = 0; m < packer.messages().size(); ++m) {
        const PackMessage& msg = packer.messages()[m];
        if (msg.own_source >= 0) {
          packer.own_values(m).mul_(2);
          continue;
        }
        at::Tensor bucket = at::full({msg.numel}, -1.0, at::TensorOptions().dtype(wire));
        packer.pack(m, bucket);
        EXPECT_FALSE(at::equal(bucket, at::full_like(bucket, -1.0)));
        bucket.mul_(2);
        packer.unpack(m, bucket);
      }
      EXPECT_EQ(packer.live_temporaries(), 0);
      for (size_t i = 0; i < inputs.size(); ++i) {
        EXPECT_TRUE(at::equal(inputs[i], expected[i]))
            << "wire " << wire << " own " << static_cast<int>(own) << " tensor " << i;
      }
    }
  }
}

// The sender's side (pack, then release) leaves the tensors alone and the temporaries freed, and
// the packer serves again (ZeRO reuses its packers every step); a tensor whose data were rebound
// after planning is read where its data are now.
TEST(Packer, ReleaseAndRebindingKeepThePackerReusable) {
  auto inputs = packer_inputs();
  for (auto& t : inputs) t.set_requires_grad(true);
  Packer packer(inputs, at::kFloat, 64, OwnStorage::kContiguous);
  at::NoGradGuard no_grad;
  int temporaries_started = 0;
  auto gather = [&] {
    std::vector<at::Tensor> parts;
    for (size_t m = 0; m < packer.messages().size(); ++m) {
      const PackMessage& msg = packer.messages()[m];
      if (msg.own_source >= 0) {
        parts.push_back(packer.own_values(m).clone());
        continue;
      }
      at::Tensor bucket = at::empty({msg.numel});
      const bool starts = packer.starts_temporary(m);
      if (starts) ++temporaries_started;
      packer.pack(m, bucket);
      if (starts) EXPECT_EQ(packer.live_temporaries(), 1);  // the previous one was released
      packer.release(m);
      parts.push_back(bucket);
    }
    EXPECT_EQ(packer.live_temporaries(), 0);
    return at::cat(parts);
  };
  std::vector<at::Tensor> before;
  for (const auto& t : inputs) before.push_back(t.detach().clone());
  const at::Tensor first = gather();
  EXPECT_EQ(temporaries_started, 2);  // sources 2 and 4: not contiguous, larger than a bucket
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_TRUE(at::equal(inputs[i], before[i]));
  EXPECT_TRUE(at::equal(gather(), first));
  // Rebind: tensor 1 (staged) and tensor 0 (own storage) get new data of the same layout; tensor
  // 2 (a transpose: staged by kContiguous) gets contiguous data, which it is read through whole.
  inputs[0].set_data(at::full({40}, 5.0));
  inputs[1].set_data(at::full({3}, 6.0));
  inputs[2].set_data(at::full({7, 5}, 7.0));
  const at::Tensor second = gather();
  EXPECT_EQ(second.numel(), first.numel());
  EXPECT_EQ(at::sum(second == 5.0).item<int64_t>(), 40);
  EXPECT_EQ(at::sum(second == 6.0).item<int64_t>(), 3);
  EXPECT_EQ(at::sum(second == 7.0).item<int64_t>(), 35);
}

TEST(Packer, LayoutChangedUnderAPlannedRunIsRefused) {
  // Tensor 0 planned contiguous and larger than a bucket (kNever: staged in 3 segments); its data
  // rebound to a strided slice: a segment of it can no longer be found, which must raise, not
  // scramble values.
  std::vector<at::Tensor> inputs{at::randn({40})};
  Packer packer(inputs, at::kFloat, 64, OwnStorage::kNever);
  ASSERT_EQ(packer.messages().size(), 3u);
  inputs[0].set_data(at::randn({80}).slice(0, 0, 80, 2));
  at::Tensor bucket = at::empty({16});
  EXPECT_THAT([&] { packer.pack(0, bucket); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("changed its memory layout")));
}

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

// The owner-sharded exchange's scatter round with raw values (ZeRO-2's reduce_scatter_hook): each
// owner's packed sum is its own values and every peer's, each scaled before it is added, in rank
// order, in the values' dtype (fp64 here): bit for bit that closed form, for an ownership that
// interleaves the ranks' blocks and gives one rank nothing. Round two (gather_from_owners) sends
// every owner's sum back into every rank's buffer.
TEST(ShardedExchange, RawScatterAndGatherAreTheScaledSumInRankOrder) {
  const int world = 3;
  const int64_t n = 40;
  // Blocks [begin, begin + len) and their owners: rank 2 owns nothing.
  const std::vector<std::tuple<int64_t, int64_t, int>> blocks = {
      {0, 7, 1}, {7, 5, 0}, {12, 9, 1}, {21, 11, 0}, {32, 8, 1}};
  auto input = [](int rank) {
    return at::linspace(-1.0, 1.0, n, at::kDouble) * (rank + 1.5) + 1e-3 * rank;
  };
  const double scale = 1.0 / world;
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    std::vector<std::vector<ddpx::kernels::BlockRef>> to_owner(world);
    for (const auto& [b, len, owner] : blocks) to_owner[owner].push_back({b, len, 0});
    std::vector<int64_t> offsets;
    int64_t owned = 0;
    for (const auto& r : to_owner[rank]) {
      offsets.push_back(owned);
      owned += r.len;
    }
    auto codec = std::make_shared<const ddpx::comm::RawCodec>(at::kDouble);
    auto plan = std::make_shared<const ddpx::comm::ShardPlan>(world, rank, to_owner, offsets, owned,
                                                              *codec, c10::Device(at::kCPU));
    const at::Tensor x = input(rank);
    ddpx::comm::OwnerScatter scatter(pg, plan, codec, x, at::Tensor(), 0);
    scatter.wait();
    at::Tensor sum = at::empty({owned}, at::kDouble);
    scatter.sum_into(sum, scale, {});
    // The closed form: term by term, each scaled first, in rank order.
    at::Tensor expected = at::zeros({owned}, at::kDouble);
    for (int r = 0; r < world; ++r) {
      at::Tensor packed = at::empty({owned}, at::kDouble);
      int64_t at = 0;
      for (const auto& ref : to_owner[rank]) {
        packed.narrow(0, at, ref.len).copy_(input(r).narrow(0, ref.begin, ref.len));
        at += ref.len;
      }
      expected = r == 0 ? packed * scale : expected + packed * scale;
    }
    EXPECT_TRUE(bitwise_equal(sum, expected)) << "rank " << rank;
    // Round two: every rank ends with every owner's sum at its blocks (rank 2's none: zeros kept).
    at::Tensor out = at::zeros({n}, at::kDouble);
    auto fut = ddpx::comm::gather_from_owners(pg, plan, codec, sum, at::Tensor(), 0, out, {});
    fut->wait();
    ASSERT_FALSE(fut->hasError()) << fut->tryRetrieveErrorMessage();
    at::Tensor mean = at::zeros({n}, at::kDouble);
    for (int r = 0; r < world; ++r) mean = r == 0 ? input(r) * scale : mean + input(r) * scale;
    EXPECT_TRUE(bitwise_equal(out, mean)) << "rank " << rank;
  });
}

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
