// PowerSGDState: hyperparameters and memories of the PowerSGD hooks (torch's PowerSGDState).
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <tuple>
#include <vector>

namespace ddpx {
namespace hooks {

// The arguments of torch's PowerSGDState, with the same defaults.
struct PowerSGDOptions {
  // Rank r of the P (n x r) and Q (m x r) factors; the lower, the stronger the compression.
  int64_t matrix_approximation_rank = 1;
  // Plain allreduce (no compression) until this iteration.
  int64_t start_powerSGD_iter = 1000;
  // A matrix is compressed only if (rows + cols) * rank * min_compression_rate < rows * cols.
  double min_compression_rate = 2;
  // Add the previous step's compression residual to the gradient before compressing.
  bool use_error_feedback = true;
  // Reuse Q from the previous step instead of drawing it afresh.
  bool warm_start = true;
  // Added to column norms during orthogonalisation (avoids division by zero).
  double orthogonalization_epsilon = 0;
  // Seed of the generator that seeds the random Q initialisation (numpy RandomState semantics).
  int64_t random_seed = 0;
  // Log compression statistics every this many iterations once compression runs (min 1).
  int64_t compression_stats_logging_frequency = 10000;
  // Compress same-shaped matrices of a bucket with one batched product.
  bool batch_tensors_with_same_shape = false;

  // Throws c10::Error (ValueError in Python) naming the bad argument.
  void validate() const;
};

// numpy.random.RandomState(seed).randint(1_000_000_000), reproduced exactly (MT19937 with
// init_genrand seeding and masked rejection), so ddpx draws the same Q seeds as torch's hook.
class NumpyRandint {
 public:
  // Seeded as RandomState(seed); randint_1e9() draws the next value, serialize() /
  // deserialize() save and restore the generator's whole state as text.
  explicit NumpyRandint(uint32_t seed = 0) : engine_(seed) {}
  int64_t randint_1e9();
  std::string serialize() const;
  void deserialize(const std::string& text);

 private:
  std::mt19937 engine_;
};

namespace detail {
// The hooks' working memory (bucket layouts, memories, the deferred round two): private.
class PowerSGDMemory;
}  // namespace detail

// State shared by powerSGD_hook / batched_powerSGD_hook and their runs. One state serves one DDP
// model: using it with the parameters of a second model is an error.
//
// Memories (error feedback residuals and warm-start Q factors) are keyed per *parameter*, by the
// order in which parameters first reach the hook (DDP's initial bucket order, the same in every
// process that builds the same model), not by bucket index. A state restored from a checkpoint
// into a new process and a new DDP model therefore finds each parameter's memory although DDP's
// first buckets after a restart differ from the rebuilt buckets the checkpoint was taken with.
// The batched hook's Q factor spans a whole bucket and is keyed by the bucket's parameter set.
//
// Thread-safety: runs on DDP's autograd thread and on communication callbacks that touch only
// the bucket in flight; do not call state_dict()/load_state_dict() during backward.
class PowerSGDState {
 public:
  // `logger` receives the info lines (see set_logger); null means c10's LOG(INFO).
  PowerSGDState(ProcessGroupPtr process_group, PowerSGDOptions options = {},
                std::function<void(const std::string&)> logger = nullptr);
  ~PowerSGDState();

  // The options in force.
  const PowerSGDOptions& options() const { return options_; }
  // Replaces the options (validated); the memories are kept.
  void set_options(const PowerSGDOptions& options);

  // The group the hooks exchange over.
  const ProcessGroupPtr& process_group() const { return pg_; }
  void set_process_group(ProcessGroupPtr pg);
  // Counts the changes that every rank must make alike (set_options, set_process_group,
  // set_iter, load_state_dict): the hooks check again, at their next bucket, that the ranks
  // agree on the options and the iteration (c10::ValueError naming the option otherwise).
  uint64_t epoch() const { return epoch_; }

  // Iterations counted so far (settable to resume), the elements before and after compression
  // since compression started, and the iteration of the next statistics log line, as torch's.
  int64_t iter() const { return iter_; }
  void set_iter(int64_t iter);
  int64_t total_numel_before_compression() const { return total_before_; }
  int64_t total_numel_after_compression() const { return total_after_; }
  int64_t next_stats_report() const { return next_stats_report_; }

  // (compress_rate, numel_before_compression, numel_after_compression), as torch.
  std::tuple<double, int64_t, int64_t> compression_stats() const;

  // Counts one iteration on the last bucket of a step (torch's maybe_increase_iter).
  void maybe_increase_iter(bool bucket_is_last);

