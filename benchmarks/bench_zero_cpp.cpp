// The C++ ZeroRedundancyOptimizer's step over torch::optim::Adam: its fused step (ddpx's kernels
// on the shard, each chunk's broadcast starting as soon as it is updated) against the same class
// stepping its local torch::optim::Adam and then exchanging (a closure forces that path), and
// against torch::optim::Adam on every parameter, unsharded. Ranks are threads of this process on
// Gloo over loopback, all timed in one run on the same parameters and gradients.
//
// Then the overlap with the C++ DDP: a training iteration (forward, backward, step) of an MLP of
// about the same size with zero.step() after backward (ddpx's allreduce hook), against the step
// inside the backward pass (hook_with_zero_step, and its interleaved form, around the same hook).
// The three DDP models train side by side, iterations alternating.
//
//   build/benchmarks/bench_zero_cpp [world=2] [million_params=8] [steps=15]
//
// Prints each median time in ms and the ratios.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ddpx/common/compat.h>
#include <ddpx/ddp.h>
#include <ddpx/hooks/allreduce_hook.h>
#include <ddpx/hooks/ddp_zero_hook.h>
#include <ddpx/optim/zero.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#if DDPX_HAS_GLOO_GROUP
namespace {

using Clock = std::chrono::steady_clock;

// A model's worth of parameters: a few large matrices and many small vectors, 32-bit.
std::vector<at::Tensor> make_params(int64_t total) {
  std::vector<at::Tensor> p;
  const int64_t large = total / 5;
  for (int k = 0; k < 4; ++k) p.push_back(at::randn({large / 1024, 1024}));
  int64_t left = total - 4 * (large / 1024) * 1024;
  while (left > 0) {
    const int64_t n = std::min<int64_t>(left, 4096);
    p.push_back(at::randn({n}));
    left -= n;
  }
  for (auto& t : p) t.set_requires_grad(true);
  return p;
}

std::shared_ptr<torch::optim::Optimizer> adam(std::vector<torch::optim::OptimizerParamGroup> g) {
  return std::make_shared<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(1e-3));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Four square layers of about `total` parameters in all, the same values on every call.
torch::nn::Sequential make_mlp(int64_t total) {
  int64_t width = 64;
  while (4 * (width + 64) * (width + 64) <= total) width += 64;
  torch::nn::Sequential net;
  for (int k = 0; k < 4; ++k) {
    net->push_back(torch::nn::Linear(width, width));
    if (k < 3) net->push_back(torch::nn::Tanh());
  }
  at::manual_seed(1);
  at::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(at::randn_like(p) * 0.02);
  return net;
}

// Median iteration times (rank 0) of the overlap part: step after backward, inside it, and
// interleaved with it.
struct OverlapTimes {
  std::vector<double> after, inside, interleaved;
};

void overlap_rank(int rank, const ddpx::ProcessGroupPtr& pg, int64_t total, int steps,
                  OverlapTimes& out) {
  using ddpx::ddp::DDPOptions;
  using ddpx::ddp::DistributedDataParallel;
  const auto ddp_options = DDPOptions().bucket_cap_mb(4);
  auto zero_for = [&](torch::nn::Sequential& net, bool overlap) {
    ddpx::optim::ZeroOptions o;
    o.overlap_with_ddp = overlap;
    return std::make_shared<ddpx::optim::ZeroRedundancyOptimizer>(
        std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup(net->parameters())},
        adam, pg, o);
  };
  auto net_a = make_mlp(total), net_b = make_mlp(total), net_c = make_mlp(total);
  DistributedDataParallel after(net_a, pg, ddp_options), inside(net_b, pg, ddp_options),
      interleaved(net_c, pg, ddp_options);
  auto zero_a = zero_for(net_a, false), zero_b = zero_for(net_b, true),
       zero_c = zero_for(net_c, true);
  after.register_comm_hook(ddpx::hooks::allreduce_hook(pg));
  inside.register_comm_hook(
      ddpx::hooks::hook_with_zero_step(ddpx::hooks::allreduce_hook(pg), zero_b));
  interleaved.register_comm_hook(
      ddpx::hooks::hook_with_zero_step_interleaved(ddpx::hooks::allreduce_hook(pg), zero_c));
  const int64_t width = net_a->parameters()[0].size(1);
  at::manual_seed(100 + rank);
  const at::Tensor x = at::randn({64, width});
  for (int s = 0; s < steps + 2; ++s) {
    for (int which = 0; which < 3; ++which) {
      pg->barrier()->wait();
      const auto t0 = Clock::now();
      if (which == 0) {
        zero_a->zero_grad();
        after.forward(x).pow(2).mean().backward();
        zero_a->step();
      } else {
        auto& ddp = which == 1 ? inside : interleaved;
        (which == 1 ? zero_b : zero_c)->zero_grad();
        ddp.forward(x).pow(2).mean().backward();
      }
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (s >= 2 && rank == 0) {
        (which == 0 ? out.after : which == 1 ? out.inside : out.interleaved).push_back(ms);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 2;
  const int64_t total = static_cast<int64_t>((argc > 2 ? std::atof(argv[2]) : 8.0) * 1e6);
  const int steps = argc > 3 ? std::atoi(argv[3]) : 15;
  at::set_num_threads(1);  // one thread per rank: the ranks are the parallelism
  ddpx::compat::disable_flight_recorder_for_thread_ranks();
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<double> fused_ms, local_ms;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto options = c10d::ProcessGroupGloo::Options::create();
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      auto pg = ddpx::compat::make_gloo_group(store, r, world, options);
      at::manual_seed(0);
      auto params = make_params(total);
      ddpx::optim::ZeroRedundancyOptimizer zero({torch::optim::OptimizerParamGroup(params)}, adam,
                                                pg);
      std::vector<double> fused, local;
      for (int s = 0; s < 2 * steps + 2; ++s) {
        for (auto& p : params) p.mutable_grad() = at::randn_like(p);
        pg->barrier()->wait();
        const auto t0 = Clock::now();
        // Alternate the two paths on the same state, so that drift in the machine's speed hits
        // both alike; the first two steps warm up.
        const bool use_local = s % 2 == 1;
        if (use_local) {
          zero.step([] { return at::Tensor(); });
        } else {
          zero.step();
        }
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (s >= 2) (use_local ? local : fused).push_back(ms);
      }
      if (r == 0) {
        fused_ms = fused;
        local_ms = local;
      }
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  OverlapTimes overlap;
  auto store2 = c10::make_intrusive<c10d::HashStore>();
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto options = c10d::ProcessGroupGloo::Options::create();
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      overlap_rank(r, ddpx::compat::make_gloo_group(store2, r, world, options), total, steps,
                   overlap);
    });
  }
  for (auto& t : threads) t.join();
  // torch::optim::Adam over every parameter on one thread: what each rank would run unsharded.
  at::manual_seed(0);
  auto params = make_params(total);
  auto whole = adam({torch::optim::OptimizerParamGroup(params)});
  std::vector<double> torch_ms;
  for (int s = 0; s < steps + 1; ++s) {
    for (auto& p : params) p.mutable_grad() = at::randn_like(p);
    const auto t0 = Clock::now();
    whole->step();
    if (s >= 1) {
      torch_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  const double f = median(fused_ms), l = median(local_ms), t = median(torch_ms);
  std::printf("world %d, %.1fM parameters, Adam, medians of %d steps (rank 0)\n", world,
              total / 1e6, steps);
  std::printf("  torch::optim::Adam, unsharded         %8.2f ms\n", t);
  std::printf("  ZeRO, local torch::optim::Adam step   %8.2f ms  (%.2fx unsharded)\n", l, l / t);
  std::printf("  ZeRO, fused step                      %8.2f ms  (%.2fx unsharded, %.2fx local)\n",
              f, f / t, f / l);
  const double a = median(overlap.after), b = median(overlap.inside),
               c = median(overlap.interleaved);
  std::printf("DDP iteration (forward, backward, ZeRO Adam step), medians of %d (rank 0)\n", steps);
  std::printf("  step after backward                   %8.2f ms\n", a);
  std::printf("  hook_with_zero_step                   %8.2f ms  (%.2fx after)\n", b, b / a);
  std::printf("  hook_with_zero_step_interleaved       %8.2f ms  (%.2fx after)\n", c, c / a);
  return 0;
}
#else
int main() {
  std::printf("bench_zero_cpp: this torch has no usable Gloo process group header\n");
  return 0;
}
#endif
