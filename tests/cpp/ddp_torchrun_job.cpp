// A C++ data-parallel training job as torchrun launches it (`torchrun --nproc_per_node=2
// --no-python ddp_torchrun_job`; the ctest ddp_torchrun runs exactly that): the process group
// from torchrun's environment (its agent store), ddpx::ddp::DistributedDataParallel over a small
// MLP whose initial weights differ per rank, a ddpx hook, 4 SGD steps on rank-dependent data. Exits
// non-zero unless every rank holds rank 0's initial weights after construction and the replicas
// stay equal after every step (checked with an all-reduced min and max of the parameters).
// `ddp_torchrun_job nccl` runs the same on NCCL, the model on GPU LOCAL_RANK
// (scripts/gpu_check.sh).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ddpx/ddp.h>
#include <ddpx/hooks/allreduce_hook.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace {

// max - min over the ranks of every parameter element: 0 when the replicas agree.
double spread(const std::vector<at::Tensor>& params, const ddpx::ProcessGroupPtr& pg) {
  std::vector<at::Tensor> flat;
  for (const auto& p : params) flat.push_back(p.detach().reshape(-1));
  std::vector<at::Tensor> hi{at::cat(flat)}, lo{hi[0].clone()};
  c10d::AllreduceOptions max_opts, min_opts;
  max_opts.reduceOp = c10d::ReduceOp::MAX;
  min_opts.reduceOp = c10d::ReduceOp::MIN;
  pg->allreduce(hi, max_opts)->wait();
  pg->allreduce(lo, min_opts)->wait();
  return (hi[0] - lo[0]).abs().max().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    at::set_num_threads(1);
    const std::string backend = argc > 1 ? argv[1] : "gloo";
    auto pg = ddpx::ddp::init_process_group_from_env(backend);
    const int rank = pg->getRank();
    const char* local_rank = std::getenv("LOCAL_RANK");
    const at::Device device =
        backend == "nccl"
            ? at::Device(at::kCUDA,
                         static_cast<c10::DeviceIndex>(local_rank ? std::atoi(local_rank) : 0))
            : at::Device(at::kCPU);
    torch::nn::Sequential net(torch::nn::Linear(6, 16), torch::nn::ReLU(),
                              torch::nn::Linear(16, 2));
    at::Generator init = at::detail::createCPUGenerator(static_cast<uint64_t>(rank + 1));
    {
      at::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.copy_(at::randn(p.sizes(), init));
    }
    net->to(device);
    ddpx::ddp::DistributedDataParallel ddp(net, pg, ddpx::ddp::DDPOptions().bucket_cap_mb(0.0005));
    ddp.register_comm_hook(ddpx::hooks::allreduce_hook(pg));
    if (spread(net->parameters(), pg) != 0.0) {
      std::fprintf(stderr, "rank %d: replicas differ after construction\n", rank);
      return 1;
    }
    at::Generator data = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + rank));
    for (int step = 0; step < 4; ++step) {
      for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
      at::Tensor x = at::randn({8, 6}, data).to(device);
      ddp.forward(x).pow(2).mean().backward();
      at::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.sub_(p.grad() * 0.1);
      const double s = spread(net->parameters(), pg);
      if (s != 0.0) {
        std::fprintf(stderr, "rank %d: replicas differ by %g after step %d\n", rank, s, step);
        return 1;
      }
    }
    std::printf("rank %d of %d (%s): 4 steps, replicas equal\n", rank,
                static_cast<int>(pg->getSize()), backend.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_torchrun_job: %s\n", e.what());
    return 1;
  }
}