  // Where the info lines go ("PowerSGD config", "Start to apply PowerSGD", compression stats).
  // Default: c10's LOG(INFO). Python routes them to the logging module.
  void set_logger(std::function<void(const std::string&)> logger);
  void log(const std::string& line) const;

  // Checkpoint: iteration, statistics, generator, per-parameter memories, and the rank and world
  // size of this state's process group, whose error-feedback memories they are (no process group).
  c10::impl::GenericDict state_dict() const;
  // Restores state_dict()'s content (keys and value types checked: c10::TypeError naming the
  // key). Memories reach their parameters when the buckets first run. `strict`: an error memory
  // whose size is not its parameter's (a corrupt checkpoint, or one saved for other shapes)
  // raises c10::ValueError at that parameter's first step, naming it and both sizes; with strict
  // false it is dropped (error feedback restarts from zero for that parameter). Q memories of
  // another size are always dropped: a changed rank legitimately changes them. Error-feedback
  // memories are one rank's own: a checkpoint whose error memories were saved by another rank,
  // or in a group of another size, is a c10::ValueError saying to load each rank's own file,
  // unless `allow_reshard` (a deliberate reshard). A checkpoint that records no rank (saved by
  // an older ddpx) is taken as it is.
  void load_state_dict(const c10::impl::GenericDict& state, bool strict = true,
                       bool allow_reshard = false);
  // Same content through torch's pickler, for C++ programs (torch::pickle_save format).
  std::vector<char> save() const;
  void load(const std::vector<char>& bytes);

  // Error-feedback residuals and warm-start Q factors per parameter key (order of first
  // appearance): the live tensors (views into the hooks' buffers: read them, do not keep them
  // across a step), plus memories restored from a checkpoint and not yet claimed by a bucket.
  std::map<int64_t, at::Tensor> error_memories() const;
  std::map<int64_t, at::Tensor> q_memories() const;
  // The P factor of each compressed parameter after its last step (layer-wise hook), keyed like
  // the memories: torch's p_memory_dict, per parameter. Views, like error_memories().
  std::map<int64_t, at::Tensor> p_memories() const;
  // Whether a bucket's round two waits for the next runHook (true only during backward).
  bool round_two_pending() const;

  // Forgets the error-feedback residuals and the warm-start Q factors, live and restored: the
  // next step starts them as the first compressed step does (zero residuals, fresh Qs). The way out
  // after a step with NaN/Inf gradients: like torch's hook, PowerSGD keeps a non-finite value in
  // its memories, so every later step would carry it; call this (between steps, not during
  // backward) to start them afresh.
  void clear_memories();

  // Where the hooks draw the seed of each fresh Q: by default the built-in numpy-compatible
  // generator (rng(), saved by state_dict()); a set source replaces it (Python: a draw from the
  // state's numpy RandomState, `state.rng.randint(1_000_000_000)` as torch's hook does; the
  // Python side then saves that generator itself). Null restores the built-in generator.
  void set_seed_source(std::function<int64_t()> source);

  // --- used by the hooks ---
  NumpyRandint& rng() { return rng_; }
  // One Q seed, from the seed source if one is set, else from rng().
  int64_t draw_seed();
  void add_compression_stats(int64_t before, int64_t after);
  void maybe_report_stats(bool bucket_is_last);
  // Parameter keys of a bucket, assigning new keys in first-appearance order; errors if the
  // state already saw a whole iteration of another model.
  std::vector<int64_t> keys_for(const c10d::GradBucket& bucket, const std::string& hook_name);
  detail::PowerSGDMemory& memory() { return *memory_; }
  const detail::PowerSGDMemory& memory() const { return *memory_; }

 private:
  ProcessGroupPtr pg_;
  PowerSGDOptions options_;
  NumpyRandint rng_;
  std::function<int64_t()> seed_source_;
  int64_t iter_ = 0;
  uint64_t epoch_ = 0;
  // Whether a bucket of the current compressed step was compressed; the warning given once
  // when a whole step compressed nothing.
  bool compressed_this_step_ = false;
  bool warned_nothing_compressed_ = false;
  int64_t total_before_ = 0;
  int64_t total_after_ = 0;
  int64_t next_stats_report_ = 0;
  std::function<void(const std::string&)> logger_;
  std::unique_ptr<detail::PowerSGDMemory> memory_;
};

// How the hooks and Python share one state.
using PowerSGDStatePtr = std::shared_ptr<PowerSGDState>;

}  // namespace hooks
}  // namespace ddpx
