// Post-local SGD in a C++ libtorch training loop: two Gloo ranks (threads) train a linear
// regression on different data with ddpx::hooks::post_localSGD_hook averaging the gradients
// (globally during the warm-up, then within a one-rank subgroup: not at all) and
// ddpx::optim::PostLocalSGDOptimizer (SGD + ddpx::optim::PeriodicModelAverager) averaging the
// parameters every kPeriod steps. Without DDP, the program puts the gradients in a bucket itself,
// as DDP's Reducer does.
//
// Checks: replicas are identical after every warm-up step and every averaging step, differ
// between averaging steps; the loss falls; save()/load() restores the averager's step.
// Exit status: 0 when every check passes, 1 otherwise.
#include <ATen/ATen.h>
#include <ddpx/averaging.h>
#include <ddpx/common/compat.h>
#include <ddpx/hooks.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdio>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <vector>

#include "example_utils.h"

namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 40;
constexpr int kStart = 10;  // start_localSGD_iter == warmup_steps
constexpr int kPeriod = 4;
constexpr int64_t kFeatures = 16;

struct Data {
  at::Tensor x, y;
};

// Averages the gradients of `params` with `hook`, through one bucket laid out as DDP lays it out.
void average_gradients(const ddpx::hooks::CommHookPtr& hook,
                       const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  std::vector<size_t> offsets, lengths;
  std::vector<std::vector<int64_t>> shapes;
  size_t offset = 0;
  for (const auto& p : params) {
    grads.push_back(p.grad().reshape(-1));
    offsets.push_back(offset);
    lengths.push_back(static_cast<size_t>(p.numel()));
    shapes.push_back(p.sizes().vec());
    offset += static_cast<size_t>(p.numel());
  }
  at::Tensor buffer = at::cat(grads);
  const std::vector<c10::IntArrayRef> sizes(shapes.begin(), shapes.end());
  c10d::GradBucket bucket =
      ddpx::compat::make_grad_bucket(0, 1, buffer, offsets, lengths, sizes, params);
  auto future = hook->runHook(bucket);
  future->wait();
  at::Tensor mean = hook->parseHookResult(future->value());
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad().copy_(
        mean.narrow(0, static_cast<int64_t>(offsets[i]), static_cast<int64_t>(lengths[i]))
            .view(params[i].sizes()));
  }
}

struct RankLog {
  std::vector<at::Tensor> params_after_step;  // flattened parameters after each step
  double first_loss = 0, last_loss = 0;
  int64_t restored_step = -1;
  std::string error;
};

void train(int rank, const c10::intrusive_ptr<c10d::Store>& store, const at::Tensor& init_w,
           const Data& data, RankLog& log) {
  auto pg = ddpx_example::make_gloo_group(store, rank, kWorld);
  // The "intra-node" subgroup: each rank on its own machine here.
  auto sub_store = c10::make_intrusive<c10d::PrefixStore>("sub" + std::to_string(rank), store);
  auto subgroup = ddpx_example::make_gloo_group(sub_store, 0, 1);

  torch::nn::Linear model(kFeatures, 1);
  {
    torch::NoGradGuard no_grad;
    model->weight.copy_(init_w);
    model->bias.zero_();
  }
  auto state = std::make_shared<ddpx::hooks::PostLocalSGDState>(
      pg, subgroup, kStart, /*post_local_gradient_allreduce=*/true, [](const std::string&) {});
  auto hook = ddpx::hooks::post_localSGD_hook(state);
  ddpx::optim::PostLocalSGDOptimizer opt(
      std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05)),
      std::make_shared<ddpx::optim::PeriodicModelAverager>(kPeriod, kStart, pg));

  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    at::Tensor loss = (model->forward(data.x) - data.y).pow(2).mean();
    loss.backward();
    average_gradients(hook, model->parameters());
    opt.step();
    if (step == 0) log.first_loss = loss.item<double>();
    log.last_loss = loss.item<double>();
    std::vector<at::Tensor> flat;
    for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape(-1).clone());
    log.params_after_step.push_back(at::cat(flat));
  }

  // Checkpoint round trip: a fresh optimizer + averager resumes the averager's step.
  std::stringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(bytes);
  }
  ddpx::optim::PostLocalSGDOptimizer resumed(
      std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05)),
      std::make_shared<ddpx::optim::PeriodicModelAverager>(kPeriod, kStart, pg));
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  resumed.load(in);
  log.restored_step = resumed.averager()->step();
}

}  // namespace

int main() {
  at::manual_seed(0);
  const at::Tensor w_true = at::randn({1, kFeatures});
  const at::Tensor init_w = at::zeros({1, kFeatures});
  std::vector<Data> data;
  for (int r = 0; r < kWorld; ++r) {
    at::Tensor x = at::randn({64, kFeatures});
    data.push_back({x, at::matmul(x, w_true.t()) + 0.01 * at::randn({64, 1})});
  }
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<RankLog> logs(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        train(r, store, init_w, data[r], logs[r]);
      } catch (const std::exception& e) {
        logs[r].error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();

  bool ok = true;
  auto check = [&](bool cond, const std::string& what) {
    std::printf("  %-62s %s\n", what.c_str(), cond ? "ok" : "FAILED");
    ok = ok && cond;
  };
  std::printf(
      "ddpx C++ post-local SGD example: %d Gloo ranks, %d steps, local SGD from step %d, "
      "averaging every %d\n",
      kWorld, kSteps, kStart, kPeriod);
  for (int r = 0; r < kWorld; ++r) {
    if (!logs[r].error.empty()) {
      std::printf("rank %d failed: %s\nFAIL\n", r, logs[r].error.c_str());
      return 1;
    }
  }
  bool warmup_same = true, averaged_same = true, local_differ = true;
  for (int step = 0; step < kSteps; ++step) {
    const bool same = at::equal(logs[0].params_after_step[step], logs[1].params_after_step[step]);
    // PeriodicModelAverager counts one step per optimizer step: it averages after steps
    // kStart, kStart + kPeriod, ...
    if (step < kStart) {
      warmup_same = warmup_same && same;
    } else if ((step - kStart) % kPeriod == 0) {
      averaged_same = averaged_same && same;
    } else {
      local_differ = local_differ && !same;
    }
  }
  check(warmup_same, "replicas identical after every warm-up step");
  check(averaged_same, "replicas identical after every averaging step");
  check(local_differ, "replicas differ after local steps");
  for (int r = 0; r < kWorld; ++r) {
    check(logs[r].last_loss < 0.1 * logs[r].first_loss,
          "rank " + std::to_string(r) + " loss " + std::to_string(logs[r].first_loss) + " -> " +
              std::to_string(logs[r].last_loss));
    check(logs[r].restored_step == kSteps,
          "rank " + std::to_string(r) + " averager step restored from save()/load()");
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
