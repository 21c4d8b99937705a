// ZeRO (ddpx/optim/zero.h) on 1 to 4 Gloo ranks as threads (test_utils.h):
//   * partition_sorted_greedy: torch's assignment on hand-worked cases; partition_balanced: even
//     shares, aligned cuts, unsplittable parameters, bad arguments; ZeroLayout: groups keep
//     their owners, units in torch's order, pieces as views, gradient binding, assign();
//   * ZeroShards: the exchange (owners' values everywhere, in place and staged chunks, several
//     rounds), bucket views, the fused SGD/Adam steps against the unsharded functional
//     optimizers bit for bit, the bulk gather (any dtypes, shapes, counts), bad arguments;
//   * ZeroRedundancyOptimizer over torch::optim::Adam / AdamW / SGD against the same optimizer
//     unsharded: through the local optimizer's step every rank's parameters equal the unsharded
//     run's bit for bit after every step (the same arithmetic per parameter; the exchange copies
//     bytes); through the fused step SGD is bit for bit and Adam within 1e-6; a local step after
//     fused ones continues from their state;
//   * the overlap with the C++ DDP (hook_with_zero_step and its interleaved form around ddpx's
//     allreduce hook, several buckets, both partitions): every rank's parameters after each
//     backward pass equal those of DDP with the plain hook followed by the unsharded optimizer's
//     step (bit for bit through the local step and fused SGD, Adam within 1e-6); step() then
//     does nothing; the hooks' refusals.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <ddpx/ddp.h>
#include <ddpx/hooks/allreduce_hook.h>
#include <ddpx/hooks/ddp_zero_hook.h>
#include <ddpx/optim/functional.h>
#include <ddpx/optim/zero.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "test_utils.h"

namespace {

using ddpx::optim::ZeroOptions;
using ddpx::optim::ZeroRedundancyOptimizer;
using ddpx::optim::ZeroShards;
using ddpx_test::ProcessGroupPtr;

// Shapes with a large parameter (own storage at small caps), small ones (packed), a
// non-contiguous one and an empty one.
// Values from a generator of their own: rank threads draw concurrently.
at::Tensor randn(at::IntArrayRef sizes, at::Generator& gen) {
  return at::randn(sizes, gen, at::TensorOptions().dtype(at::kFloat));
}

// contiguous: the transposed parameter made contiguous (the fused steps take only contiguous
// parameters).
std::vector<at::Tensor> make_params(int64_t seed, bool contiguous = false) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  std::vector<at::Tensor> p{randn({64, 33}, gen),   randn({7}, gen), randn({3, 5}, gen),
                            randn({5, 6}, gen).t(), randn({0}, gen), randn({40}, gen),
                            randn({2, 2}, gen)};
  if (contiguous) p[3] = p[3].contiguous();
  for (auto& t : p) t.set_requires_grad(true);
  return p;
}

std::vector<at::Tensor> grads_for(const std::vector<at::Tensor>& params, int64_t step) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + step));
  std::vector<at::Tensor> g;
  for (const auto& p : params) g.push_back(randn(p.sizes(), gen));
  return g;
}

std::vector<int64_t> owners_of(const std::vector<at::Tensor>& params, int64_t world) {
  std::vector<int64_t> numels;
  for (const auto& p : params) numels.push_back(p.numel());
  return ddpx::optim::partition_sorted_greedy({numels}, world)[0];
}

TEST(ZeroPartition, TorchsSortedGreedy) {
  using ddpx::optim::partition_sorted_greedy;
  // Largest first: 10 -> r0, 5 -> r1, 5 -> r1 (tie with r0? no: r1 has 5 < 10), 3 -> r0 (10 vs
  // 10: the lowest), 1 -> r1 (13 vs 10).
  EXPECT_EQ(partition_sorted_greedy({{5, 10, 3, 5, 1}}, 2),
            (std::vector<std::vector<int64_t>>{{1, 0, 0, 1, 1}}));
  // Totals carry over to the next group: r0 has 4, r1 has 0 after the first.
  EXPECT_EQ(partition_sorted_greedy({{4}, {2, 2, 1}}, 2),
            (std::vector<std::vector<int64_t>>{{0}, {1, 1, 0}}));
  // Equal sizes keep their order; more ranks than parameters leave ranks empty.
  EXPECT_EQ(partition_sorted_greedy({{3, 3, 3}}, 4),
            (std::vector<std::vector<int64_t>>{{0, 1, 2}}));
  EXPECT_THROW(partition_sorted_greedy({{1}}, 0), c10::ValueError);
}

// Every rank's parameters take the owner's values: rank r fills its own with r + index.
// Pieces as (begin, end, owner) triples, for EXPECT_EQ.
std::vector<std::vector<std::vector<int64_t>>> triples(
    const std::vector<std::vector<ddpx::optim::ZeroPiece>>& pieces) {
  std::vector<std::vector<std::vector<int64_t>>> out;
  for (const auto& row : pieces) {
    out.emplace_back();
    for (const auto& p : row) out.back().push_back({p.begin, p.end, p.owner});
  }
  return out;
}

