// QuantizedState: the options, the iteration counter, checkpoints and statistics of
// quantized_hook's state (its residuals live in QuantizedMemory, quantized_memory.cpp).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/quantized_hook.h>

#include "hooks/checkpoint_reader.h"
#include "hooks/quantized_memory.h"

namespace ddpx {
namespace hooks {

using comm::ExchangeMode;

namespace {
constexpr const char* kQuantizedFormat = "ddpx.QuantizedState/1";

c10::impl::GenericDict residuals_dict(const std::map<int64_t, at::Tensor>& m) {
  c10::impl::GenericDict d(c10::IntType::get(), c10::TensorType::get());
  for (const auto& [k, t] : m) d.insert(k, t);
  return d;
}
}  // namespace

QuantizedState::QuantizedState(ProcessGroupPtr process_group, QuantizedOptions options)
    : pg_(std::move(process_group)),
      options_(options),
      memory_(std::make_unique<detail::QuantizedMemory>()) {
  TORCH_CHECK_TYPE(pg_, detail::kQuantizedWho, ": process_group must be a ProcessGroup, got null");
  validate(options_);
}

QuantizedState::~QuantizedState() = default;

void QuantizedState::check_not_in_backward(const char* what) const {
  // A change between two buckets of one backward pass would re-cut the residuals under the
  // bucket whose second round is still to come, and free the buffers and block tables that its
  // queued kernels (on a device) still read.
  TORCH_CHECK(!memory_->deferred.pending(), "QuantizedState.", what,
              ": called during backward (between two buckets of a step); call it between steps");
}

void QuantizedState::set_process_group(ProcessGroupPtr pg) {
  TORCH_CHECK_TYPE(pg, detail::kQuantizedWho, ": process_group must be a ProcessGroup, got null");
  check_not_in_backward("process_group");
  pg_ = std::move(pg);
  ++epoch_;
}

void QuantizedState::set_options(const QuantizedOptions& options) {
  validate(options);
  check_not_in_backward("set_options()");
  options_ = options;
  ++epoch_;
}

void QuantizedState::set_iter(int64_t iter) {
  TORCH_CHECK_VALUE(iter >= 0, detail::kQuantizedWho, ": iter must be >= 0, got ", iter);
  check_not_in_backward("iter");
  iter_ = iter;
  ++epoch_;
}

void QuantizedState::maybe_increase_iter(bool bucket_is_last) {
  if (bucket_is_last) ++iter_;
}

std::tuple<double, int64_t, int64_t> QuantizedState::compression_stats() const {
  const int64_t before = memory_->bytes_before, after = memory_->bytes_after;
  return {after > 0 ? static_cast<double>(before) / static_cast<double>(after) : 0.0, before,
          after};
}

c10::impl::GenericDict QuantizedState::state_dict() const {
  check_not_in_backward("state_dict()");
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("format", std::string(kQuantizedFormat));
  d.insert("bits", options_.bits);
  d.insert("block_size", options_.block_size);
  d.insert("use_error_feedback", options_.use_error_feedback);
  d.insert("start_iter", options_.start_iter);
  d.insert("random_seed", options_.random_seed);
  d.insert("stochastic_rounding", options_.stochastic_rounding);
  d.insert("exchange", std::string(comm::exchange_mode_name(options_.exchange)));
  d.insert("rotation", std::string(quantized_rotation_name(options_.rotation)));
  d.insert("iter", iter_);
  // Whose residuals these are: load_state_dict refuses them on another rank.
  d.insert("rank", static_cast<int64_t>(pg_->getRank()));
  d.insert("world_size", static_cast<int64_t>(pg_->getSize()));
  d.insert("worker_residuals", residuals_dict(memory_->workers()));
  d.insert("server_residuals", residuals_dict(memory_->servers()));
  return d;
}

void QuantizedState::load_state_dict(const c10::impl::GenericDict& d, bool allow_reshard) {
  check_not_in_backward("load_state_dict()");
  const detail::CheckpointReader in(d, "QuantizedState.load_state_dict");
  TORCH_CHECK_VALUE(in.get_string("format") == kQuantizedFormat,
                    "QuantizedState.load_state_dict: not a ddpx QuantizedState checkpoint");
  // Everything is read and checked before anything changes.
  QuantizedOptions o;
  o.bits = in.get_int("bits");
  o.block_size = in.get_int("block_size");
  o.use_error_feedback = in.get_bool("use_error_feedback");
  o.start_iter = in.get_int("start_iter");
  o.random_seed = in.get_int("random_seed");
  o.stochastic_rounding = in.get_bool("stochastic_rounding");
  // A checkpoint from before the option was taken with the reduce-scatter exchange: resume it so.
  o.exchange = in.has("exchange") ? parse_quantized_exchange(in.get_string("exchange"))
                                  : ExchangeMode::kReduceScatter;
  // And one from before rotation existed was taken without it.
  o.rotation = in.has("rotation") ? parse_quantized_rotation(in.get_string("rotation"))
                                  : QuantRotation::kNone;
  validate(o);
  const int64_t iter = in.get_int("iter");
  TORCH_CHECK_VALUE(iter >= 0, "QuantizedState.load_state_dict: iter must be >= 0, got ", iter);
  auto workers = in.get_tensors<int64_t>("worker_residuals");
  auto servers = in.get_tensors<int64_t>("server_residuals");
  if (!workers.empty() || !servers.empty()) {
    const int64_t saved_rank = in.get_int("rank"), saved_world = in.get_int("world_size");
    const int64_t rank = pg_->getRank(), world = pg_->getSize();
    TORCH_CHECK_VALUE(allow_reshard || (saved_rank == rank && saved_world == world),
                      "QuantizedState.load_state_dict: the checkpoint's residuals were saved by "
                      "rank ",
                      saved_rank, " of ", saved_world, ", and this is rank ", rank, " of ", world,
                      ". Each rank's residuals are its own: save state_dict() to one file per "
                      "rank and load each rank's own file; to load these here on purpose (a "
                      "deliberate reshard), pass allow_reshard=True");
  }
  for (const auto* m : {&workers, &servers}) {
    for (const auto& [k, t] : *m) {
      TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat && t.dim() == 1,
                       "QuantizedState.load_state_dict: residuals must be 1-D fp32 tensors, got ",
                       t.scalar_type(), " of ", t.dim(), " dimensions for parameter ", k);
    }
  }
  options_ = o;
  iter_ = iter;
  ++epoch_;
  detail::QuantizedMemory& mem = *memory_;
  mem.clear();
  mem.keys.clear();
  mem.parked_worker = std::move(workers);
  mem.parked_server = std::move(servers);
}

std::map<int64_t, at::Tensor> QuantizedState::worker_residuals() const {
  return memory_->workers();
}
std::map<int64_t, at::Tensor> QuantizedState::server_residuals() const {
  return memory_->servers();
}

void QuantizedState::clear_memories() {
  check_not_in_backward("clear_memories()");
  memory_->clear();
}

}  // namespace hooks
}  // namespace ddpx
