// quantized_hook and its state: gradients quantized to 8, 4, 2 or 1 bits per value in blocks,
// with two-level error feedback, exchanged reduce-scatter style so that the bytes per rank
// shrink with the world size.
//
// Per bucket of n values on W ranks, from iteration start_iter on:
//   1. every block has an owner rank; every rank adds its residual to the blocks that others
//      own, quantizes them block by block (one fp32 scale per `block_size` values) and keeps the
//      quantization error as its new residual;
//   2. one all-to-all sends chunk j of the blocks to rank j (the chunk's *owner*);
//   3. the owner sums the W - 1 dequantized pieces of its chunk and its own values, which cross
//      no wire and so enter exactly, in fp32 in rank order, divides by W, adds its own second
//      residual and quantizes the mean again, keeping that error (two-level error feedback, as
//      DeepSpeed's compressed allreduce);
//   4. one all-to-all sends every owner's quantized mean to every rank, which dequantizes them
//      into the bucket: every rank gets the same bits.
// Each rank puts about 2 (W - 1) / W * n * bits / 8 bytes on the wire, plus 4 bytes of scale per
// block. Before start_iter the hook averages with a plain allreduce (allreduce_hook's result).
// Step 4 of a bucket is issued from the next runHook (comm::DeferredCollective), so every rank
// issues the collectives in one order whatever the timing.
//
// The all-gather exchange (QuantizedOptions::exchange; the default on 2 ranks): every rank adds
// its residual to its whole bucket, quantizes it into one message, sends that to every other
// rank (one all-to-all), and sums all W dequantized messages in fp32 in rank order: one round,
// one level of quantization error and of error feedback, (W - 1) * n * bits / 8 bytes per rank.
// On 2 ranks that is the reduce-scatter's count, in one round instead of two and with one
// quantization of each value instead of two.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ddpx/comm/exchange_mode.h>
#include <ddpx/hooks/comm_hook.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace ddpx {
namespace hooks {

// QuantizedOptions::rotation.
enum class QuantRotation { kAuto = 0, kHadamard = 1, kNone = 2 };

struct QuantizedOptions {
  // Bits per value: 8, 4, 2 (symmetric integers: 255, 15, 3 levels) or 1 (signs with a scale of
  // mean |v| per block). 2 bits without error feedback or stochastic rounding scale each block
  // by the mean of its magnitudes above its mean magnitude instead of max|v| (more values sent
  // nonzero; values above 1.5 scale are clipped).
  int64_t bits = 8;
  // Values per scale; block_size * bits must be a multiple of 8.
  int64_t block_size = 256;
  // Keep each level's quantization error and add it to the next step's values. Without it the
  // error is dropped every step (the plain 1- and 2-bit codes are biased; see rotation).
  bool use_error_feedback = true;
  // Iterations averaged with a plain allreduce before quantization starts.
  int64_t start_iter = 10;
  // Seed of the stochastic rounding's counter-based generator and of the rotation's signs.
  int64_t random_seed = 0;
  // Round stochastically (unbiased) instead of to nearest.
  bool stochastic_rounding = false;
  // How buckets travel: kReduceScatter (the two rounds above), kAllgather (one round, every rank
  // sums every message), or kAuto: kAllgather on 2 ranks, where both send the same bytes,
  // kReduceScatter on more. kAllreduce is refused (a backend cannot sum quantized blocks).
  comm::ExchangeMode exchange = comm::ExchangeMode::kAuto;
  // A random rotation of every whole block before it is quantized (kHadamard): the block's
  // values times random signs, then through a Hadamard transform, which spreads every block's
  // energy evenly over its values whatever their shape (one large value, a sparse block); the
  // receiver rotates back. At 1 bit without error feedback the scale is then the unbiased one
  // (sum y^2 / sum |y|, DRIVE's): each step's error has mean zero instead of a bias that
  // accumulates. The wire format is unchanged; block_size must be a power of two in [8, 8192]; a
  // parameter's short last block is sent unrotated. kAuto: kHadamard without error feedback
  // (where nothing else carries the error over) when block_size allows it, kNone otherwise.
  QuantRotation rotation = QuantRotation::kAuto;
};

// "auto", "allgather" or "reduce_scatter" to the mode; c10::ValueError for anything else.
comm::ExchangeMode parse_quantized_exchange(const std::string& name);
// "auto", "hadamard" or "none" to the rotation, and back; c10::ValueError for anything else.
QuantRotation parse_quantized_rotation(const std::string& name);
const char* quantized_rotation_name(QuantRotation rotation);
// Whether options `o` rotate (kAuto resolved).
bool rotates(const QuantizedOptions& o);

// Throws c10::ValueError naming the bad option.
void validate(const QuantizedOptions& options);

namespace detail {
// The residuals per bucket and per parameter (private).
class QuantizedMemory;
}  // namespace detail

// State of quantized_hook. One state serves one DDP model.
//
// Residuals are kept per parameter (keyed by first appearance, as PowerSGDState's memories), so
// they survive DDP's bucket rebuild and a checkpoint restored into a new process: a bucket whose
// layout changed takes each parameter's rank-level residual whole, and the owner-level residual
// of the values this rank owns under both layouts; the owner-level residual of a block it no
// longer owns goes to its rank level (times the world size), and by reduce-scatter the
// rank-level residual of a block it now owns goes to its owner level (divided by the world
// size), so that a change of exchange or world size loses no residual. A resumed job continues
// bit for bit when DDP builds the buckets the checkpoint was taken with (the same model,
// bucket_cap_mb and world size).
//
// A block whose gradient is all zeros keeps its residuals for a later step and sends zeros: DDP
// discards what a hook returns for a parameter that no rank used (find_unused_parameters), so a
// residual sent with it would be lost.
//
// Thread-safety: runs on DDP's autograd thread; the setters, state_dict(), load_state_dict() and
// clear_memories() refuse to run during backward.
class QuantizedState {
 public:
  // `process_group` must not be null. Throws c10::ValueError for bad options.
  QuantizedState(ProcessGroupPtr process_group, QuantizedOptions options = {});
  ~QuantizedState();

