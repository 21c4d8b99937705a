// The overlap of ddpx::optim::ZeroRedundancyOptimizer's step with DDP's backward pass, for the C++
// DistributedDataParallel (ddpx/ddp.h): torch's ddp_zero_hook functions (hook_with_zero_step,
// hook_with_zero_step_interleaved), as the Python ddpx.hooks ones are.
//
//   ddpx::optim::ZeroOptions options;
//   options.overlap_with_ddp = true;
//   auto zero = std::make_shared<ddpx::optim::ZeroRedundancyOptimizer>(groups, make_local, pg,
//                                                                      options);
//   ddp.register_comm_hook(ddpx::hooks::hook_with_zero_step(ddpx::hooks::allreduce_hook(pg),
//                                                           zero));
//   loss.backward();  // reduces, steps and exchanges: no zero->step()
//
// Each wraps any ddpx hook. The wrapped hook reduces a bucket as usual; the optimizer then steps
// this rank's share of that bucket's parameters with the reduced gradients and exchanges them
// (ZeroRedundancyOptimizer::step_params), from inside the hook call, so the exchange's broadcasts
// go out in bucket order on every rank, never from a completion callback (which can hang Gloo).
// Parameters are updated from the first iteration (torch waits two or three iterations for DDP's
// rebuilt buckets; ddpx's partition is per parameter). The local optimizer may be any
// torch::optim optimizer; SGD, Adam and AdamW run ddpx's fused step.
#pragma once

#include <ddpx/hooks/comm_hook.h>

#include <memory>

namespace ddpx {
namespace optim {
class ZeroRedundancyOptimizer;
}  // namespace optim

namespace hooks {

// `hook` with `zero`'s step after the backward computation: at the last bucket, every bucket's
// parameters are stepped and exchanged in bucket order, each as soon as its reduction completes.
// c10::ValueError for a null argument or a `zero` built without overlap_with_ddp. The returned
// hook keeps `zero` alive; register it on the DDP model whose parameters `zero` optimizes.
CommHookPtr hook_with_zero_step(CommHookPtr hook,
                                std::shared_ptr<optim::ZeroRedundancyOptimizer> zero);
// `hook` with `zero`'s step interleaved with the backward computation: bucket i-1's parameters
// are stepped and exchanged at bucket i (its reduction had bucket i's backward computation to
// finish), the last bucket's at the last bucket. Arguments as hook_with_zero_step.
CommHookPtr hook_with_zero_step_interleaved(CommHookPtr hook,
                                            std::shared_ptr<optim::ZeroRedundancyOptimizer> zero);

}  // namespace hooks
}  // namespace ddpx