TEST(ZeroPartition, BalancedCutsTheLineIntoEvenShares) {
  using ddpx::optim::partition_balanced;
  using T = std::vector<std::vector<std::vector<int64_t>>>;
  // 100 + 60 + 40 = 200 elements, 2 ranks: the cut at 100 falls between parameters.
  EXPECT_EQ(triples(partition_balanced({100, 60, 40}, {true, true, true}, 2, 1)),
            (T{{{0, 100, 0}}, {{0, 60, 1}}, {{0, 40, 1}}}));
  // 300 elements, 3 ranks, align 1: cuts at 100 and 200 inside the one parameter.
  EXPECT_EQ(triples(partition_balanced({300}, {true}, 3, 1)),
            (T{{{0, 100, 0}, {100, 200, 1}, {200, 300, 2}}}));
  // align 32: the cut at 150 of [0, 300) moves to 160 (the nearest multiple of 32).
  EXPECT_EQ(triples(partition_balanced({300}, {true}, 2, 32)), (T{{{0, 160, 0}, {160, 300, 1}}}));
  // An unsplittable parameter goes whole to the rank holding its middle element (element 125
  // of the line: rank 0); the third parameter starts at the cut (150) and goes to rank 1.
  EXPECT_EQ(triples(partition_balanced({100, 50, 150}, {true, false, true}, 2, 1)),
            (T{{{0, 100, 0}}, {{0, 50, 0}}, {{0, 150, 1}}}));
  // Cuts rounded to multiples of 32 elements within a parameter (here to 0, 32 or 64, or not at
  // all in the 24-element one) still tile every parameter exactly.
  const auto tiny = partition_balanced({24, 40}, {true, true}, 4, 32);
  int64_t covered = 0;
  for (const auto& row : tiny) {
    for (const auto& p : row) covered += p.end - p.begin;
  }
  EXPECT_EQ(covered, 64);
  // One rank owns everything; empty parameters get an empty piece.
  EXPECT_EQ(triples(partition_balanced({5, 0, 7}, {true, true, true}, 1)),
            (T{{{0, 5, 0}}, {{0, 0, 0}}, {{0, 7, 0}}}));
  EXPECT_THROW(partition_balanced({1}, {true}, 0), c10::ValueError);
  EXPECT_THROW(partition_balanced({1}, {true, true}, 2), c10::ValueError);
  EXPECT_THROW(partition_balanced({1}, {true}, 2, 0), c10::ValueError);
}