  // The group the hook averages over; a new group (not null) takes effect at the next bucket,
  // whose residuals are then recut for the new world size. Not during backward (c10::Error).
  const ProcessGroupPtr& process_group() const { return pg_; }
  void set_process_group(ProcessGroupPtr pg);
  // The options in force.
  const QuantizedOptions& options() const { return options_; }
  // Replaces the options (validated); the residuals are kept. Not during backward (c10::Error).
  void set_options(const QuantizedOptions& options);

  // Iterations counted so far (the warm-up ends when it reaches start_iter); iter >= 0. Not set
  // during backward (c10::Error).
  int64_t iter() const { return iter_; }
  void set_iter(int64_t iter);
  // Counts the changes that every rank must make alike (set_process_group, set_options,
  // set_iter, load_state_dict): the hook checks again, at its next bucket, that the ranks agree
  // on the options and the iteration (a c10::ValueError naming the option and both values on
  // every rank where they do not).
  uint64_t epoch() const { return epoch_; }
  // (bytes before / bytes after, bytes before, bytes after) over the buckets compressed so far:
  // their values, and their blocks quantized (scales and codes), as PowerSGDState's statistics
  // compare a tensor with its factors. (0, 0, 0) before the first compressed bucket.
  std::tuple<double, int64_t, int64_t> compression_stats() const;
  // Counts one iteration on the last bucket of a backward pass.
  void maybe_increase_iter(bool bucket_is_last);

  // {"format", the options ("exchange" by name), "iter", "rank", "world_size", "worker_residuals",
  // "server_residuals"}: the residuals per parameter key as CPU fp32 tensors (the owner-level
  // ones zero outside the values this rank owns). No process group.
  c10::impl::GenericDict state_dict() const;
  // Restores state_dict()'s content (keys and types checked, c10::TypeError / c10::ValueError
  // naming the key). Residuals are one rank's own: a checkpoint saved by another rank or in a
  // group of another size is a c10::ValueError unless `allow_reshard`.
  void load_state_dict(const c10::impl::GenericDict& state, bool allow_reshard = false);

  // The residuals per parameter key, as state_dict() saves them (copies). By all-gather there is
  // no owner level: the server residuals are zeros (a reduce-scatter layout's are moved to the
  // worker level when the layout changes, times the world size), and the worker residuals cover
  // every value, this rank's own blocks included.
  std::map<int64_t, at::Tensor> worker_residuals() const;
  std::map<int64_t, at::Tensor> server_residuals() const;
  // Forgets every residual: the next step starts from zero, as the first quantized step does.
  void clear_memories();

  // --- used by the hook ---
  detail::QuantizedMemory& memory() { return *memory_; }

 private:
  void check_not_in_backward(const char* what) const;

  ProcessGroupPtr pg_;
  QuantizedOptions options_;
  int64_t iter_ = 0;
  uint64_t epoch_ = 0;
  std::unique_ptr<detail::QuantizedMemory> memory_;
};

// A state shared by the hook and the program that checkpoints it.
using QuantizedStatePtr = std::shared_ptr<QuantizedState>;

// The hook. Collectives are issued from runHook (DDP's autograd thread) in bucket order; a
// bucket's second collective from the next runHook (or at once for the last bucket).
class QuantizedHook final : public CommHook {
 public:
  // `state` must not be null (c10::TypeError).
  explicit QuantizedHook(QuantizedStatePtr state);
  std::string name() const override { return "quantized_hook"; }
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  // The state this hook reads and updates.
  const QuantizedStatePtr& state() const { return state_; }

 private:
  QuantizedStatePtr state_;
};

// Factory, as the other hooks': the hook over `state`.
CommHookPtr quantized_hook(QuantizedStatePtr state);

}  // namespace hooks
}  // namespace ddpx
