// ddpx::ddp::DistributedDataParallel (ddpx/ddp.h) on 2-3 Gloo ranks as threads (test_utils.h):
//   * construction makes every rank hold rank 0's parameters (each rank starts from its own);
//   * after backward, every gradient equals the closed-form mean of the ranks' local gradients
//     (computed here on a plain copy of the model), with the default buckets, many small
//     buckets, gradient_as_bucket_view, static_graph, ddpx's allreduce hook, torch's built-in
//     ALLREDUCE, and ddpx's fp16 hook (within fp16 rounding);
//   * no_sync() accumulates locally and the next synchronised backward averages the sum;
//   * find_unused_parameters with a branch the forward skips;
//   * prepare_forward / prepare_backward for a module given as a std::shared_ptr;
//   * bad input: no trainable parameter, a second hook, a null group, parameters that differ
//     across ranks (an error on every rank, not a hang); init_process_group's argument checks.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <ddpx/ddp.h>
#include <ddpx/hooks/allreduce_hook.h>
#include <ddpx/hooks/compress_hook.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "test_utils.h"

namespace {

using ddpx::ProcessGroupPtr;
using ddpx::ddp::DDPOptions;
using ddpx::ddp::DistributedDataParallel;

torch::nn::Sequential make_net(int64_t seed) {
  torch::nn::Sequential net(torch::nn::Linear(8, 48), torch::nn::Tanh(), torch::nn::Linear(48, 40),
                            torch::nn::Tanh(), torch::nn::Linear(40, 3));
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  at::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return net;
}

at::Tensor input_of(int rank, int step) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + 10 * rank + step));
  return at::randn({5, 8}, gen) * (1.0 + rank);
}

// Copies of a module's parameters, in order.
std::vector<at::Tensor> params_of(torch::nn::Module& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}

// The local gradients of a copy of `params` (make_net's layout) for each listed rank, each
// summed over its inputs of the listed steps, divided by `divisor` and summed over the ranks.
std::vector<at::Tensor> grads_over(const std::vector<at::Tensor>& params,
                                   const std::vector<int>& ranks, const std::vector<int>& steps,
                                   double divisor) {
  std::vector<at::Tensor> out;
  for (int r : ranks) {
    auto net = make_net(0);
    {
      at::NoGradGuard no_grad;
      auto ps = net->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(params[i]);
    }
    for (int s : steps) net->forward(input_of(r, s)).pow(2).sum().backward();
    auto ps = net->parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      if (out.size() <= i) out.push_back(at::zeros_like(ps[i]));
      out[i] += ps[i].grad() / divisor;
    }
  }
  return out;
}

// The mean over `world` ranks of the local gradients (what DDP gives after those backward
// passes).
std::vector<at::Tensor> mean_grads(const std::vector<at::Tensor>& params, int world,
                                   const std::vector<int>& steps) {
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  return grads_over(params, ranks, steps, world);
}

void expect_close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                  double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << what << ": no gradient for parameter " << i;
    const double scale = want[i].abs().max().item<double>();
    const double err = (got[i] - want[i]).abs().max().item<double>();
    EXPECT_LE(err, rtol * scale + 1e-12) << what << ": parameter " << i;
  }
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return g;
}

struct Variant {
  std::string name;
  std::function<DDPOptions()> options;
  std::function<void(DistributedDataParallel&, const ProcessGroupPtr&)> hook;
  double rtol;
};