// ZeroLayout, the partition both ZeroRedundancyOptimizer classes use: groups keep their owners
// when another is added (torch's running totals carry over), every unit is stepped by exactly
// one rank in torch's order, pieces are views tiling their parameter, split pieces take their
// gradient's slices, and assign() (torch's params_per_rank) checks its argument.
TEST(ZeroLayout, GroupsUnitsPiecesAndGradients) {
  using ddpx::optim::ZeroLayout;
  using ddpx::optim::ZeroPartition;
  const int64_t world = 3;
  auto a = make_params(1), b = make_params(2);
  std::vector<int64_t> na, nb;
  for (const auto& p : a) na.push_back(p.numel());
  for (const auto& p : b) nb.push_back(p.numel());
  const auto expected = ddpx::optim::partition_sorted_greedy({na, nb}, world);
  std::vector<std::vector<int64_t>> seen(static_cast<size_t>(world));
  for (int64_t rank = 0; rank < world; ++rank) {
    ZeroLayout layout(world, rank, ZeroPartition::kSortedGreedy);
    layout.add_group(a);
    std::vector<int64_t> before;
    for (size_t i = 0; i < a.size(); ++i) before.push_back(layout.owner_of(i));
    EXPECT_EQ(before, expected[0]);
    EXPECT_EQ(layout.add_group(b), 1u);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(layout.owner_of(i), before[i]);
    for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(layout.owner_of(a.size() + i), expected[1][i]);
    EXPECT_EQ(layout.group_range(1), std::make_pair(a.size(), a.size() + b.size()));
    const auto local = layout.local_units(rank);
    ASSERT_EQ(local.size(), 2u);
    for (const auto& group : local) {
      for (size_t k = 0; k < group.size(); ++k) {
        EXPECT_EQ(layout.unit_owners()[group[k]], rank);
        EXPECT_TRUE(layout.units()[group[k]].is_same(layout.params()[group[k]]));
        if (k > 0) {  // largest first
          EXPECT_GE(layout.units()[group[k - 1]].numel(), layout.units()[group[k]].numel());
        }
        seen[static_cast<size_t>(rank)].push_back(group[k]);
      }
    }
  }
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> every(a.size() + b.size());
  std::iota(every.begin(), every.end(), int64_t{0});
  EXPECT_EQ(all, every);

  // Balanced: the large weight is cut; its pieces are views tiling it, and this rank's pieces
  // take slices of its gradient for a step only.
  for (int64_t rank = 0; rank < world; ++rank) {
    auto p = make_params(3);
    ZeroLayout layout(world, rank, ZeroPartition::kBalanced);
    layout.add_group(p);
    ASSERT_GT(layout.pieces(0).size(), 1u);
    int64_t at = 0;
    for (size_t k = 0; k < layout.pieces(0).size(); ++k) {
      const auto& piece = layout.pieces(0)[k];
      EXPECT_EQ(piece.begin, at);
      at = piece.end;
      const at::Tensor& unit = layout.units()[k];
      EXPECT_TRUE(unit.is_alias_of(p[0]));
      EXPECT_TRUE(at::equal(unit, p[0].reshape(-1).slice(0, piece.begin, piece.end)));
    }
    EXPECT_EQ(at, p[0].numel());
    p[0].mutable_grad() = at::randn_like(p[0]);
    const auto bound = layout.bind_piece_grads();
    ASSERT_FALSE(bound.empty());
    for (int64_t u : bound) {
      const auto& piece = layout.pieces(0)[static_cast<size_t>(u)];
      EXPECT_EQ(piece.owner, rank);
      EXPECT_TRUE(at::equal(layout.units()[u].grad(),
                            p[0].grad().reshape(-1).slice(0, piece.begin, piece.end)));
    }
    layout.unbind_piece_grads();
    for (int64_t u : bound) EXPECT_FALSE(layout.units()[u].grad().defined());
  }

  // assign(): one group, every parameter exactly once.
  ZeroLayout one(2, 0, ZeroPartition::kSortedGreedy);
  one.add_group(a);
  const int64_t n = static_cast<int64_t>(a.size());
  EXPECT_THROW(one.assign({{0}}), c10::ValueError);         // one list per rank
  EXPECT_THROW(one.assign({{0, 0}, {}}), c10::ValueError);  // listed twice
  EXPECT_THROW(one.assign({{0}, {1}}), c10::ValueError);    // others unassigned
  EXPECT_THROW(one.assign({{0}, {n}}), c10::ValueError);    // out of range
  std::vector<int64_t> odd, even;
  for (int64_t i = n - 1; i >= 0; --i) (i % 2 ? odd : even).push_back(i);
  one.assign({even, odd});
  EXPECT_EQ(one.local_units(0)[0], even);
  EXPECT_EQ(one.local_units(1)[0], odd);
  EXPECT_EQ(one.owner_of(1), 1);
  EXPECT_THROW(one.add_group(b), c10::ValueError);
  ZeroLayout two(2, 0, ZeroPartition::kSortedGreedy);
  two.add_group(a);
  two.add_group(b);
  EXPECT_THROW(two.assign({even, odd}), c10::ValueError);  // two groups
  EXPECT_THROW(ZeroLayout(2, 0, ZeroPartition::kSortedGreedy, /*flatten=*/true), c10::ValueError);
  EXPECT_THROW(ZeroLayout(2, 2, ZeroPartition::kSortedGreedy), c10::ValueError);
  EXPECT_THROW(ZeroLayout(0, 0, ZeroPartition::kBalanced), c10::ValueError);
}

TEST(ZeroShards, ExchangeGivesEveryParameterItsOwnersValues) {
  for (int world : {1, 2, 3, 4}) {
    for (bool bucket_view : {false, true}) {
      for (int64_t cap : {int64_t{64}, int64_t{1} << 20}) {
        ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
          auto params = make_params(0);
          const auto owners = owners_of(params, world);
          ZeroOptions o;
          o.parameters_as_bucket_view = bucket_view;
          o.bucket_cap_bytes = cap;
          ZeroShards shards(params, owners, std::vector<bool>(params.size(), true), pg, o);
          {
            at::NoGradGuard g;
            for (size_t i = 0; i < params.size(); ++i) params[i].fill_(100.0 * rank + i);
          }
          const auto stats = shards.exchange();
          for (size_t i = 0; i < params.size(); ++i) {
            EXPECT_TRUE(at::equal(params[i], at::full_like(params[i], 100.0 * owners[i] + i)))
                << "world " << world << " bucket_view " << bucket_view << " cap " << cap
                << " param " << i;
          }
          if (world > 1) {
            EXPECT_GT(stats.broadcasts, 0);
            if (cap == 64 && !bucket_view) {
              EXPECT_GT(stats.rounds, 1);  // several chunks per rank
              EXPECT_GT(stats.inplace_broadcasts, 0);
            }
            if (bucket_view) EXPECT_EQ(stats.inplace_broadcasts, stats.broadcasts);
          }
        });
      }
    }
  }
}

TEST(ZeroShards, BucketViewsKeepValuesAndAliasTheBucket) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto params = make_params(3);
    std::vector<at::Tensor> before;
    for (const auto& p : params) before.push_back(p.detach().clone());
    std::vector<bool> trainable(params.size(), true);
    trainable[1] = false;
    ZeroOptions o;
    o.parameters_as_bucket_view = true;
    ZeroShards shards(params, owners_of(params, 2), trainable, pg, o);
    ASSERT_EQ(shards.buckets().size(), 1u);
    ASSERT_EQ(shards.buckets()[0].size(), 2u);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::equal(params[i], before[i])) << i;
      if (!trainable[i] || params[i].numel() == 0) continue;
      const at::Tensor& bucket = shards.buckets()[0][shards.owners()[i]];
      const auto* begin = static_cast<const char*>(bucket.data_ptr());
      const auto* p = static_cast<const char*>(params[i].data_ptr());
      EXPECT_TRUE(p >= begin && p < begin + bucket.nbytes()) << "parameter " << i;
    }
    // Not trainable: a private copy, not in any bucket; trainable again after rebuild().
    EXPECT_FALSE(params[1].is_alias_of(shards.buckets()[0][0]));
    EXPECT_FALSE(params[1].is_alias_of(shards.buckets()[0][1]));
    shards.rebuild(std::vector<bool>(params.size(), true));
    EXPECT_TRUE(params[1].is_alias_of(shards.buckets()[0][shards.owners()[1]]));
    EXPECT_TRUE(at::equal(params[1], before[1]));
    (void)rank;
  });
}

