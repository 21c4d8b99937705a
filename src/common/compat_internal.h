// The torch differences only the library and its tests need: DDP's Reducer (its constructor's
// forms), ProcessGroup's all-to-all under either name, the optimizer formulas a torch line
// changed, and the c10 warning and memory hooks the tests use. What a C++ training program may
// use is the public <ddpx/common/compat.h>, which this header extends; the version tests of both
// are DDPX_TORCH_VERSION_AT_LEAST, and no version #if appears outside these two files. Private:
// never installed (src/ is the ddpx_private target's include directory).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <ddpx/common/compat.h>

#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ddpx {
namespace compat {

namespace detail {
template <typename PG, typename = void>
struct HasAllToAllSingle : std::false_type {};
template <typename PG>
struct HasAllToAllSingle<PG, decltype((void)&PG::all_to_all_single)> : std::true_type {};
}  // namespace detail

// ProcessGroup's all-to-all of one flat tensor with split sizes: torch 2.15 named it
// all_to_all_single and deprecated alltoall_base, the only name before. Detected by shape.
template <typename PG>
c10::intrusive_ptr<c10d::Work> all_to_all_single(PG& pg, at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_split_sizes,
                                                 std::vector<int64_t>& input_split_sizes) {
  if constexpr (detail::HasAllToAllSingle<PG>::value) {
    return pg.all_to_all_single(output, input, output_split_sizes, input_split_sizes);
  } else {
    return pg.alltoall_base(output, input, output_split_sizes, input_split_sizes);
  }
}

// Whether Gloo reduces bfloat16 (allreduce in the values' own dtype): not in torch 1.13.
constexpr bool kGlooReducesBf16 = DDPX_TORCH_VERSION_AT_LEAST(2, 0);

// torch's major * 100 + minor (211 for 2.11): the elementwise optimizers' traits pick torch.optim's
// formulas of that release (ddpx/optim/elementwise/all.h).
constexpr int kTorchVersion = TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR;

// torch.optim.Adam/AdamW's single-tensor step (optim/functional.h follows it): 2.x updates
// exp_avg with lerp_(grad, 1 - beta1) and takes sqrt(1 - beta2**step) as `** 0.5` (pow); 1.13
// uses mul_(beta1).add_(grad, alpha=1 - beta1) and math.sqrt.
constexpr bool kAdamLerpsExpAvg = DDPX_TORCH_VERSION_AT_LEAST(2, 0);

// ---- DDP's Reducer ---------------------------------------------------------------------------

// What c10d::Reducer's constructor takes, by name (its positional list changed across releases).
struct ReducerArgs {
  // The fields are the constructor's arguments of the same names, with DDP's defaults; those
  // an older Reducer lacks must keep their defaults (make_reducer refuses them otherwise).
  std::vector<at::Tensor> params;
  std::vector<std::vector<size_t>> bucket_indices;
  // Size limit of each bucket of bucket_indices, as compute_bucket_assignment_by_size returns
  // (taken by torch 1.13's constructor only).
  std::vector<size_t> per_bucket_size_limits;
  ProcessGroupPtr process_group;
  std::vector<bool> expect_sparse_gradients;
  int64_t bucket_bytes_cap = 25 * 1024 * 1024;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  std::unordered_map<size_t, std::string> param_names;
  int64_t first_bucket_bytes_cap = 1024 * 1024;
  // Taken only where the installed torch's constructor has them (kReducerTakes* below);
  // make_reducer refuses a value other than the default elsewhere.
  // The limits the one bucket rebuild after the first iteration uses; empty (as Python DDP
  // passes without bucket_cap_mb_list): first_bucket_bytes_cap, then bucket_bytes_cap.
  std::vector<int64_t> bucket_bytes_cap_list;
  // Unused parameters' gradients are not all-reduced (with find_unused_parameters).
  bool skip_all_reduce_unused_params = false;
  // Gradients copied into their bucket by one batched copy per bucket.
  bool batched_grad_copy = false;
  // Bucket buffers allocated at the first backward instead of at construction.
  bool lazy_bucket_allocation = false;
};

namespace detail {
// Whether c10d::Reducer's constructor takes the arguments every 2.x form begins with, then
// `Extra...` (true also for a longer form whose further arguments have defaults).
template <typename... Extra>
constexpr bool kReducerTakes2x =
    std::is_constructible<c10d::Reducer, std::vector<at::Tensor>, std::vector<std::vector<size_t>>,
                          ProcessGroupPtr, std::vector<bool>, int64_t, bool, bool,
                          std::unordered_map<size_t, std::string>, int64_t, Extra...>::value;
}  // namespace detail

// The Reducer options of ReducerArgs the installed torch takes, detected by the constructor's
// shape (2.x appends arguments; seen: 2.11 ends at bucket_bytes_cap_list, 2.15 at
// lazy_bucket_allocation; 1.13 has none of them).
constexpr bool kReducerTakesSkipAllReduceUnusedParams = detail::kReducerTakes2x<bool, bool>;
constexpr bool kReducerTakesBucketBytesCapList =
    detail::kReducerTakes2x<bool, bool, std::vector<int64_t>>;
constexpr bool kReducerTakesBatchedGradCopy =
    detail::kReducerTakes2x<bool, bool, std::vector<int64_t>, bool>;
constexpr bool kReducerTakesLazyBucketAllocation =
    detail::kReducerTakes2x<bool, bool, std::vector<int64_t>, bool, bool>;

// A c10d::Reducer (DDP's C++ engine: autograd hooks, buckets, the comm hook) from `args`. An
// option the installed torch's constructor lacks raises ValueError naming it, unless left at
// its default. A template only so that the constructor forms this torch lacks are not compiled.
template <typename R = c10d::Reducer>
std::shared_ptr<R> make_reducer(ReducerArgs args) {
  auto refuse = [](bool taken, bool set, const char* name) {
    TORCH_CHECK_VALUE(taken || !set, name, " needs a torch whose DDP Reducer takes it; torch ",
                      TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, "'s does not");
  };
  refuse(kReducerTakesSkipAllReduceUnusedParams, args.skip_all_reduce_unused_params,
         "skip_all_reduce_unused_params");
  refuse(kReducerTakesBucketBytesCapList, !args.bucket_bytes_cap_list.empty(),
         "bucket_cap_mb_list");
  refuse(kReducerTakesBatchedGradCopy, args.batched_grad_copy, "batched_grad_copy");
  refuse(kReducerTakesLazyBucketAllocation, args.lazy_bucket_allocation, "lazy_bucket_allocation");
  // ddpx's own DDP runs the C++ Reducer, never torch.compile's Python reducer.
  constexpr bool kUsePythonReducer = false;
  auto make = [&](auto&&... extra) {
    return std::make_shared<R>(
        std::move(args.params), std::move(args.bucket_indices), std::move(args.process_group),
        std::move(args.expect_sparse_gradients), args.bucket_bytes_cap, args.find_unused_parameters,
        args.gradient_as_bucket_view, std::move(args.param_names), args.first_bucket_bytes_cap,
        std::forward<decltype(extra)>(extra)...);
  };
  if constexpr (kReducerTakesLazyBucketAllocation) {
    return make(args.skip_all_reduce_unused_params, kUsePythonReducer,
                std::move(args.bucket_bytes_cap_list), args.batched_grad_copy,
                args.lazy_bucket_allocation);
  } else if constexpr (kReducerTakesBatchedGradCopy) {
    return make(args.skip_all_reduce_unused_params, kUsePythonReducer,
                std::move(args.bucket_bytes_cap_list), args.batched_grad_copy);
  } else if constexpr (kReducerTakesBucketBytesCapList) {
    return make(args.skip_all_reduce_unused_params, kUsePythonReducer,
                std::move(args.bucket_bytes_cap_list));
  } else if constexpr (kReducerTakesSkipAllReduceUnusedParams) {
    return make(args.skip_all_reduce_unused_params, kUsePythonReducer);
  } else {
    // torch 1.13: per_bucket_size_limits after bucket_indices, nothing after
    // first_bucket_bytes_cap.
    return std::make_shared<R>(
        std::move(args.params), std::move(args.bucket_indices),
        std::move(args.per_bucket_size_limits), std::move(args.process_group),
        std::move(args.expect_sparse_gradients), args.bucket_bytes_cap, args.find_unused_parameters,
        args.gradient_as_bucket_view, std::move(args.param_names), args.first_bucket_bytes_cap);
  }
}

// ---- c10 hooks used by tests and tools -------------------------------------------------------

namespace detail {
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
namespace warning_utils = c10::WarningUtils;
#else
namespace warning_utils = c10::Warning;
#endif
}  // namespace detail

// Receives TORCH_WARN messages issued on the constructing thread while alive (c10's handler is
// thread-local; 2.x moved it from c10::Warning to c10::WarningUtils and changed process()'s
// arguments).
class ScopedWarningHandler : public c10::WarningHandler {
 public:
  // Installs this handler on the constructing thread until destruction; on_warning receives each
  // message's text.
  ScopedWarningHandler() : guard_(this) {}
  virtual void on_warning(const std::string& message) = 0;

#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override { on_warning(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    on_warning(msg);
  }
#endif

 private:
  detail::warning_utils::WarningHandlerGuard guard_;
};

// c10's memory-reporting hook with one signature: on_memory(bytes, device) per allocation
// (positive) and free (negative). 2.x changed the size arguments' types.
class MemoryReporter : public c10::MemoryReportingInfoBase {
 public:
  // `bytes` > 0 for an allocation, < 0 for a free, on `device`.
  virtual void on_memory(int64_t bytes, c10::Device device) = 0;
#if DDPX_TORCH_VERSION_AT_LEAST(2, 0)
  void reportMemoryUsage(void*, int64_t alloc_size, size_t, size_t, c10::Device device) override{
#else
  void reportMemoryUsage(void*, int64_t alloc_size, int64_t, int64_t, c10::Device device) override {
#endif
      on_memory(alloc_size, device);
}
};  // namespace compat

}  // namespace ddpx
}  // namespace ddpx