std::vector<Variant> variants() {
  auto none = [](DistributedDataParallel&, const ProcessGroupPtr&) {};
  std::vector<Variant> out = {
      {"default", [] { return DDPOptions(); }, none, 1e-6},
      {"small buckets", [] { return DDPOptions().bucket_cap_mb(0.002); }, none, 1e-6},
      {"gradient_as_bucket_view",
       [] { return DDPOptions().bucket_cap_mb(0.002).gradient_as_bucket_view(true); }, none, 1e-6},
      {"static_graph", [] { return DDPOptions().static_graph(true); }, none, 1e-6},
      {"ddpx allreduce_hook", [] { return DDPOptions().bucket_cap_mb(0.002); },
       [](DistributedDataParallel& d, const ProcessGroupPtr& pg) {
         d.register_comm_hook(ddpx::hooks::allreduce_hook(pg));
       },
       1e-6},
      {"builtin ALLREDUCE", [] { return DDPOptions(); },
       [](DistributedDataParallel& d, const ProcessGroupPtr&) {
         d.register_builtin_comm_hook(c10d::BuiltinCommHookType::ALLREDUCE);
       },
       1e-6},
      {"ddpx fp16_compress_hook", [] { return DDPOptions().bucket_cap_mb(0.002); },
       [](DistributedDataParallel& d, const ProcessGroupPtr& pg) {
         d.register_comm_hook(ddpx::hooks::fp16_compress_hook(pg));
       },
       2e-3},
  };
  // The Reducer options that only some torches take: tested where the installed one does.
  if (ddpx::compat::kReducerTakesBucketBytesCapList) {
    out.push_back({"bucket_cap_mb_list",
                   [] {
                     return DDPOptions().bucket_cap_mb_list({0.001, 0.003});
                   },
                   none, 1e-6});
  }
  if (ddpx::compat::kReducerTakesSkipAllReduceUnusedParams) {
    out.push_back({"skip_all_reduce_unused_params",
                   [] {
                     return DDPOptions().find_unused_parameters(true).skip_all_reduce_unused_params(
                         true);
                   },
                   none, 1e-6});
  }
  if (ddpx::compat::kReducerTakesBatchedGradCopy) {
    out.push_back({"batched_grad_copy",
                   [] { return DDPOptions().bucket_cap_mb(0.002).batched_grad_copy(true); }, none,
                   1e-6});
  }
  if (ddpx::compat::kReducerTakesLazyBucketAllocation) {
    out.push_back({"lazy_bucket_allocation",
                   [] { return DDPOptions().bucket_cap_mb(0.002).lazy_bucket_allocation(true); },
                   none, 1e-6});
  }
  return out;
}

TEST(DistributedDataParallel, GradientsAreTheMeanOfTheRanksLocalGradients) {
  for (int world : {2, 3}) {
    for (const auto& v : variants()) {
      ddpx_test::run_ranks(world, [&](int rank, const ProcessGroupPtr& pg) {
        auto net = make_net(rank);  // every rank starts elsewhere: rank 0's values win
        DistributedDataParallel ddp(net, pg, v.options());
        v.hook(ddp, pg);
        const auto rank0 = make_net(0)->parameters();
        for (size_t i = 0; i < rank0.size(); ++i) {
          ASSERT_TRUE(at::equal(net->parameters()[i], rank0[i])) << "initial broadcast, " << i;
        }
        for (int step = 0; step < 3; ++step) {  // the Reducer rebuilds its buckets after step 0
          for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
          const auto snapshot = params_of(*net);
          ddp.forward(input_of(rank, step)).pow(2).sum().backward();
          expect_close(
              grads_of(net->parameters()), mean_grads(snapshot, world, {step}), v.rtol,
              v.name + ", world " + std::to_string(world) + ", step " + std::to_string(step));
          at::NoGradGuard no_grad;
          for (auto& p : net->parameters()) p.sub_(p.grad() * 0.1);  // SGD, the same everywhere
        }
      });
    }
  }
}