// The fused steps equal the unsharded functional optimizers bit for bit on every rank.
TEST(ZeroShards, FusedStepsEqualUnshardedFunctionalOptimizers) {
  for (int world : {1, 2, 3}) {
    for (bool adam : {false, true}) {
      ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
        auto params = make_params(5);
        // The non-contiguous one is left out: the functional steps take contiguous tensors.
        params[3] = params[3].detach().contiguous().set_requires_grad(true);
        auto reference = make_params(5);
        reference[3] = reference[3].detach().contiguous();
        for (auto& r : reference) r = r.detach();
        const auto owners = owners_of(params, world);
        ZeroOptions o;
        o.bucket_cap_bytes = 256;
        ZeroShards shards(params, owners, std::vector<bool>(params.size(), true), pg, o);
        ddpx::optim::SGDOptions sgd;
        sgd.lr = 0.1;
        sgd.momentum = 0.9;
        sgd.nesterov = true;
        ddpx::optim::AdamOptions adam_opts;
        adam_opts.lr = 0.01;
        adam_opts.amsgrad = true;
        adam_opts.decoupled_weight_decay = true;
        ddpx::optim::FunctionalSGD ref_sgd(reference, sgd);
        ddpx::optim::FunctionalAdam ref_adam(reference, adam_opts);
        ddpx::optim::ZeroSGDGroup sgd_group;
        ddpx::optim::ZeroAdamGroup adam_group;
        for (size_t i = 0; i < params.size(); ++i) {
          if (owners[i] != rank) continue;
          sgd_group.params.push_back(static_cast<int64_t>(i));
          sgd_group.momentum_buffers.emplace_back();
          adam_group.params.push_back(static_cast<int64_t>(i));
          adam_group.exp_avgs.push_back(at::zeros_like(params[i]));
          adam_group.exp_avg_sqs.push_back(at::zeros_like(params[i]));
          adam_group.max_exp_avg_sqs.push_back(at::zeros_like(params[i]));
          adam_group.steps.push_back(at::zeros({}));
        }
        sgd_group.options = sgd;
        adam_group.options = adam_opts;
        for (int64_t step = 0; step < 4; ++step) {
          const auto grads = grads_for(params, step);
          sgd_group.grads.clear();
          adam_group.grads.clear();
          for (int64_t i : sgd_group.params) {
            // One parameter without a gradient on step 1: skipped, as torch skips it.
            const bool skip = step == 1 && i == 2;
            sgd_group.grads.push_back(skip ? at::Tensor() : grads[i]);
            adam_group.grads.push_back(skip ? at::Tensor() : grads[i]);
          }
          std::vector<at::Tensor> ref_grads = grads;
          if (step == 1) ref_grads[2] = at::Tensor();
          if (adam) {
            std::vector<ddpx::optim::ZeroAdamGroup> groups{adam_group};
            ddpx::optim::step_adam(shards, groups);
            adam_group = groups[0];
            ref_adam.step(ref_grads);
          } else {
            std::vector<ddpx::optim::ZeroSGDGroup> groups{sgd_group};
            ddpx::optim::step_sgd(shards, groups);
            sgd_group = groups[0];
            ref_sgd.step(ref_grads);
          }
          for (size_t i = 0; i < params.size(); ++i) {
            EXPECT_TRUE(at::equal(params[i], reference[i]))
                << "world " << world << (adam ? " adam" : " sgd") << " step " << step << " param "
                << i;
          }
        }
        if (adam) {
          for (size_t k = 0; k < adam_group.params.size(); ++k) {
            const int64_t expected = adam_group.params[k] == 2 ? 3 : 4;  // skipped once
            EXPECT_EQ(adam_group.steps[k].item<double>(), expected);
          }
        }
      });
    }
  }
}

