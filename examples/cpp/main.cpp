// ddpx from C++ without DDP: two Gloo ranks (threads over one in-memory store) average a
// gradient bucket with ddpx::hooks::allreduce_hook and fp16_compress_hook, and the program
// checks the results against the mean computed locally.
//
// Exit status: 0 when every check passes, 1 otherwise.
#include <ATen/ATen.h>
#include <ddpx/common/compat.h>
#include <ddpx/hooks.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <vector>

#include "example_utils.h"

namespace {

constexpr int kWorld = 2;
constexpr int64_t kNumel = 10000;

// Rank r's gradients: a deterministic, nonzero pattern every rank can recompute.
at::Tensor gradient_of(int rank) {
  at::Tensor i = at::arange(kNumel, at::kDouble);
  return (at::sin(i * 0.37 + rank) * (1.0 + rank) + 0.01 * (rank + 1)).to(at::kFloat);
}

struct Outcome {
  std::string hook;
  int rank;
  double max_rel_error;  // max over elements of |got - mean| / mean over ranks of |x|
  double tolerance;
  bool ok;
};

// Runs `hook` on one bucket holding this rank's gradients (two parameters back to back) and
// compares the averaged bucket with the mean over ranks.
Outcome run_hook(const ddpx::hooks::CommHookPtr& hook, int rank, double tolerance) {
  at::Tensor buffer = gradient_of(rank);
  // GradBucket keeps IntArrayRefs into `shapes`: it must outlive the bucket.
  const std::vector<std::vector<int64_t>> shapes{{100, 40}, {kNumel - 4000}};
  const std::vector<c10::IntArrayRef> sizes{shapes[0], shapes[1]};
  const std::vector<at::Tensor> params{at::empty(shapes[0]), at::empty(shapes[1])};
  c10d::GradBucket bucket = ddpx::compat::make_grad_bucket(
      /*index=*/0, /*bucket_count=*/1, buffer, /*offsets=*/{0, 4000},
      /*lengths=*/{4000, static_cast<size_t>(kNumel - 4000)}, sizes, params);

  auto future = hook->runHook(bucket);
  future->wait();
  if (future->hasError()) {
    std::fprintf(stderr, "%s rank %d: %s\n", hook->name().c_str(), rank,
                 future->tryRetrieveErrorMessage().c_str());
    return {hook->name(), rank, INFINITY, tolerance, false};
  }
  at::Tensor result = hook->parseHookResult(future->value());

  // Per element: mean over ranks, and S = mean over ranks of |x|, which bounds every partial
  // sum / W. The error is measured in units of S.
  at::Tensor mean = at::zeros({kNumel}, at::kDouble);
  at::Tensor mean_abs = at::zeros({kNumel}, at::kDouble);
  for (int r = 0; r < kWorld; ++r) {
    const at::Tensor x = gradient_of(r).to(at::kDouble);
    mean += x / kWorld;
    mean_abs += x.abs() / kWorld;
  }
  const double err = ((result.to(at::kDouble) - mean).abs() / mean_abs).max().item<double>();
  // The hooks average in place: the bucket's buffer must hold the result too.
  const bool in_place = at::equal(buffer, result);
  return {hook->name(), rank, err, tolerance, err <= tolerance && in_place};
}

}  // namespace

int main() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<Outcome> outcomes;
  std::mutex mu;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      std::vector<Outcome> mine;
      try {
        auto pg = ddpx_example::make_gloo_group(store, rank, kWorld);
        // Tolerances in units of S: allreduce in fp32 rounds a few times at 2^-24 each;
        // fp16 compression rounds x / W to fp16 (2^-11 relative), sums in fp32 and stores:
        // (W + 2) roundings of at most 2^-11 * S bound it generously.
        mine.push_back(run_hook(ddpx::hooks::allreduce_hook(pg), rank, 1e-6));
        mine.push_back(run_hook(ddpx::hooks::fp16_compress_hook(pg), rank,
                                (kWorld + 2) * std::ldexp(1.0, -11)));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d failed: %s\n", rank, e.what());
        mine.push_back({"(setup)", rank, INFINITY, 0, false});
      }
      std::lock_guard<std::mutex> lock(mu);
      outcomes.insert(outcomes.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : ranks) t.join();

  bool all_ok = !outcomes.empty();
  std::printf("ddpx C++ example: %d Gloo ranks, %lld elements per bucket\n", kWorld,
              static_cast<long long>(kNumel));
  for (const auto& o : outcomes) {
    std::printf("  %-20s rank %d  max rel error %.3g (tolerance %.3g)  %s\n", o.hook.c_str(),
                o.rank, o.max_rel_error, o.tolerance, o.ok ? "ok" : "MISMATCH");
    all_ok = all_ok && o.ok;
  }
  std::printf("%s\n", all_ok ? "PASS" : "FAIL");
  return all_ok ? 0 : 1;
}