// init_sync(false): no check across ranks and no broadcast, each rank keeps its own values.
TEST(DistributedDataParallel, WithoutInitSyncEachRankKeepsItsParameters) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto net = make_net(rank);
    DistributedDataParallel ddp(net, pg, DDPOptions().init_sync(false));
    const auto own = make_net(rank)->parameters();
    for (size_t i = 0; i < own.size(); ++i) {
      EXPECT_TRUE(at::equal(net->parameters()[i], own[i])) << "rank " << rank << ", " << i;
    }
    // Training still averages the gradients.
    const auto snapshot = params_of(*net);
    ddp.forward(input_of(rank, 0)).pow(2).sum().backward();
    std::vector<at::Tensor> local = grads_over(snapshot, {rank}, {0}, 1.0);
    EXPECT_FALSE(at::equal(net->parameters()[0].grad(), local[0]));  // not only this rank's
  });
}

// An option the installed torch's Reducer does not take is a ValueError naming it, on every rank
// and before any collective of the Reducer.
TEST(DistributedDataParallel, ReducerOptionsThisTorchLacksAreRefused) {
  std::vector<std::pair<std::string, DDPOptions>> lacking;
  if (!ddpx::compat::kReducerTakesBucketBytesCapList) {
    lacking.emplace_back("bucket_cap_mb_list", DDPOptions().bucket_cap_mb_list({1.0}));
  }
  if (!ddpx::compat::kReducerTakesSkipAllReduceUnusedParams) {
    lacking.emplace_back("skip_all_reduce_unused_params",
                         DDPOptions().skip_all_reduce_unused_params(true));
  }
  if (!ddpx::compat::kReducerTakesBatchedGradCopy) {
    lacking.emplace_back("batched_grad_copy", DDPOptions().batched_grad_copy(true));
  }
  if (!ddpx::compat::kReducerTakesLazyBucketAllocation) {
    lacking.emplace_back("lazy_bucket_allocation", DDPOptions().lazy_bucket_allocation(true));
  }
  if (lacking.empty()) GTEST_SKIP() << "this torch's Reducer takes every option";
  ddpx_test::run_ranks(2, [&](int, const ProcessGroupPtr& pg) {
    for (const auto& [name, options] : lacking) {
      try {
        DistributedDataParallel ddp(make_net(0), pg, options);
        ADD_FAILURE() << name << ": no error";
      } catch (const c10::ValueError& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      }
    }
  });
}

TEST(DistributedDataParallel, NoSyncAccumulatesLocally) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto net = make_net(rank);
    DistributedDataParallel ddp(net, pg, DDPOptions().bucket_cap_mb(0.002));
    const auto start = params_of(*net);
    {
      auto guard = ddp.no_sync();
      ddp.forward(input_of(rank, 0)).pow(2).sum().backward();
      // Local only: this rank's gradient, not the mean.
      expect_close(
          grads_of(net->parameters()),
          [&] {
            auto own = make_net(0);
            own->forward(input_of(rank, 0)).pow(2).sum().backward();
            return grads_of(own->parameters());
          }(),
          1e-6, "inside no_sync");
    }
    ddp.forward(input_of(rank, 1)).pow(2).sum().backward();
    expect_close(grads_of(net->parameters()), mean_grads(start, 2, {0, 1}), 1e-6, "after no_sync");
  });
}

// static_graph's first output goes through a sink whose backward tells the Reducer to reduce
// every bucket; a graph kept past its DistributedDataParallel must not call into the freed
// Reducer (the sink holds it weakly): the backward runs locally.
TEST(DistributedDataParallel, StaticGraphOutputOutlivesTheDDP) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto net = make_net(rank);
    at::Tensor out;
    {
      DistributedDataParallel ddp(net, pg, DDPOptions().static_graph(true));
      out = ddp.forward(input_of(rank, 0));
    }
    net->zero_grad();
    out.pow(2).sum().backward();
    // The local gradient of the parameters DDP started from (rank 0's, broadcast).
    expect_close(grads_of(net->parameters()), grads_over(params_of(*net), {rank}, {0}, 1), 1e-6,
                 "backward after the DDP is gone");
  });
}

// ---- join (uneven inputs) ------------------------------------------------------------------