TEST(ZeroShards, GatherBringsEveryRanksTensorsToTheTargetOnly) {
  for (int world : {1, 2, 4}) {
    for (int to = 0; to < world; ++to) {
      ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
        auto params = make_params(0);
        ZeroShards shards(params, owners_of(params, world), std::vector<bool>(params.size(), true),
                          pg);
        // Rank r sends r + 3 tensors of assorted dtypes and shapes (0-dim and empty included), a
        // large one (in its own storage) and a large non-contiguous one (packed).
        auto mine = [](int r) {
          std::vector<at::Tensor> t;
          for (int k = 0; k <= r; ++k) {
            switch (k % 4) {
              case 0:
                t.push_back(at::arange(3 * (k + 1), at::kFloat).add(r).view({3, -1}));
                break;
              case 1:
                t.push_back(at::full({}, 7 + r, at::kLong));
                break;
              case 2:
                t.push_back(at::empty({0, 4}, at::kDouble));
                break;
              default:
                t.push_back(at::tensor({1, 0, r % 2}, at::kByte).to(at::kBool));
                break;
            }
          }
          t.push_back(at::arange(70000 + r, at::kFloat));
          t.push_back(at::arange(2 * 70000, at::kDouble).add(r).view({2, -1}).t());
          return t;
        };
        const auto got = shards.gather(to, mine(rank), c10::Device(c10::kCPU));
        if (rank != to) {
          EXPECT_TRUE(got.empty());
          return;
        }
        ASSERT_EQ(got.size(), static_cast<size_t>(world));
        for (int r = 0; r < world; ++r) {
          const auto expected = mine(r);
          ASSERT_EQ(got[r].size(), expected.size()) << "from rank " << r;
          for (size_t k = 0; k < expected.size(); ++k) {
            EXPECT_EQ(got[r][k].scalar_type(), expected[k].scalar_type());
            EXPECT_EQ(got[r][k].sizes(), expected[k].sizes());
            EXPECT_TRUE(at::equal(got[r][k], expected[k])) << "from rank " << r << " #" << k;
          }
        }
      });
    }
  }
}

TEST(ZeroShards, BadArguments) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto p = make_params(0);
    const std::vector<bool> all(p.size(), true);
    EXPECT_THROW(ZeroShards({}, {}, {}, pg), c10::ValueError);
    EXPECT_THROW(ZeroShards(p, owners_of(p, 2), all, ProcessGroupPtr()), c10::ValueError);
    auto bad_owner = owners_of(p, 2);
    bad_owner[0] = 2;
    EXPECT_THROW(ZeroShards(p, bad_owner, all, pg), c10::ValueError);
    auto mixed = p;
    mixed[1] = at::randn({7}, at::kDouble);
    EXPECT_THROW(ZeroShards(mixed, owners_of(p, 2), all, pg), c10::ValueError);
    ZeroOptions zero_cap;
    zero_cap.bucket_cap_bytes = 0;
    EXPECT_THROW(ZeroShards(p, owners_of(p, 2), all, pg, zero_cap), c10::ValueError);
    ZeroShards ok(p, owners_of(p, 2), all, pg);
    EXPECT_THROW(ok.gather(2, {}, c10::Device(c10::kCPU)), c10::ValueError);
    // A fused step listing a parameter this rank does not own.
    ddpx::optim::ZeroSGDGroup foreign;
    for (size_t i = 0; i < p.size(); ++i) {
      if (ok.owners()[i] != rank) {
        foreign.params.push_back(static_cast<int64_t>(i));
        break;
      }
    }
    foreign.grads = {at::zeros_like(p[foreign.params[0]])};
    foreign.momentum_buffers = {at::Tensor()};
    std::vector<ddpx::optim::ZeroSGDGroup> groups{foreign};
    EXPECT_THROW(ddpx::optim::step_sgd(ok, groups), c10::ValueError);
    // What the kernels take: a matching gradient yes; another dtype, a non-contiguous gradient or
    // a state of another shape no (the caller then runs its optimizer's own step).
    const int64_t mine_index = ok.owned_by(rank).front();
    const at::Tensor& own = p[mine_index];
    ddpx::optim::ZeroSGDGroup g;
    g.params = {mine_index};
    g.momentum_buffers = {at::Tensor()};
    g.grads = {at::zeros_like(own)};
    EXPECT_TRUE(ddpx::optim::fused_step_supported(ok, std::vector<ddpx::optim::ZeroSGDGroup>{g}));
    g.grads = {at::zeros_like(own, at::kDouble)};
    EXPECT_FALSE(ddpx::optim::fused_step_supported(ok, std::vector<ddpx::optim::ZeroSGDGroup>{g}));
    if (own.dim() == 2 && own.size(0) > 1 && own.size(1) > 1) {
      g.grads = {at::zeros({own.size(1), own.size(0)}).t()};
      EXPECT_FALSE(
          ddpx::optim::fused_step_supported(ok, std::vector<ddpx::optim::ZeroSGDGroup>{g}));
    }
    ddpx::optim::ZeroAdamGroup a;
    a.params = {mine_index};
    a.grads = {at::zeros_like(own)};
    a.exp_avgs = {at::zeros({own.numel() + 1})};
    a.exp_avg_sqs = {at::zeros_like(own)};
    a.steps = {at::zeros({})};
    EXPECT_FALSE(ddpx::optim::fused_step_supported(ok, std::vector<ddpx::optim::ZeroAdamGroup>{a}));
    a.exp_avgs = {at::zeros_like(own)};
    EXPECT_TRUE(ddpx::optim::fused_step_supported(ok, std::vector<ddpx::optim::ZeroAdamGroup>{a}));
  });
}

