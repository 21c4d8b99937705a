// reduce_scatter_hook: ZeRO-2 style gradient sharding for ZeroRedundancyOptimizer. Each bucket's
// gradients go to the ranks that own them under ZeRO's partition (optim::ZeroLayout), instead of
// being all-reduced to every rank: a rank sends about (W - 1) / W of the bucket once, where an
// all-reduce sends twice that. After the hook, the bucket holds the mean on the values this rank
// owns and zeros elsewhere (the optimizer steps only what it owns).
//
// The values travel as they are (bits = 32) or quantized as quantized_hook's blocks (8, 4, 2 or
// 1 bits per value, a scale per block_size values) with error feedback per rank; the owner adds
// its own values exactly and the peers' decoded ones, each scaled by 1/W, in rank order
// (comm/sharded_exchange.h's scatter round). One all-to-all per bucket, issued from runHook.
#pragma once

#include <ATen/core/Dict.h>
#include <ddpx/hooks/comm_hook.h>

#include <cstdint>
#include <map>
#include <memory>

namespace ddpx {
namespace optim {
class ZeroLayout;
}

namespace hooks {

struct ReduceScatterOptions {
  // 32: the values themselves, in the bucket's dtype; 8, 4, 2 or 1: quantized blocks.
  int64_t bits = 32;
  // Values per scale of the quantized blocks; a multiple of 8 in [8, 2^20].
  int64_t block_size = 256;
  // Quantized: keep each rank's quantization error and add it to the next step's values.
  bool use_error_feedback = true;
  // Throws c10::ValueError naming the bad option.
  void validate() const;
};

namespace detail {
class ReduceScatterMemory;
}

// The hook's state: ZeRO's partition, the group, the options, the error-feedback residuals (per
// parameter of the partition, so they survive DDP's bucket rebuild and a checkpoint) and what was
// sent. One state serves one ZeroRedundancyOptimizer and one DDP model. Thread-safety: runs on
// DDP's autograd thread; the setters and checkpoint methods are for between steps.
class ReduceScatterState {
 public:
  // `layout`: the partition of the optimizer's parameters between the ranks of `process_group`
  // (its world size and rank must be the group's). Neither may be null (c10::TypeError).
  ReduceScatterState(ProcessGroupPtr process_group, std::shared_ptr<const optim::ZeroLayout> layout,
                     ReduceScatterOptions options = {});
  ~ReduceScatterState();

  // The group the buckets are exchanged over.
  const ProcessGroupPtr& process_group() const { return pg_; }
  // ZeRO's partition: who owns which piece of each parameter.
  const optim::ZeroLayout& layout() const { return *layout_; }
  // The options in force.
  const ReduceScatterOptions& options() const { return options_; }
  // Replaces the options (validated); residuals of another format restart from zero.
  void set_options(const ReduceScatterOptions& options);
  // Counts the changes every rank must make alike (set_options, load_state_dict): the hook checks
  // again that the ranks agree.
  uint64_t epoch() const { return epoch_; }

  // Elements and bytes this rank has sent to other ranks so far.
  int64_t sent_elements() const;
  int64_t sent_bytes() const;
  // Bucket layouts built so far (their ownership tables): one per bucket and per DDP bucketing
  // or options, not per step.
  int64_t layouts_built() const;

  // {"format", the options, "rank", "world_size", "residuals": {parameter index: CPU fp32
  // tensor of the parameter's size}} (zeros where this rank owns the values); no residuals
  // without quantization or error feedback.
  c10::impl::GenericDict state_dict() const;
  // Restores state_dict()'s content. Residuals are one rank's own: saved by another rank or in a
  // group of another size, a c10::ValueError unless `allow_reshard`.
  void load_state_dict(const c10::impl::GenericDict& state, bool allow_reshard = false);
  // The residuals per parameter index (copies), as state_dict() saves them.
  std::map<int64_t, at::Tensor> residuals() const;

  // --- used by the hook ---
  detail::ReduceScatterMemory& memory() { return *memory_; }

 private:
  ProcessGroupPtr pg_;
  std::shared_ptr<const optim::ZeroLayout> layout_;
  ReduceScatterOptions options_;
  uint64_t epoch_ = 0;
  std::unique_ptr<detail::ReduceScatterMemory> memory_;
};

// The hook. Its collective (one all-to-all per bucket) is issued from runHook, in bucket order;
// the future completes once the bucket holds this rank's means and zeros elsewhere.
class ReduceScatterHook final : public CommHook {
 public:
  // `state` must not be null (c10::TypeError).
  explicit ReduceScatterHook(std::shared_ptr<ReduceScatterState> state);
  std::string name() const override { return "reduce_scatter_hook"; }
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  const std::shared_ptr<ReduceScatterState>& state() const { return state_; }

 private:
  std::shared_ptr<ReduceScatterState> state_;
};

// Factory, as the other hooks': the hook over `state`.
CommHookPtr reduce_scatter_hook(std::shared_ptr<ReduceScatterState> state);

}  // namespace hooks
}  // namespace ddpx