// What join() must produce: plain SGD (lr) over the iterations, each averaging the local
// gradients of the ranks that still have an input (rank r has counts[r]) over the world size
// (divide_by_initial_world_size) or over those ranks.
std::vector<at::Tensor> join_reference(const std::vector<int>& counts, bool initial_world,
                                       double lr) {
  auto net = make_net(0);
  const int world = static_cast<int>(counts.size());
  const int iterations = *std::max_element(counts.begin(), counts.end());
  for (int i = 0; i < iterations; ++i) {
    std::vector<int> active;
    for (int r = 0; r < world; ++r) {
      if (i < counts[r]) active.push_back(r);
    }
    const double divisor = initial_world ? world : static_cast<double>(active.size());
    const auto grads = grads_over(params_of(*net), active, {i}, divisor);
    at::NoGradGuard no_grad;
    auto ps = net->parameters();
    for (size_t k = 0; k < ps.size(); ++k) ps[k].sub_(grads[k] * lr);
  }
  return params_of(*net);
}

void sgd_step(torch::nn::Module& net, double lr) {
  at::NoGradGuard no_grad;
  for (auto& p : net.parameters()) {
    if (p.grad().defined()) p.sub_(p.grad() * lr);
  }
}

// Three ranks with 2, 3 and 4 inputs (rank 0 joins first: the final state must come from
// rank 2) and with 4, 3 and 2 (the last joiner is rank 0), both divisions, two bucket layouts:
// every rank ends with the reference's parameters.
TEST(DistributedDataParallel, JoinUnevenInputsMatchesTheReference) {
  const double lr = 0.05;
  for (const std::vector<int>& counts : {std::vector<int>{2, 3, 4}, std::vector<int>{4, 3, 2}}) {
    for (bool initial_world : {true, false}) {
      for (double cap : {25.0, 0.002}) {
        const std::string what = "counts " + std::to_string(counts[0]) + "," +
                                 std::to_string(counts[1]) + "," + std::to_string(counts[2]) +
                                 (initial_world ? " initial world" : " active ranks") +
                                 " bucket_cap_mb " + std::to_string(cap);
        const auto want = join_reference(counts, initial_world, lr);
        ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
          auto net = make_net(rank);
          DistributedDataParallel ddp(net, pg, DDPOptions().bucket_cap_mb(cap));
          ddpx::ddp::JoinOptions opts;
          opts.divide_by_initial_world_size = initial_world;
          ddp.join(
              [&] {
                for (int i = 0; i < counts[rank]; ++i) {
                  net->zero_grad();
                  ddp.forward(input_of(rank, i)).pow(2).sum().backward();
                  sgd_step(*net, lr);
                }
              },
              opts);
          expect_close(params_of(*net), want, 1e-5, what + ", rank " + std::to_string(rank));
          // Plain again: an even step after join() reduces over all three ranks.
          net->zero_grad();
          ddp.forward(input_of(rank, 9)).pow(2).sum().backward();
        });
      }
    }
  }
}

