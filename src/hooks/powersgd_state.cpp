#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <ddpx/hooks/powersgd_state.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <sstream>
#include <type_traits>

#include "hooks/checkpoint_reader.h"
#include "hooks/powersgd_memory.h"

namespace ddpx {
namespace hooks {

void PowerSGDOptions::validate() const {
  TORCH_CHECK_VALUE(matrix_approximation_rank >= 1, "matrix_approximation_rank must be >= 1, got ",
                    matrix_approximation_rank);
  TORCH_CHECK_VALUE(min_compression_rate >= 0, "min_compression_rate must be >= 0, got ",
                    min_compression_rate);
  TORCH_CHECK_VALUE(orthogonalization_epsilon >= 0, "orthogonalization_epsilon must be >= 0, got ",
                    orthogonalization_epsilon);
  TORCH_CHECK_VALUE(random_seed >= 0 && random_seed <= 0xFFFFFFFFll,
                    "random_seed must be between 0 and 2**32 - 1, got ", random_seed);
  // Same condition and text as torch.
  TORCH_CHECK_VALUE(!((use_error_feedback || warm_start) && start_powerSGD_iter <= 1),
                    "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
                    "enabled, because PowerSGD can only be applied after the first two iterations "
                    "in DDP.");
}

int64_t NumpyRandint::randint_1e9() {
  // numpy's legacy bounded draw for range 999999999: 32-bit draws masked to 2^30 - 1, rejected
  // until <= the range.
  constexpr uint32_t kRange = 999999999u, kMask = (1u << 30) - 1;
  uint32_t v;
  do {
    v = static_cast<uint32_t>(engine_()) & kMask;
  } while (v > kRange);
  return v;
}

std::string NumpyRandint::serialize() const {
  std::ostringstream os;
  os << engine_;
  return os.str();
}

void NumpyRandint::deserialize(const std::string& text) {
  std::istringstream is(text);
  std::mt19937 engine;
  is >> engine;
  TORCH_CHECK(!is.fail(), "PowerSGDState: corrupt generator state in checkpoint");
  engine_ = engine;
}

namespace {
// Booleans as torch's log line prints them.
const char* py_bool(bool b) { return b ? "True" : "False"; }
}  // namespace

PowerSGDState::PowerSGDState(ProcessGroupPtr process_group, PowerSGDOptions options,
                             std::function<void(const std::string&)> logger)
    : pg_(std::move(process_group)),
      options_(options),
      rng_(static_cast<uint32_t>(options.random_seed)),
      logger_(std::move(logger)),
      memory_(std::make_unique<detail::PowerSGDMemory>()) {
  TORCH_CHECK_TYPE(pg_, "PowerSGDState: process_group must be a ProcessGroup");
  options_.validate();
  options_.compression_stats_logging_frequency =
      std::max<int64_t>(1, options_.compression_stats_logging_frequency);
  std::ostringstream os;
  os << "PowerSGD config: matrix_approximation_rank = " << options_.matrix_approximation_rank
     << "; start_powerSGD_iter = " << options_.start_powerSGD_iter
     << "; min_compression_rate = " << options_.min_compression_rate
     << "; orthogonalization_epsilon = " << options_.orthogonalization_epsilon
     << "; use_error_feedback = " << py_bool(options_.use_error_feedback)
     << "; warm_start = " << py_bool(options_.warm_start)
     << "; random_seed = " << options_.random_seed
     << "; compression_stats_logging_frequency = " << options_.compression_stats_logging_frequency
     << "; batch_tensors_with_same_shape = " << py_bool(options_.batch_tensors_with_same_shape);
  log(os.str());
}

PowerSGDState::~PowerSGDState() = default;

void PowerSGDState::set_options(const PowerSGDOptions& options) {
  options.validate();
  options_ = options;
  options_.compression_stats_logging_frequency =
      std::max<int64_t>(1, options_.compression_stats_logging_frequency);
  ++epoch_;
}

void PowerSGDState::set_process_group(ProcessGroupPtr pg) {
  TORCH_CHECK_TYPE(pg, "PowerSGDState: process_group must be a ProcessGroup");
  pg_ = std::move(pg);
  ++epoch_;
}

void PowerSGDState::set_iter(int64_t iter) {
  iter_ = iter;
  ++epoch_;
}

std::tuple<double, int64_t, int64_t> PowerSGDState::compression_stats() const {
  const double rate =
      total_after_ > 0 ? static_cast<double>(total_before_) / static_cast<double>(total_after_) : 0;
  return std::make_tuple(rate, total_before_, total_after_);
}

void PowerSGDState::maybe_increase_iter(bool bucket_is_last) {
  if (bucket_is_last) {
    ++iter_;
    memory_->keys.end_of_iteration();
  }
  // As torch: logged on every call that leaves iter at start_powerSGD_iter, so once for the
  // last bucket of the step that reaches it and once for each other bucket of the next step.
  if (iter_ == options_.start_powerSGD_iter) {
    log("Start to apply PowerSGD after " + std::to_string(iter_) + " iterations.");
  }
}

void PowerSGDState::set_seed_source(std::function<int64_t()> source) {
  seed_source_ = std::move(source);
}

int64_t PowerSGDState::draw_seed() { return seed_source_ ? seed_source_() : rng_.randint_1e9(); }

void PowerSGDState::set_logger(std::function<void(const std::string&)> logger) {
  logger_ = std::move(logger);
}

void PowerSGDState::log(const std::string& line) const {
  if (logger_) {
    logger_(line);
  } else {
    LOG(INFO) << line;
  }
}

void PowerSGDState::add_compression_stats(int64_t before, int64_t after) {
  total_before_ += before;
  total_after_ += after;
  compressed_this_step_ = compressed_this_step_ || after < before;
}

void PowerSGDState::maybe_report_stats(bool bucket_is_last) {
  if (bucket_is_last) {
    // A whole compressed step that compressed nothing: every gradient is a vector or a matrix
    // too small for its rank, so the hook costs PowerSGD's work and saves no byte. Said once.
    if (!compressed_this_step_ && !warned_nothing_compressed_) {
      warned_nothing_compressed_ = true;
      TORCH_WARN("powerSGD_hook: no gradient of step ", iter_,
                 " was compressed (every one is 1-D, or its factors at matrix_approximation_rank=",
                 options_.matrix_approximation_rank,
                 " are not min_compression_rate=", options_.min_compression_rate,
                 " times smaller than it), so every value is sent as by allreduce_hook; lower "
                 "matrix_approximation_rank or min_compression_rate, or use allreduce_hook");
    }
    compressed_this_step_ = false;
  }
  if (!bucket_is_last || iter_ < next_stats_report_) return;
  auto stats = compression_stats();
  std::ostringstream os;
  os << "Compression stats: iter " << iter_ << ", total before compression " << std::get<1>(stats)
     << ", total after compression " << std::get<2>(stats) << ", rate " << std::get<0>(stats);
  log(os.str());
  next_stats_report_ = iter_ + options_.compression_stats_logging_frequency;
}

std::vector<int64_t> PowerSGDState::keys_for(const c10d::GradBucket& bucket,
                                             const std::string& hook_name) {
  return memory_->keys.keys_for(bucket, hook_name, "PowerSGDState");
}

namespace {
template <typename Key>
c10::TypePtr key_type();
template <>
c10::TypePtr key_type<int64_t>() {
  return c10::IntType::get();
}
template <>
c10::TypePtr key_type<std::string>() {
  return c10::StringType::get();
}

// Live memories (as CPU copies) over the restored ones not yet claimed: what a checkpoint holds.
template <typename Key>
c10::impl::GenericDict tensor_dict(const std::unordered_map<Key, at::Tensor>& live,
                                   const std::unordered_map<Key, at::Tensor>& restored) {
  c10::impl::GenericDict d(key_type<Key>(), c10::TensorType::get());
  for (const auto& kv : restored) d.insert(kv.first, kv.second);
  for (const auto& kv : live) d.insert_or_assign(kv.first, kv.second.detach().clone().cpu());
  return d;
}

// Live memories over the restored ones, as the bindings and tests read them.
std::map<int64_t, at::Tensor> merged(const std::unordered_map<int64_t, at::Tensor>& live,
                                     const std::unordered_map<int64_t, at::Tensor>& restored) {
  std::map<int64_t, at::Tensor> out(live.begin(), live.end());
  for (const auto& kv : restored) out.emplace(kv.first, kv.second);
  return out;
}
}  // namespace

std::map<int64_t, at::Tensor> PowerSGDState::error_memories() const {
  return merged(memory_->error, memory_->restored_error);
}

std::map<int64_t, at::Tensor> PowerSGDState::p_memories() const {
  return std::map<int64_t, at::Tensor>(memory_->p.begin(), memory_->p.end());
}

std::map<int64_t, at::Tensor> PowerSGDState::q_memories() const {
  return merged(memory_->q, memory_->restored_q);
}

bool PowerSGDState::round_two_pending() const { return memory_->round_two.pending(); }

void PowerSGDState::clear_memories() {
  TORCH_CHECK(!round_two_pending(), "PowerSGDState.clear_memories(): called during backward");
  memory_->clear_memories();
}

c10::impl::GenericDict PowerSGDState::state_dict() const {
  TORCH_CHECK(!round_two_pending(), "PowerSGDState.state_dict(): called during backward");
  const detail::PowerSGDMemory& mem = *memory_;
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("format", std::string("ddpx.PowerSGDState/1"));
  d.insert("iter", iter_);
  d.insert("total_numel_before_compression", total_before_);
  d.insert("total_numel_after_compression", total_after_);
  d.insert("next_stats_report", next_stats_report_);
  d.insert("rng", rng_.serialize());
  d.insert("matrix_approximation_rank", options_.matrix_approximation_rank);
  d.insert("start_powerSGD_iter", options_.start_powerSGD_iter);
  d.insert("min_compression_rate", options_.min_compression_rate);
  d.insert("use_error_feedback", options_.use_error_feedback);
  d.insert("warm_start", options_.warm_start);
  d.insert("orthogonalization_epsilon", options_.orthogonalization_epsilon);
  d.insert("random_seed", options_.random_seed);
  d.insert("compression_stats_logging_frequency", options_.compression_stats_logging_frequency);
  d.insert("batch_tensors_with_same_shape", options_.batch_tensors_with_same_shape);
  // Whose error feedback this is: load_state_dict refuses it on another rank.
  d.insert("rank", static_cast<int64_t>(pg_->getRank()));
  d.insert("world_size", static_cast<int64_t>(pg_->getSize()));
  d.insert("error", tensor_dict(mem.error, mem.restored_error));
  d.insert("q", tensor_dict(mem.q, mem.restored_q));
  d.insert("batched_q", tensor_dict(mem.batched_q, mem.restored_batched_q));
  d.insert("batched_error_pad", tensor_dict(mem.batched_error_pad, mem.restored_batched_error_pad));
  return d;
}

void PowerSGDState::load_state_dict(const c10::impl::GenericDict& d, bool strict,
                                    bool allow_reshard) {
  const detail::CheckpointReader in(d, "PowerSGDState.load_state_dict");
  TORCH_CHECK_VALUE(in.get_string("format") == "ddpx.PowerSGDState/1",
                    "PowerSGDState.load_state_dict: not a ddpx PowerSGDState checkpoint");
  // Everything is read and checked before anything changes: a bad checkpoint leaves the state
  // as it was.
  PowerSGDOptions o;
  o.matrix_approximation_rank = in.get_int("matrix_approximation_rank");
  o.start_powerSGD_iter = in.get_int("start_powerSGD_iter");
  o.min_compression_rate = in.get_double("min_compression_rate");
  o.use_error_feedback = in.get_bool("use_error_feedback");
  o.warm_start = in.get_bool("warm_start");
  o.orthogonalization_epsilon = in.get_double("orthogonalization_epsilon");
  o.random_seed = in.get_int("random_seed");
  o.compression_stats_logging_frequency = in.get_int("compression_stats_logging_frequency");
  o.batch_tensors_with_same_shape = in.get_bool("batch_tensors_with_same_shape");
  o.validate();
  const int64_t iter = in.get_int("iter");
  const int64_t before = in.get_int("total_numel_before_compression");
  const int64_t after = in.get_int("total_numel_after_compression");
  const int64_t next_report = in.get_int("next_stats_report");
  NumpyRandint rng;
  rng.deserialize(in.get_string("rng"));
  auto error = in.get_tensors<int64_t>("error");
  auto q = in.get_tensors<int64_t>("q");
  auto batched_q = in.get_tensors<std::string>("batched_q");
  auto batched_error_pad = in.get_tensors<std::string>("batched_error_pad");
  // Each rank's residuals are its own: another rank's resume silently wrong (every rank would
  // carry one rank's residuals). Q memories are equal on every rank (they are all-reduced), so
  // a checkpoint without error memories may go anywhere.
  if (d.contains("rank") && (!error.empty() || !batched_error_pad.empty())) {
    const int64_t saved_rank = in.get_int("rank"), saved_world = in.get_int("world_size");
    const int64_t rank = pg_->getRank(), world = pg_->getSize();
    TORCH_CHECK_VALUE(allow_reshard || (saved_rank == rank && saved_world == world),
                      "PowerSGDState.load_state_dict: the checkpoint's error-feedback memories "
                      "were saved by rank ",
                      saved_rank, " of ", saved_world, ", and this is rank ", rank, " of ", world,
                      ". Each rank's memories are its own: save state_dict() to one file per "
                      "rank and load each rank's own file; to load these here on purpose (a "
                      "deliberate reshard), pass allow_reshard=True");
  }

  set_options(o);
  iter_ = iter;
  total_before_ = before;
  total_after_ = after;
  next_stats_report_ = next_report;
  rng_ = rng;
  detail::PowerSGDMemory& mem = *memory_;
  // A fresh start for everything tied to this process's tensors.
  mem.reset_live();
  mem.restored_error = std::move(error);
  mem.restored_q = std::move(q);
  mem.restored_batched_q = std::move(batched_q);
  mem.restored_batched_error_pad = std::move(batched_error_pad);
  mem.strict_restore = strict;
  mem.keys.clear();
}

std::vector<char> PowerSGDState::save() const { return torch::jit::pickle_save(state_dict()); }

void PowerSGDState::load(const std::vector<char>& bytes) {
  c10::IValue v = torch::jit::pickle_load(bytes);
  TORCH_CHECK_VALUE(v.isGenericDict(), "PowerSGDState.load: not a ddpx PowerSGDState checkpoint");
  load_state_dict(v.toGenericDict());
}

}  // namespace hooks
}  // namespace ddpx