// The C++ class over torch::optim optimizers against the unsharded optimizer. Through a closure
// step() runs the local optimizer's own step: bit for bit. Without one it runs ddpx's fused step
// (torch::optim's SGD, Adam and AdamW): SGD is still bit for bit; Adam's kernel rounds its
// bias corrections differently from torch::optim::Adam, within `rtol`.
struct Match {
  bool bucket_view = false;
  bool balanced = false;
  bool closure = false;
  double rtol = 0;         // 0: bit for bit
  bool contiguous = true;  // make_params' flag
};

template <typename Make>
void expect_matches_unsharded(int world, Make make, Match m) {
  const bool bucket_view = m.bucket_view, balanced = m.balanced;
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    auto params = make_params(9, m.contiguous);
    auto reference = make_params(9, m.contiguous);
    ZeroOptions o;
    o.parameters_as_bucket_view = bucket_view;
    o.bucket_cap_bytes = 128;
    if (balanced) o.partition = ddpx::optim::ZeroPartition::kBalanced;
    // Two groups, the second with its own learning rate.
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>(params.begin(), params.begin() + 4));
    groups.emplace_back(std::vector<at::Tensor>(params.begin() + 4, params.end()),
                        make(std::vector<torch::optim::OptimizerParamGroup>{})->defaults().clone());
    groups[1].options().set_lr(groups[1].options().get_lr() * 3);
    std::vector<torch::optim::OptimizerParamGroup> ref_groups;
    ref_groups.emplace_back(std::vector<at::Tensor>(reference.begin(), reference.begin() + 4));
    ref_groups.emplace_back(std::vector<at::Tensor>(reference.begin() + 4, reference.end()),
                            groups[1].options().clone());
    ZeroRedundancyOptimizer zero(groups, make, pg, o);
    auto unsharded = make(std::move(ref_groups));
    // The local optimizer holds exactly this rank's elements (whole parameters, or pieces).
    int64_t local = 0;
    for (const auto& g : zero.local().param_groups()) {
      for (const auto& u : g.params()) local += u.numel();
    }
    int64_t owned = 0;
    bool split = false;
    for (size_t i = 0; i < zero.params().size(); ++i) {
      split = split || zero.pieces(i).size() > 1;
      for (const auto& piece : zero.pieces(i)) {
        if (piece.owner == rank) owned += piece.end - piece.begin;
      }
    }
    EXPECT_EQ(local, owned);
    if (balanced && world > 1) EXPECT_TRUE(split) << "no parameter split at world " << world;
    for (int64_t step = 0; step < 3; ++step) {
      const auto grads = grads_for(params, step);
      zero.zero_grad();
      unsharded->zero_grad();
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() = grads[i].clone();
        reference[i].mutable_grad() = grads[i].clone();
      }
      // The last step always runs the local optimizer's own step: after fused steps it must
      // find their state (step counts, moments, momentum buffers) in its own layout.
      const bool closure = m.closure || step == 2;
      if (closure) {
        const at::Tensor loss = zero.step([] { return at::ones({}); });
        EXPECT_EQ(loss.item<double>(), 1.0);
      } else {
        EXPECT_FALSE(zero.step().defined());
      }
      // The fused step takes contiguous parameters only (bucket views make them so); otherwise
      // the local optimizer steps. Each rank decides on its own shard.
      bool contiguous = true;
      for (const auto& g : zero.local().param_groups()) {
        for (const auto& u : g.params()) contiguous = contiguous && u.is_contiguous();
      }
      EXPECT_EQ(zero.last_step_fused(), !closure && contiguous);
      unsharded->step();
      for (size_t i = 0; i < params.size(); ++i) {
        const bool same = m.rtol == 0 ? at::equal(params[i], reference[i])
                                      : at::allclose(params[i], reference[i], m.rtol, 0);
        EXPECT_TRUE(same) << "world " << world << " bucket_view " << bucket_view << " closure "
                          << m.closure << " step " << step << " param " << i << ": max diff "
                          << (params[i] - reference[i]).abs().max().item<double>();
      }
      if (m.bucket_view && m.balanced) {
        // Every parameter is a view of its group's flat tensor.
        for (const auto& p : params) {
          bool in_flat = false;
          for (const auto& flat : zero.layout().flat_buffers()) {
            in_flat = in_flat || p.storage().is_alias_of(flat.storage());
          }
          EXPECT_TRUE(in_flat);
        }
      }
    }
    zero.zero_grad(/*set_to_none=*/false);
    for (const auto& p : params) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
    }
    zero.zero_grad();
    for (const auto& p : params) EXPECT_FALSE(p.grad().defined());
  });
}

TEST(ZeroRedundancyOptimizer, AdamMatchesUnshardedAdam) {
  auto make = [](std::vector<torch::optim::OptimizerParamGroup> g) {
    return std::make_shared<torch::optim::Adam>(
        std::move(g), torch::optim::AdamOptions(0.01).weight_decay(0.1).amsgrad(true));
  };
  for (int world : {1, 2, 3, 4}) {
    for (bool bv : {false, true}) {
      expect_matches_unsharded(world, make, {bv, false, /*closure=*/true});
      expect_matches_unsharded(world, make, {bv, false, /*closure=*/false, 1e-6});
      // A non-contiguous parameter: its owner runs the local optimizer's step (unless bucket
      // views make it contiguous), the other ranks the fused step.
      expect_matches_unsharded(world, make, {bv, false, false, 1e-6, false});
    }
  }
}