// throw_on_early_termination: once rank 0 runs out, every rank raises instead of shadowing.
TEST(DistributedDataParallel, JoinThrowOnEarlyTermination) {
  std::vector<std::string> errors(3);
  ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
    auto net = make_net(rank);
    DistributedDataParallel ddp(net, pg);
    ddpx::ddp::JoinOptions opts;
    opts.throw_on_early_termination = true;
    try {
      ddp.join(
          [&] {
            for (int i = 0; i < 1 + rank; ++i) {
              ddp.forward(input_of(rank, i)).pow(2).sum().backward();
            }
          },
          opts);
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  EXPECT_NE(errors[0].find("Rank 0 exhausted all inputs"), std::string::npos) << errors[0];
  for (int r : {1, 2}) {
    EXPECT_NE(errors[r].find("Detected at least one rank that exhausted inputs"), std::string::npos)
        << r << ": " << errors[r];
  }
}

// A module with a buffer its forward counts in, and a branch it never uses:
// find_unused_parameters and broadcast_buffers under join.
struct CountingBranchy : torch::nn::Module {
  CountingBranchy() {
    used = register_module("used", torch::nn::Linear(8, 3));
    unused = register_module("unused", torch::nn::Linear(8, 3));
    seen = register_buffer("seen", at::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x) {
    {
      at::NoGradGuard no_grad;
      seen.add_(1);
    }
    return used->forward(x);
  }
  torch::nn::Linear used{nullptr}, unused{nullptr};
  at::Tensor seen;
};

TEST(DistributedDataParallel, JoinWithUnusedParametersAndBuffers) {
  for (const std::vector<int>& counts : {std::vector<int>{1, 3, 2}, std::vector<int>{3, 1, 1}}) {
    std::vector<at::Tensor> finals(3), seen(3);
    ddpx_test::run_ranks(3, [&](int rank, const ProcessGroupPtr& pg) {
      auto net = std::make_shared<CountingBranchy>();
      {
        at::Generator gen = at::detail::createCPUGenerator(7 + rank);
        at::NoGradGuard no_grad;
        for (auto& p : net->parameters()) p.copy_(at::randn(p.sizes(), gen));
      }
      DistributedDataParallel ddp(net, pg, DDPOptions().find_unused_parameters(true));
      ddp.join([&] {
        for (int i = 0; i < counts[rank]; ++i) {
          net->zero_grad();
          ddp.prepare_forward();
          at::Tensor out = net->forward(input_of(rank, i));
          out = ddp.prepare_backward({out}).front();
          out.pow(2).sum().backward();
          sgd_step(*net, 0.05);
        }
      });
      finals[rank] = at::cat({net->used->weight.flatten(), net->used->bias.flatten(),
                              net->unused->weight.flatten(), net->unused->bias.flatten()})
                         .detach()
                         .clone();
      seen[rank] = net->seen.clone();
    });
    // One model everywhere (the last joiner's), the unused branch as rank 0 built it, and the
    // forward counter of the rank that ran every iteration.
    const int most = *std::max_element(counts.begin(), counts.end());
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(at::equal(finals[r], finals[0])) << r;
      EXPECT_EQ(seen[r].item<float>(), most) << r;
    }
  }
}

// A module whose forward skips a branch: the unused branch's parameters get no gradient, and
// the Reducer must not wait for them (find_unused_parameters).
struct Branchy : torch::nn::Module {
  Branchy() {
    used = register_module("used", torch::nn::Linear(8, 3));
    unused = register_module("unused", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};

TEST(DistributedDataParallel, FindUnusedParametersAndASharedPtrModule) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    auto net = std::make_shared<Branchy>();
    {
      at::Generator gen = at::detail::createCPUGenerator(7);
      at::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.copy_(at::randn(p.sizes(), gen));
    }
    DistributedDataParallel ddp(net, pg, DDPOptions().find_unused_parameters(true));
    EXPECT_THROW(ddp.forward(input_of(rank, 0)), c10::ValueError);  // a shared_ptr: no forward
    for (int step = 0; step < 2; ++step) {
      net->zero_grad();
      ddp.prepare_forward();
      at::Tensor out = net->forward(input_of(rank, step));
      out = ddp.prepare_backward({out}).front();
      out.pow(2).sum().backward();
      // The used weight's gradient is the mean of the ranks' local ones.
      at::Tensor want = at::zeros_like(net->used->weight);
      for (int r = 0; r < 2; ++r) {
        auto w = net->used->weight.detach().clone().requires_grad_(true);
        auto b = net->used->bias.detach().clone();
        (at::linear(input_of(r, step), w, b)).pow(2).sum().backward();
        want += w.grad() / 2;
      }
      EXPECT_TRUE(at::allclose(net->used->weight.grad(), want, 1e-6, 1e-7)) << step;
      const at::Tensor& g = net->unused->weight.grad();
      EXPECT_TRUE(!g.defined() || g.abs().max().item<double>() == 0.0) << step;
    }
  });
}

