// The C++ side of benchmarks/bench_cpp_ddp.py: DDP training steps of an MLP with
// ddpx::ddp::DistributedDataParallel under torchrun (Gloo), timed per phase (forward + loss,
// backward with the gradient communication, optimizer step), for each model size and hook the
// driver names. Rank 0 prints one JSON line per configuration:
//   {"side": "cpp", "model": "64-512-512-10", "hook": "allreduce", "total": ms, "forward": ms,
//    "backward": ms, "step": ms}
// (medians over the timed steps of each rank, averaged over the ranks).
//
//   torchrun --standalone --nproc_per_node=2 --no-python build/benchmarks/bench_cpp_ddp \
//       --models 64-32-10,64-512-512-10 --hooks local,allreduce,fp16,powersgd --steps 500 --warmup
//       20
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/ddp.h>
#include <ddpx/hooks.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, sep);) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

double ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void barrier(const ddpx::ProcessGroupPtr& pg) {
  std::vector<at::Tensor> t{at::zeros({1})};
  pg->allreduce(t)->wait();
}

// "64-512-512-10": Linear layers with ReLU between them (train_digits.py's make_mlp).
torch::nn::Sequential make_mlp(const std::vector<int64_t>& widths) {
  torch::nn::Sequential net;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    if (i > 0) net->push_back(torch::nn::ReLU());
    net->push_back(torch::nn::Linear(widths[i], widths[i + 1]));
  }
  return net;
}

void bench(const ddpx::ProcessGroupPtr& pg, const std::string& model, const std::string& hook,
           int64_t batch, int64_t steps, int64_t warmup) {
  std::vector<int64_t> widths;
  for (const auto& w : split(model, '-')) widths.push_back(std::stoll(w));
  torch::manual_seed(0);
  torch::nn::Sequential net = make_mlp(widths);
  // "local": the module alone, no DDP and no communication (the per-step cost of the language).
  std::unique_ptr<ddpx::ddp::DistributedDataParallel> ddp;
  if (hook != "local") ddp = std::make_unique<ddpx::ddp::DistributedDataParallel>(net, pg);
  if (hook == "fp16") {
    ddp->register_comm_hook(ddpx::hooks::fp16_compress_hook(pg));
  } else if (hook == "powersgd") {
    ddpx::hooks::PowerSGDOptions o;
    o.matrix_approximation_rank = 2;
    o.start_powerSGD_iter = 2;
    ddp->register_comm_hook(ddpx::hooks::powerSGD_hook(
        std::make_shared<ddpx::hooks::PowerSGDState>(pg, o, [](const std::string&) {})));
  } else if (hook != "allreduce" && hook != "local" && hook != "join") {
    throw std::runtime_error("unknown hook " + hook + " (local, allreduce, fp16, powersgd, join)");
  }
  // "join": rank 0 has half the timed steps and joins; the others' second half is timed while
  // it shadows them (no barrier: a joined rank shadows DDP's collectives only).
  const bool join = hook == "join";
  const int64_t half = warmup + steps / 2;
  const int64_t mine = join && pg->getRank() == 0 ? half : warmup + steps;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  at::Generator g = at::detail::createCPUGenerator(static_cast<uint64_t>(pg->getRank() + 1));
  at::Tensor x = at::randn({batch, widths.front()}, g);
  at::Tensor y = at::randint(widths.back(), {batch}, g, at::TensorOptions(at::kLong));
  std::vector<double> total, forward, backward, step;
  auto loop = [&] {
    for (int64_t i = 0; i < mine; ++i) {
      if (!join) barrier(pg);
      const auto t0 = Clock::now();
      sgd.zero_grad();
      at::Tensor loss =
          torch::nn::functional::cross_entropy(ddp ? ddp->forward(x) : net->forward(x), y);
      const auto t1 = Clock::now();
      loss.backward();
      const auto t2 = Clock::now();
      sgd.step();
      const auto t3 = Clock::now();
      if (i < (join ? half : warmup)) continue;
      total.push_back(ms(t0, t3));
      forward.push_back(ms(t0, t1));
      backward.push_back(ms(t1, t2));
      step.push_back(ms(t2, t3));
    }
  };
  if (join) {
    ddp->join(loop);
  } else {
    loop();
  }
  auto med_of = [](const std::vector<double>& v) { return v.empty() ? 0.0 : median(v); };
  at::Tensor med = at::tensor({med_of(total), med_of(forward), med_of(backward), med_of(step)},
                              at::TensorOptions(at::kDouble));
  std::vector<at::Tensor> v{med};
  pg->allreduce(v)->wait();
  // join: the ranks that trained on (rank 0 contributes nothing).
  med = v[0] / static_cast<double>(join ? pg->getSize() - 1 : pg->getSize());
  if (pg->getRank() == 0) {
    std::printf(
        "{\"side\": \"cpp\", \"model\": \"%s\", \"hook\": \"%s\", \"total\": %.6f, "
        "\"forward\": %.6f, \"backward\": %.6f, \"step\": %.6f}\n",
        model.c_str(), hook.c_str(), med[0].item<double>(), med[1].item<double>(),
        med[2].item<double>(), med[3].item<double>());
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string models = "64-32-10,64-512-512-10", hooks = "local,allreduce,fp16,powersgd";
  int64_t batch = 32, steps = 500, warmup = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--models") {
      models = value;
    } else if (key == "--hooks") {
      hooks = value;
    } else if (key == "--batch") {
      batch = std::stoll(value);
    } else if (key == "--steps") {
      steps = std::stoll(value);
    } else if (key == "--warmup") {
      warmup = std::stoll(value);
    } else {
      std::fprintf(stderr, "bench_cpp_ddp: unknown argument %s\n", key.c_str());
      return 2;
    }
  }
  try {
    auto pg = ddpx::ddp::init_process_group_from_env("gloo");
    const char* lw = std::getenv("LOCAL_WORLD_SIZE");
    const int64_t local_world = lw ? std::max(1LL, std::atoll(lw)) : pg->getSize();
    const auto cores = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
    at::set_num_threads(static_cast<int>(std::max<int64_t>(1, cores / local_world)));
    for (const auto& model : split(models, ',')) {
      for (const auto& hook : split(hooks, ',')) bench(pg, model, hook, batch, steps, warmup);
    }
    barrier(pg);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cpp_ddp: %s\n", e.what());
    return 1;
  }
}