TEST(ZeroRedundancyOptimizer, AdamWMatchesUnshardedAdamW) {
  auto make = [](std::vector<torch::optim::OptimizerParamGroup> g) {
    return std::make_shared<torch::optim::AdamW>(
        std::move(g), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  };
  for (int world : {2, 3}) {
    expect_matches_unsharded(world, make, {false, false, /*closure=*/true});
    expect_matches_unsharded(world, make, {false, false, /*closure=*/false, 1e-6});
  }
}

TEST(ZeroRedundancyOptimizer, SGDMatchesUnshardedSGD) {
  auto make = [](std::vector<torch::optim::OptimizerParamGroup> g) {
    return std::make_shared<torch::optim::SGD>(
        std::move(g), torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  };
  for (int world : {2, 3}) {
    for (bool bv : {false, true}) {
      for (bool closure : {false, true})
        expect_matches_unsharded(world, make, {bv, false, closure});
    }
  }
}

// Balanced: the 64x33 weight is split between ranks; the pieces' updates (Adam, SGD with
// momentum: elementwise) equal the unsharded optimizer's, with and without bucket views (each
// group flattened).
TEST(ZeroRedundancyOptimizer, BalancedMatchesUnsharded) {
  auto adam = [](std::vector<torch::optim::OptimizerParamGroup> g) {
    return std::make_shared<torch::optim::Adam>(
        std::move(g), torch::optim::AdamOptions(0.01).weight_decay(0.1).amsgrad(true));
  };
  auto sgd = [](std::vector<torch::optim::OptimizerParamGroup> g) {
    return std::make_shared<torch::optim::SGD>(
        std::move(g), torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  };
  for (int world : {1, 2, 3, 4}) {
    for (bool bv : {false, true}) {
      expect_matches_unsharded(world, adam, {bv, /*balanced=*/true, /*closure=*/true});
      expect_matches_unsharded(world, adam, {bv, /*balanced=*/true, /*closure=*/false, 1e-6});
      expect_matches_unsharded(world, sgd, {bv, /*balanced=*/true, /*closure=*/false});
    }
  }
}

TEST(ZeroRedundancyOptimizer, BadArguments) {
  ddpx_test::run_ranks(2, [&](int, const ProcessGroupPtr& pg) {
    auto p = make_params(0);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(p);
    EXPECT_THROW(ZeroRedundancyOptimizer(groups, nullptr, pg), c10::ValueError);
    auto make = [](std::vector<torch::optim::OptimizerParamGroup> g) {
      return std::make_shared<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.1));
    };
    EXPECT_THROW(ZeroRedundancyOptimizer(groups, make, ProcessGroupPtr()), c10::ValueError);
    auto none = [](std::vector<torch::optim::OptimizerParamGroup>) {
      return std::shared_ptr<torch::optim::Optimizer>();
    };
    EXPECT_THROW(ZeroRedundancyOptimizer(groups, none, pg), c10::ValueError);
  });
}

// The overlap with the C++ DDP. Both runs reduce with ddpx's allreduce hook on small buckets
// (several per backward pass), so their averaged gradients are the same bits; the overlapped run
// steps inside the hook, bucket by bucket, the reference after backward with the unsharded
// optimizer.
torch::nn::Sequential overlap_net() {
  torch::nn::Sequential net(torch::nn::Linear(8, 48), torch::nn::Tanh(), torch::nn::Linear(48, 40),
                            torch::nn::Tanh(), torch::nn::Linear(40, 3));
  at::Generator gen = at::detail::createCPUGenerator(5);
  at::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(randn(p.sizes(), gen) * 0.3);
  return net;
}

struct OverlapCase {
  std::string name;
  ZeroRedundancyOptimizer::LocalFactory make;
  bool fused;   // the local optimizer is one the fused step takes
  double rtol;  // 0: bit for bit
};

void expect_overlap_matches(int world, const OverlapCase& c, bool interleaved, bool balanced) {
  ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
    using ddpx::ddp::DDPOptions;
    using ddpx::ddp::DistributedDataParallel;
    const auto options = DDPOptions().bucket_cap_mb(0.004);
    auto ref_net = overlap_net();
    DistributedDataParallel ref(ref_net, pg, options);
    ref.register_comm_hook(ddpx::hooks::allreduce_hook(pg));
    std::vector<torch::optim::OptimizerParamGroup> ref_groups;
    ref_groups.emplace_back(ref_net->parameters());
    auto unsharded = c.make(std::move(ref_groups));

    auto net = overlap_net();
    DistributedDataParallel ddp(net, pg, options);
    ZeroOptions o;
    o.overlap_with_ddp = true;
    o.bucket_cap_bytes = 256;
    if (balanced) o.partition = ddpx::optim::ZeroPartition::kBalanced;
    auto zero = std::make_shared<ZeroRedundancyOptimizer>(
        std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup(net->parameters())},
        c.make, pg, o);
    ddp.register_comm_hook(
        interleaved
            ? ddpx::hooks::hook_with_zero_step_interleaved(ddpx::hooks::allreduce_hook(pg), zero)
            : ddpx::hooks::hook_with_zero_step(ddpx::hooks::allreduce_hook(pg), zero));
    const std::string what = c.name + (interleaved ? " interleaved" : "") +
                             (balanced ? " balanced" : "") + ", world " + std::to_string(world);
    const auto initial = net->parameters()[2].detach().clone();
    for (int64_t step = 0; step < 4; ++step) {
      at::Generator gen =
          at::detail::createCPUGenerator(static_cast<uint64_t>(50 + 7 * rank + step));
      const at::Tensor x = randn({6, 8}, gen);
      unsharded->zero_grad();
      ref.forward(x).pow(2).sum().backward();
      unsharded->step();
      zero->zero_grad();
      ddp.forward(x).pow(2).sum().backward();  // reduces, steps and exchanges
      EXPECT_EQ(zero->last_step_fused(), c.fused) << what;
      const auto got = net->parameters();
      const auto want = ref_net->parameters();
      for (size_t i = 0; i < got.size(); ++i) {
        // Adam: within rtol of the parameter's largest value (some elements are near zero).
        const bool same = c.rtol == 0 ? at::equal(got[i], want[i])
                                      : (got[i] - want[i]).abs().max().item<double>() <=
                                            c.rtol * want[i].abs().max().item<double>();
        EXPECT_TRUE(same) << what << ", step " << step << ", parameter " << i << ": max diff "
                          << (got[i] - want[i]).abs().max().item<double>();
      }
    }
    EXPECT_FALSE(at::equal(net->parameters()[2], initial)) << what << ": nothing was stepped";
    // The hook steps: a step() left in the loop does nothing.
    const auto before = net->parameters()[0].detach().clone();
    EXPECT_FALSE(zero->step().defined());
    EXPECT_TRUE(at::equal(net->parameters()[0], before));
  });
}