TEST(DistributedDataParallel, BadInput) {
  ddpx_test::run_ranks(2, [&](int rank, const ProcessGroupPtr& pg) {
    // No trainable parameter.
    torch::nn::Sequential frozen(torch::nn::Linear(2, 2));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    EXPECT_THROW(DistributedDataParallel(frozen, pg), c10::ValueError);
    EXPECT_THROW(DistributedDataParallel(make_net(0), ProcessGroupPtr()), c10::ValueError);
    EXPECT_THROW(DistributedDataParallel(make_net(0), pg, DDPOptions().bucket_cap_mb(0)),
                 c10::ValueError);
    EXPECT_THROW(
        DistributedDataParallel(make_net(0), pg, DDPOptions().bucket_cap_mb_list({1.0, -1.0})),
        c10::ValueError);
    // A second hook.
    DistributedDataParallel ddp(make_net(0), pg);
    ddp.register_comm_hook(ddpx::hooks::allreduce_hook(pg));
    EXPECT_THROW(ddp.register_comm_hook(ddpx::hooks::allreduce_hook(pg)), c10::Error);
    // Parameters that differ across ranks: an error on every rank.
    torch::nn::Sequential other(torch::nn::Linear(8, rank == 0 ? 4 : 5));
    EXPECT_THROW(DistributedDataParallel(other, pg), c10::ValueError);
  });
}

// A process group of the wrong kind: no backend for the parameters' device (here a Gloo backend
// registered for CUDA tensors only, holding CPU parameters): a ValueError naming both, before any
// collective.
TEST(DistributedDataParallel, GroupWithoutABackendForTheParameters) {
  if (!ddpx::compat::kGroupsMapDevices) GTEST_SKIP() << "a torch 1.13 group takes any device";
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, options);
  auto cuda_only = ddpx::compat::process_group_of(
      c10::static_intrusive_pointer_cast<ddpx::compat::Backend>(gloo), store, 0, 1,
      {c10::DeviceType::CUDA});
  try {
    DistributedDataParallel ddp(make_net(0), cuda_only);
    ADD_FAILURE() << "no error for a group without a CPU backend";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("has no backend for cpu tensors"), std::string::npos)
        << e.what();
  }
}

TEST(ProcessGroupFromEnv, ArgumentsAreChecked) {
  using ddpx::ddp::init_process_group;
  EXPECT_THROW(init_process_group("gloo", 2, 2, "127.0.0.1", 29500), c10::ValueError);
  EXPECT_THROW(init_process_group("gloo", 0, 0, "127.0.0.1", 29500), c10::ValueError);
  EXPECT_THROW(init_process_group("gloo", 0, 1, "127.0.0.1", 70000), c10::ValueError);
  EXPECT_THROW(init_process_group("mpi", 0, 1, "127.0.0.1", 29500), c10::ValueError);
  EXPECT_THROW(init_process_group("gloo", 0, 1, "", 29500), c10::ValueError);
  // From the environment: missing and malformed variables are named.
  unsetenv("RANK");
  setenv("WORLD_SIZE", "2", 1);
  try {
    ddpx::ddp::init_process_group_from_env("gloo");
    ADD_FAILURE() << "no error without RANK";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK is not set"), std::string::npos) << e.what();
  }
  setenv("RANK", "one", 1);
  try {
    ddpx::ddp::init_process_group_from_env("gloo");
    ADD_FAILURE() << "no error for RANK=one";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='one' is not an integer"), std::string::npos)
        << e.what();
  }
  // A world of one through a real TCPStore on a free port.
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "0", 1);
  EXPECT_THROW(ddpx::ddp::init_process_group_from_env("gloo"), c10::ValueError);  // port 0
}

