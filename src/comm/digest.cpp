// Agreement across ranks by digest. See src/comm/digest.h.
#include "comm/digest.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <ddpx/common/compat.h>

namespace ddpx {
namespace comm {

std::vector<bool> all_ranks_agree(const std::vector<int64_t>& digests, const ProcessGroupPtr& pg,
                                  const c10::Device& device, AgreeOn where) {
  std::vector<int64_t> both;
  for (int64_t d : digests) {
    both.push_back(d);
    both.push_back(-d);
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  if (where == AgreeOn::kAuto) {
    where = compat::takes_cpu_tensors(*pg) ? AgreeOn::kHost : AgreeOn::kDevice;
  }
  if (device.is_cpu()) where = AgreeOn::kHost;
  at::Tensor result;
  if (where == AgreeOn::kHost) {
    std::vector<at::Tensor> buffers{at::tensor(both, at::kLong)};
    pg->allreduce(buffers, opts)->wait();
    result = buffers.front();
  } else {
    const c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream side = impl.getStreamFromGlobalPool(device);
    const c10::StreamGuard on_side(side);  // the collective waits for this stream only
    const bool pin = device.is_cuda();
    at::Tensor staged = at::tensor(both, at::kLong);
    if (pin) staged = staged.pin_memory();
    std::vector<at::Tensor> buffers{
        at::empty({staged.numel()}, at::TensorOptions(at::kLong).device(device))};
    buffers.front().copy_(staged, /*non_blocking=*/pin);
    pg->allreduce(buffers, opts)->wait();  // NCCL: the side stream waits, not the host
    result = at::empty({staged.numel()}, at::TensorOptions(at::kLong).pinned_memory(pin));
    result.copy_(buffers.front(), /*non_blocking=*/pin);
    side.synchronize();
  }
  const int64_t* v = result.data_ptr<int64_t>();
  std::vector<bool> same(digests.size());
  for (size_t i = 0; i < digests.size(); ++i) same[i] = v[2 * i] == -v[2 * i + 1];
  return same;
}

}  // namespace comm
}  // namespace ddpx