TEST(ZeroRedundancyOptimizer, OverlapWithDDPMatchesDDPThenTheUnshardedOptimizer) {
  const std::vector<OverlapCase> cases = {
      {"SGD",
       [](std::vector<torch::optim::OptimizerParamGroup> g) {
         return std::make_shared<torch::optim::SGD>(
             std::move(g), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
       },
       true, 0},
      {"Adam",
       [](std::vector<torch::optim::OptimizerParamGroup> g) {
         return std::make_shared<torch::optim::Adam>(std::move(g),
                                                     torch::optim::AdamOptions(0.01).amsgrad(true));
       },
       true, 1e-6},
      // No fused step: the local optimizer's own step, then the exchange of the bucket's units.
      {"Adagrad",
       [](std::vector<torch::optim::OptimizerParamGroup> g) {
         return std::make_shared<torch::optim::Adagrad>(std::move(g),
                                                        torch::optim::AdagradOptions(0.05));
       },
       false, 0},
  };
  for (int world : {2, 3}) {
    for (const auto& c : cases) {
      for (bool interleaved : {false, true}) {
        for (bool balanced : {false, true}) expect_overlap_matches(world, c, interleaved, balanced);
      }
    }
  }
}

TEST(ZeroRedundancyOptimizer, OverlapHooksRefuseBadArguments) {
  ddpx_test::run_ranks(2, [&](int, const ProcessGroupPtr& pg) {
    auto p = make_params(0);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(p);
    auto make = [](std::vector<torch::optim::OptimizerParamGroup> g) {
      return std::make_shared<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.1));
    };
    auto plain = std::make_shared<ZeroRedundancyOptimizer>(groups, make, pg);
    auto hook = ddpx::hooks::allreduce_hook(pg);
    EXPECT_THROW(ddpx::hooks::hook_with_zero_step(hook, plain), c10::ValueError);
    EXPECT_THROW(ddpx::hooks::hook_with_zero_step_interleaved(hook, plain), c10::ValueError);
    ZeroOptions o;
    o.overlap_with_ddp = true;
    auto zero = std::make_shared<ZeroRedundancyOptimizer>(groups, make, pg, o);
    EXPECT_THROW(ddpx::hooks::hook_with_zero_step(nullptr, zero), c10::ValueError);
    EXPECT_THROW(ddpx::hooks::hook_with_zero_step(hook, nullptr), c10::ValueError);
    EXPECT_EQ(ddpx::hooks::hook_with_zero_step(hook, zero)->name(), "hook_with_zero_fn");
    // step_params: a tensor that is not one of the optimizer's, and mismatched lists.
    const at::Tensor stranger = at::zeros({3}).requires_grad_();
    EXPECT_THROW(zero->step_params({stranger}, {at::zeros({3})}), c10::ValueError);
    EXPECT_THROW(zero->step_params({p[0]}, {}), c10::ValueError);
    EXPECT_THROW(zero->step_params({p[0]}, {at::zeros({p[0].numel() + 1})}), c10::ValueError);
  });
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Rank threads are the parallelism here; intra-op threads would only oversubscribe.
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
