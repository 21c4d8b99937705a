// The ranks' agreement on a hook and its options, checked before the hook's first collective
// (private to the hooks).
//
// Ranks that built a hook with different options (a PowerSGD rank or start step, quantized bits)
// or registered different hooks issue collectives of different sizes or kinds: a backend error
// about data sizes on one rank, or a hang until the group's timeout, with nothing naming the
// cause. So every ddpx hook, at its first bucket, all-gathers a fixed-size record of what it is
// and how it is configured (one small collective, once per hook and state epoch), and every rank
// raises the same c10::ValueError naming the first option that differs and its value on each
// rank. A state bumps its epoch where one rank's state may have changed alone (load_state_dict,
// set_iter, set_options, a new process group), and the next bucket checks again: those calls are
// made on every rank, so every rank checks at the same bucket.
#pragma once

#include <ATen/core/Tensor.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ddpx {
namespace hooks {
namespace detail {

// What a hook is and how it is configured, as the ranks compare it: the hook's name and its
// options in a fixed order, each an int64 (a double by its bits, a choice by its index).
class Fingerprint {
 public:
  explicit Fingerprint(std::string hook);
  Fingerprint& add(const char* name, int64_t value);
  Fingerprint& add(const char* name, bool value);
  Fingerprint& add(const char* name, double value);
  // One of `names` (by index); shown by name.
  Fingerprint& add_choice(const char* name, int64_t index, std::vector<std::string> names);

  const std::string& hook() const { return hook_; }
  // The record every rank sends: kRecordSlots int64 values.
  std::vector<int64_t> record() const;
  // The first difference between two ranks' records (ra's and rb's, different), as "bits is 8
  // on rank 0 and 4 on rank 1", or the two hooks' names; options are named where this
  // fingerprint is of the same hook as theirs.
  std::string describe(const int64_t* a, int64_t ra, const int64_t* b, int64_t rb) const;

  // Options a record holds at most (more is an internal error).
  static constexpr size_t kMaxOptions = 24;
  static constexpr size_t kRecordSlots = 12 + kMaxOptions;

 private:
  enum class Kind { kInt, kBool, kDouble, kChoice };
  struct Option {
    std::string name;
    Kind kind;
    int64_t value;
    std::vector<std::string> names;  // kChoice
  };
  std::string show(const Option& o, int64_t value) const;

  std::string hook_;
  std::vector<Option> options_;
};

// The names of comm::ExchangeMode's values, by value (for add_choice).
std::vector<std::string> exchange_mode_names();

// All-gathers `mine` over `pg` (on `device`, whose backend must take its tensors) and throws
// c10::ValueError, on every rank alike, when any rank's record differs from rank 0's: the hooks
// by name, or the first option by name and both values. Blocks until the all-gather is done.
void check_agreement(const ProcessGroupPtr& pg, const Fingerprint& mine, const c10::Device& device);

// Runs check_agreement (on make()'s fingerprint) unless `agreed` already holds `epoch`, the
// epoch of the hook's state (stateless hooks: 0, so once), and records it. `agreed` is the
// hook's (CommHook::agreed_epoch_). Not thread-safe: called from runHook only.
template <typename MakeFingerprint>
void agree_once(std::optional<uint64_t>& agreed, const ProcessGroupPtr& pg,
                const c10::Device& device, uint64_t epoch, MakeFingerprint&& make) {
  if (agreed == epoch) return;
  check_agreement(pg, make(), device);
  agreed = epoch;
}

// While alive, the fingerprints made on this thread name the hook as wrapped by `wrapper`
// ("fp16_compress_wrapper(powerSGD_hook)"): a wrapper changes what its hook exchanges, so ranks
// with and without it disagree.
class WrappedBy {
 public:
  explicit WrappedBy(const std::string& wrapper);
  ~WrappedBy();
  WrappedBy(const WrappedBy&) = delete;
  WrappedBy& operator=(const WrappedBy&) = delete;

 private:
  std::string outer_;
};

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
