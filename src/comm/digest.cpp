// Agreement across ranks by digest. See src/comm/digest.h.
#include "comm/digest.h"

#include <ATen/ATen.h>

namespace ddpx {
namespace comm {

std::vector<bool> all_ranks_agree(const std::vector<int64_t>& digests, const ProcessGroupPtr& pg,
                                  const c10::Device& device) {
  std::vector<int64_t> both;
  for (int64_t d : digests) {
    both.push_back(d);
    both.push_back(-d);
  }
  at::Tensor buffer = at::tensor(both, at::TensorOptions(at::kLong)).to(device);
  std::vector<at::Tensor> buffers{buffer};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  pg->allreduce(buffers, opts)->wait();
  const at::Tensor r = buffer.cpu();
  const int64_t* v = r.data_ptr<int64_t>();
  std::vector<bool> same(digests.size());
  for (size_t i = 0; i < digests.size(); ++i) same[i] = v[2 * i] == -v[2 * i + 1];
  return same;
}

}  // namespace comm
}  // namespace ddpx
