// The C++ ZeroRedundancyOptimizer's step over torch::optim::Adam: its fused step (ddpx's kernels
// on the shard, each chunk's broadcast starting as soon as it is updated) against the same class
// stepping its local torch::optim::Adam and then exchanging (a closure forces that path), and
// against torch::optim::Adam on every parameter, unsharded. Ranks are threads of this process on
// Gloo over loopback, all timed in one run on the same parameters and gradients.
//
//   build/benchmarks/bench_zero_cpp [world=2] [million_params=8] [steps=15]
//
// Prints each median step time in ms and the ratios.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ddpx/common/compat.h>
#include <ddpx/optim/zero.h>
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
  return 0;
}
#else
int main() {
  std::printf("bench_zero_cpp: this torch has no usable Gloo process group header\n");
  return 0;
}
#endif