// A TCP port nobody listens on now (0 if none could be had).
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// Two ranks (threads) through a real TCPStore on a free port: the group works, and a DDP over it
// averages.
TEST(ProcessGroupFromEnv, TwoRanksOverATcpStore) {
  ddpx::compat::disable_flight_recorder_for_thread_ranks();
  const int port = free_port();
  ASSERT_GT(port, 0);
  std::vector<at::Tensor> sums(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto pg = ddpx::ddp::init_process_group("gloo", rank, 2, "127.0.0.1", port,
                                                std::chrono::milliseconds(30000));
        std::vector<at::Tensor> t{at::full({3}, static_cast<double>(rank + 1))};
        pg->allreduce(t)->wait();
        sums[rank] = t[0];
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& s : sums) {
    ASSERT_TRUE(s.defined());
    EXPECT_TRUE(at::equal(s, at::full({3}, 3.0)));
  }
}

// new_group / new_subgroups on 3 ranks of a group made by init_process_group: members get a
// group of the listed ranks (sums over them only), non-members a null handle; subgroups of one;
// the argument checks; a group not made by init_process_group is refused.
TEST(ProcessGroupFromEnv, NewGroupAndSubgroups) {
  ddpx::compat::disable_flight_recorder_for_thread_ranks();
  const int port = free_port();
  ASSERT_GT(port, 0);
  constexpr int kWorld = 3;
  std::vector<at::Tensor> pair_sum(kWorld), single(kWorld);
  std::vector<int> pair_size(kWorld, -1), pair_rank(kWorld, -1), sub_size(kWorld, -1);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto pg = ddpx::ddp::init_process_group("gloo", rank, kWorld, "127.0.0.1", port,
                                                std::chrono::milliseconds(30000));
        EXPECT_THROW(ddpx::ddp::new_group(pg, {}), c10::ValueError);
        EXPECT_THROW(ddpx::ddp::new_group(pg, {0, 0}), c10::ValueError);
        EXPECT_THROW(ddpx::ddp::new_group(pg, {0, 3}), c10::ValueError);
        EXPECT_THROW(ddpx::ddp::new_subgroups(pg, 2), c10::ValueError);  // 2 does not divide 3
        auto pair = ddpx::ddp::new_group(pg, {2, 0});                    // sorted: ranks 0 and 2
        if (pair) {
          pair_size[rank] = static_cast<int>(pair->getSize());
          pair_rank[rank] = static_cast<int>(pair->getRank());
          std::vector<at::Tensor> t{at::full({2}, static_cast<double>(10 * (rank + 1)))};
          pair->allreduce(t)->wait();
          pair_sum[rank] = t[0];
        }
        auto sub = ddpx::ddp::new_subgroups(pg, 1);
        sub_size[rank] = static_cast<int>(sub->getSize());
        std::vector<at::Tensor> t{at::full({1}, static_cast<double>(rank))};
        sub->allreduce(t)->wait();
        single[rank] = t[0];
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pair_size, (std::vector<int>{2, -1, 2}));
  EXPECT_EQ(pair_rank, (std::vector<int>{0, -1, 1}));
  for (int rank : {0, 2}) {
    ASSERT_TRUE(pair_sum[rank].defined());
    EXPECT_TRUE(at::equal(pair_sum[rank], at::full({2}, 40.0)));  // 10 + 30: rank 1 left out
  }
  EXPECT_EQ(sub_size, (std::vector<int>{1, 1, 1}));
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_TRUE(single[rank].defined());
    EXPECT_TRUE(at::equal(single[rank], at::full({1}, static_cast<double>(rank))));
  }
  // A group made otherwise (here by the test utilities over a HashStore) has no store to use.
  auto groups = ddpx_test::make_gloo_world(1);
  EXPECT_THROW(ddpx::ddp::new_group(groups.at(0), {0}), c10::ValueError);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Rank threads are the parallelism here; intra-op threads would only oversubscribe.
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
