#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/quantized_hook.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

#include "comm/deferred.h"
#include "comm/exchange.h"
#include "comm/staging.h"
#include "common/compat_internal.h"
#include "hooks/checkpoint_reader.h"
#include "hooks/hook_utils.h"
#include "hooks/parameter_keys.h"
#include "ops/quantized.h"

namespace ddpx {
namespace hooks {

using comm::ExchangeMode;

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

namespace {
constexpr const char* kQuantizedWho = "QuantizedState";
constexpr const char* kQuantizedFormat = "ddpx.QuantizedState/1";

// The stochastic generator's stream of one (iteration, level, rank): with each block's draw
// index (its parameter key and offset, see QuantLayout) every draw of a run is determined by
// these and the seed, whatever DDP's buckets, so a resumed run draws what the original drew.
uint64_t quant_stream_id(int64_t iter, int level, int64_t rank) {
  uint64_t s = static_cast<uint64_t>(iter);
  s = s * 0x100000001b3ULL + static_cast<uint64_t>(level);
  return s * 0x100000001b3ULL + static_cast<uint64_t>(rank);
}

kernels::QuantSpec quant_spec_of(const QuantizedOptions& o, uint64_t stream) {
  kernels::QuantSpec spec;
  spec.bits = static_cast<int>(o.bits);
  spec.block = o.block_size;
  spec.stochastic = o.stochastic_rounding;
  // Without error feedback nothing carries a 2-bit block's dropped values to the next step, so
  // its scale is fitted to the block (more values sent, less squared error); with it, max|v|
  // keeps every residual within half a step.
  spec.fitted_ternary = !o.use_error_feedback;
  spec.seed = static_cast<uint64_t>(o.random_seed);
  spec.stream = stream;
  spec.rotate = rotates(o);
  spec.unbiased_sign = spec.rotate && !o.use_error_feedback;
  return spec;
}

// How a receiver rotates back the messages of a spec made by quant_spec_of: term t of the sum
// came from stream stream0 + t * step (quant_stream_id is linear in the rank: step 1 for
// messages in rank order, 0 for the owners' means, which all use rank 0's stream).
kernels::Unrotate unrotate_of(const kernels::QuantSpec& spec, uint64_t stream0, uint64_t step) {
  kernels::Unrotate u;
  u.on = spec.rotate;
  u.seed = spec.seed;
  u.stream0 = stream0;
  u.stream_step = step;
  return u;
}
}  // namespace

void validate(const QuantizedOptions& o) {
  TORCH_CHECK_VALUE(o.bits == 1 || o.bits == 2 || o.bits == 4 || o.bits == 8, kQuantizedWho,
                    ": bits must be 1, 2, 4 or 8, got ", o.bits);
  TORCH_CHECK_VALUE(o.block_size >= 8 && o.block_size % 8 == 0 && o.block_size <= (1 << 20),
                    kQuantizedWho, ": block_size must be a multiple of 8 in [8, 1048576], got ",
                    o.block_size);
  TORCH_CHECK_VALUE(o.start_iter >= 0, kQuantizedWho, ": start_iter must be >= 0, got ",
                    o.start_iter);
  // By name, so that an enum from C++ and a string from Python are refused alike.
  (void)parse_quantized_exchange(comm::exchange_mode_name(o.exchange));
  (void)parse_quantized_rotation(quantized_rotation_name(o.rotation));
  TORCH_CHECK_VALUE(
      o.rotation != QuantRotation::kHadamard || kernels::rotation_block_ok(o.block_size),
      kQuantizedWho,
      ": rotation='hadamard' needs a block_size that is a power of "
      "two in [8, 8192], got ",
      o.block_size);
}

QuantRotation parse_quantized_rotation(const std::string& name) {
  if (name == "auto") return QuantRotation::kAuto;
  if (name == "hadamard") return QuantRotation::kHadamard;
  if (name == "none") return QuantRotation::kNone;
  TORCH_CHECK_VALUE(false, kQuantizedWho, ": rotation must be 'auto', 'hadamard' or 'none', got '",
                    name, "'");
}

const char* quantized_rotation_name(QuantRotation rotation) {
  switch (rotation) {
    case QuantRotation::kAuto:
      return "auto";
    case QuantRotation::kHadamard:
      return "hadamard";
    case QuantRotation::kNone:
      return "none";
  }
  return "?";
}

bool rotates(const QuantizedOptions& o) {
  if (o.rotation == QuantRotation::kAuto) {
    return !o.use_error_feedback && kernels::rotation_block_ok(o.block_size);
  }
  return o.rotation == QuantRotation::kHadamard;
}

ExchangeMode parse_quantized_exchange(const std::string& name) {
  if (name == "auto") return ExchangeMode::kAuto;
  if (name == "allgather") return ExchangeMode::kAllgather;
  if (name == "reduce_scatter") return ExchangeMode::kReduceScatter;
  TORCH_CHECK_VALUE(false, kQuantizedWho,
                    ": exchange must be 'auto', 'allgather' or 'reduce_scatter', got '", name, "'");
}

namespace detail {

// How one bucket layout is cut and who owns what. Every parameter is cut into blocks of its own
// (block_size values from its first one; the last may be short), and block b of the parameter
// with key k is owned by rank (k + b) % world: blocks, owners and draw indices depend on the
// parameter and the group only, not on how DDP groups parameters into buckets. So the same
// gradients give the same results whatever the buckets (bucket_cap_mb, DDP's rebuild after the
// first iteration, a restart), and every residual stays with the rank that keeps it.
struct QuantLayout {
  std::vector<int64_t> keys, offsets, lengths;
  int64_t n = 0, world = 0, rank = 0, bits = 0, block = 0;
  bool error_feedback = false;
  // The all-gather exchange (QuantizedOptions::exchange, resolved for this world size): every
  // block, in bucket order, in one message of all_bytes (the other fields serve the residuals'
  // bookkeeping only).
  bool gather = false;
  ops::BlockTable all;
  int64_t all_bytes = 0;
  // Per owner j: the blocks it owns, in bucket coordinates (what this rank sends it in round
  // one, and where its mean lands from round two), and their message's bytes.
  std::vector<ops::BlockTable> to_owner;
  std::vector<int64_t> message_bytes;
  // All the messages' bytes: what round two brings back. Round one sends all but this rank's.
  int64_t send_bytes = 0;
  // This rank's blocks, packed: block m at [m * block, m * block + len), and where each comes
  // from (parameter index, offset in the parameter).
  ops::BlockTable owned;
  std::vector<std::pair<size_t, int64_t>> owned_from;

  bool same(const std::vector<int64_t>& k, int64_t n_, int64_t w, int64_t r,
            const QuantizedOptions& o) const {
    return keys == k && n == n_ && world == w && rank == r && bits == o.bits &&
           block == o.block_size && error_feedback == o.use_error_feedback &&
           gather == gathers(o, w);
  }
  // Whether options `o` exchange by all-gather on `w` ranks.
  static bool gathers(const QuantizedOptions& o, int64_t w) {
    return o.exchange == ExchangeMode::kAllgather || (o.exchange == ExchangeMode::kAuto && w == 2);
  }
};

namespace {
// Draw index of value `offset` of the parameter with key k: keys below 2^24, offsets below 2^40.
uint64_t draw_of(int64_t key, int64_t offset) {
  return (static_cast<uint64_t>(key) << 40) + static_cast<uint64_t>(offset);
}

std::shared_ptr<QuantLayout> make_layout(std::vector<int64_t> keys, const c10d::GradBucket& b,
                                         int64_t n, int64_t world, int64_t rank,
                                         const QuantizedOptions& o, const c10::Device& device) {
  auto L = std::make_shared<QuantLayout>();
  L->keys = std::move(keys);
  L->n = n;
  L->world = world;
  L->rank = rank;
  L->bits = o.bits;
  L->block = o.block_size;
  L->error_feedback = o.use_error_feedback;
  L->gather = QuantLayout::gathers(o, world);
  // DDP's dense bucket is its parameters' gradients back to back, in getParameters() order.
  int64_t offset = 0;
  for (const at::Tensor& p : b.getParameters()) {
    L->offsets.push_back(offset);
    L->lengths.push_back(p.numel());
    offset += p.numel();
  }
  TORCH_CHECK(offset == n, "quantized_hook: the bucket's parameters hold ", offset,
              " values and its buffer ", n);
  std::vector<std::vector<kernels::BlockRef>> to_owner(static_cast<size_t>(world));
  std::vector<kernels::BlockRef> owned, all;
  const int64_t B = o.block_size;
  for (size_t i = 0; i < L->keys.size(); ++i) {
    const int64_t k = L->keys[i];
    for (int64_t off = 0, blk = 0; off < L->lengths[i]; off += B, ++blk) {
      const int64_t len = std::min(B, L->lengths[i] - off);
      const int64_t owner = (k + blk) % world;
      to_owner[static_cast<size_t>(owner)].push_back({L->offsets[i] + off, len, draw_of(k, off)});
      if (L->gather) all.push_back({L->offsets[i] + off, len, draw_of(k, off)});
      if (owner == rank) {
        owned.push_back({static_cast<int64_t>(owned.size()) * B, len, draw_of(k, off)});
        L->owned_from.emplace_back(i, off);
      }
    }
  }
  for (auto& refs : to_owner) {
    ops::BlockTable t(std::move(refs));
    t.to(device);
    L->message_bytes.push_back(ops::quantized_message_bytes(t.size(), static_cast<int>(o.bits), B));
    L->send_bytes += L->message_bytes.back();
    L->to_owner.push_back(std::move(t));
  }
  L->owned = ops::BlockTable(std::move(owned));
  L->owned.to(device);
  if (L->gather) {
    L->all = ops::BlockTable(std::move(all));
    L->all.to(device);
    L->all_bytes = ops::quantized_message_bytes(L->all.size(), static_cast<int>(o.bits), B);
  }
  return L;
}
}  // namespace

// One bucket's layout and residuals.
struct QuantizedBucket {
  std::shared_ptr<const QuantLayout> layout;
  at::Tensor worker;  // fp32 [n]: this rank's quantization error (error feedback only)
  at::Tensor server;  // fp32 [owned blocks * block]: the error of the owned means
};

class QuantizedMemory {
 public:
  // Live buckets by index, and the parameters' residuals out of any bucket (restored from a
  // checkpoint, or parked when a layout changed) by parameter key, each over the whole
  // parameter: the worker one, and the server one (zeros in the blocks other ranks own).
  std::unordered_map<size_t, QuantizedBucket> live;
  std::unordered_map<int64_t, size_t> bucket_of_key;
  std::unordered_map<int64_t, at::Tensor> parked_worker, parked_server;
  ParameterKeys keys;
  comm::DeferredCollective deferred;

  QuantizedBucket& bucket_for(size_t index, std::vector<int64_t> keys, const c10d::GradBucket& b,
                              int64_t n, int64_t world, int64_t rank, const QuantizedOptions& o,
                              const at::TensorOptions& options);
  // Every live bucket's residuals back to per-parameter form.
  void park_all();
  // The per-parameter residuals (live over parked), as CPU copies.
  std::map<int64_t, at::Tensor> workers() const;
  std::map<int64_t, at::Tensor> servers() const;
  void clear() {
    live.clear();
    bucket_of_key.clear();
    parked_worker.clear();
    parked_server.clear();
  }
};

QuantizedBucket& QuantizedMemory::bucket_for(size_t index, std::vector<int64_t> keys,
                                             const c10d::GradBucket& b, int64_t n, int64_t world,
                                             int64_t rank, const QuantizedOptions& o,
                                             const at::TensorOptions& options) {
  auto it = live.find(index);
  if (it != live.end() && it->second.layout->same(keys, n, world, rank, o)) return it->second;
  // A new layout. If any of its parameters is still held by another layout (DDP rebuilt its
  // buckets, the group or the options changed), every bucket goes back to per-parameter form
  // first; the deferred step of the previous bucket updates its server residual, so it runs
  // before.
  bool held = it != live.end();
  for (const int64_t k : keys) held = held || bucket_of_key.count(k) > 0;
  if (held) {
    deferred.flush();
    park_all();
  }
  QuantizedBucket q;
  auto layout = make_layout(std::move(keys), b, n, world, rank, o, options.device());
  const QuantLayout& L = *layout;
  q.layout = std::move(layout);
  if (L.error_feedback) {
    const auto f32 = options.dtype(at::kFloat);
    q.worker = at::zeros({L.n}, f32);
    q.server = at::zeros({L.owned.size() * L.block}, f32);
    for (size_t i = 0; i < L.keys.size(); ++i) {
      auto w = parked_worker.find(L.keys[i]);
      if (w == parked_worker.end()) continue;
      TORCH_CHECK_VALUE(w->second.numel() == L.lengths[i],
                        "quantized_hook: the residual of "
                        "parameter ",
                        L.keys[i], " has ", w->second.numel(), " values, the parameter ",
                        L.lengths[i],
                        " (a checkpoint of another "
                        "model?)");
      q.worker.narrow(0, L.offsets[i], L.lengths[i]).copy_(w->second);
      parked_worker.erase(w);
    }
    for (size_t m = 0; m < L.owned_from.size(); ++m) {
      const auto& [i, off] = L.owned_from[m];
      auto s = parked_server.find(L.keys[i]);
      if (s == parked_server.end()) continue;
      TORCH_CHECK_VALUE(s->second.numel() == L.lengths[i],
                        "quantized_hook: the owner residual "
                        "of parameter ",
                        L.keys[i], " has ", s->second.numel(), " values, the parameter ",
                        L.lengths[i]);
      const int64_t len = L.owned.refs()[m].len;
      q.server.narrow(0, m * L.block, len).copy_(s->second.narrow(0, off, len));
    }
    for (const int64_t k : L.keys) parked_server.erase(k);
  }
  for (const int64_t k : L.keys) bucket_of_key[k] = index;
  return live[index] = std::move(q);
}

void QuantizedMemory::park_all() {
  for (const auto& entry : live) {
    const QuantizedBucket& b = entry.second;
    const QuantLayout& L = *b.layout;
    if (!b.worker.defined()) continue;
    for (size_t i = 0; i < L.keys.size(); ++i) {
      parked_worker[L.keys[i]] = b.worker.narrow(0, L.offsets[i], L.lengths[i]).clone();
    }
    for (size_t m = 0; m < L.owned_from.size(); ++m) {
      const auto& [i, off] = L.owned_from[m];
      auto s = parked_server.find(L.keys[i]);
      if (s == parked_server.end()) {
        s = parked_server.emplace(L.keys[i], at::zeros({L.lengths[i]}, b.server.options())).first;
      }
      const int64_t len = L.owned.refs()[m].len;
      s->second.narrow(0, off, len).copy_(b.server.narrow(0, m * L.block, len));
    }
  }
  live.clear();
  bucket_of_key.clear();
}

std::map<int64_t, at::Tensor> QuantizedMemory::workers() const {
  std::map<int64_t, at::Tensor> out;
  for (const auto& [k, t] : parked_worker) out[k] = t.detach().cpu().clone();
  for (const auto& entry : live) {
    const QuantizedBucket& b = entry.second;
    if (!b.worker.defined()) continue;
    const QuantLayout& L = *b.layout;
    for (size_t i = 0; i < L.keys.size(); ++i) {
      out[L.keys[i]] = b.worker.narrow(0, L.offsets[i], L.lengths[i]).detach().cpu().clone();
    }
  }
  return out;
}

std::map<int64_t, at::Tensor> QuantizedMemory::servers() const {
  std::map<int64_t, at::Tensor> out;
  for (const auto& [k, t] : parked_server) out[k] = t.detach().cpu().clone();
  for (const auto& entry : live) {
    const QuantizedBucket& b = entry.second;
    if (!b.server.defined()) continue;
    const QuantLayout& L = *b.layout;
    for (size_t m = 0; m < L.owned_from.size(); ++m) {
      const auto& [i, off] = L.owned_from[m];
      auto it = out.find(L.keys[i]);
      if (it == out.end()) it = out.emplace(L.keys[i], at::zeros({L.lengths[i]}, at::kFloat)).first;
      const int64_t len = L.owned.refs()[m].len;
      it->second.narrow(0, off, len).copy_(b.server.narrow(0, m * L.block, len));
    }
  }
  return out;
}

}  // namespace detail

QuantizedState::QuantizedState(ProcessGroupPtr process_group, QuantizedOptions options)
    : pg_(std::move(process_group)),
      options_(options),
      memory_(std::make_unique<detail::QuantizedMemory>()) {
  TORCH_CHECK_TYPE(pg_, kQuantizedWho, ": process_group must be a ProcessGroup, got null");
  validate(options_);
}

QuantizedState::~QuantizedState() = default;

void QuantizedState::set_process_group(ProcessGroupPtr pg) {
  TORCH_CHECK_TYPE(pg, kQuantizedWho, ": process_group must be a ProcessGroup, got null");
  pg_ = std::move(pg);
}

void QuantizedState::set_options(const QuantizedOptions& options) {
  validate(options);
  options_ = options;
}

void QuantizedState::set_iter(int64_t iter) {
  TORCH_CHECK_VALUE(iter >= 0, kQuantizedWho, ": iter must be >= 0, got ", iter);
  iter_ = iter;
}

void QuantizedState::maybe_increase_iter(bool bucket_is_last) {
  if (bucket_is_last) ++iter_;
}

namespace {
c10::impl::GenericDict residuals_dict(const std::map<int64_t, at::Tensor>& m) {
  c10::impl::GenericDict d(c10::IntType::get(), c10::TensorType::get());
  for (const auto& [k, t] : m) d.insert(k, t);
  return d;
}
}  // namespace

c10::impl::GenericDict QuantizedState::state_dict() const {
  TORCH_CHECK(!memory_->deferred.pending(), "QuantizedState.state_dict(): called during backward");
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
  TORCH_CHECK(!memory_->deferred.pending(),
              "QuantizedState.load_state_dict(): called during backward");
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
  TORCH_CHECK(!memory_->deferred.pending(),
              "QuantizedState.clear_memories(): called during backward");
  memory_->clear();
}

namespace {
// The all-gather exchange of one bucket (QuantizedOptions::exchange): this rank's message (its
// whole bucket plus residual, quantized) to every other rank, then every rank sums the W
// messages in rank order, the same bytes in the same order, so every replica gets the same bits.
FuturePtr gather_exchange(const ProcessGroupPtr& pg, const at::Tensor& buffer,
                          const at::Tensor& worker,
                          const std::shared_ptr<const detail::QuantLayout>& layout,
                          const kernels::QuantSpec& spec, const kernels::Unrotate& unrotate) {
  const detail::QuantLayout& L = *layout;
  auto& pool = comm::StagingPool::instance();
  const int64_t S = L.all_bytes, world = L.world, rank = L.rank;
  // Row r of `rows`: rank r's message.
  at::Tensor rows = pool.acquire(world * S, buffer.options());
  at::Tensor send, recv;
  std::vector<int64_t> splits(static_cast<size_t>(world), S);
  if (world == 2) {
    // This rank's row goes out as it is and the other one comes in: no copies.
    ops::quantize_ef_into(buffer, worker, L.all, spec, rows.narrow(0, rank * S, S));
    send = rows.narrow(0, rank * S, S);
    recv = rows.narrow(0, (1 - rank) * S, S);
    splits[static_cast<size_t>(rank)] = 0;
  } else {
    // all_to_all_single packs what it receives by source rank, so the rows come in whole, this
    // rank's own from itself; every row sent is a copy of this rank's message.
    send = pool.acquire(world * S, buffer.options());
    ops::quantize_ef_into(buffer, worker, L.all, spec, send.narrow(0, 0, S));
    for (int64_t r = 1; r < world; ++r) send.narrow(0, r * S, S).copy_(send.narrow(0, 0, S));
    recv = rows;
  }
  // Two vectors, not one passed twice: torch 1.13's Gloo moves each split list into its work,
  // and a second reference to a moved-from vector reads as empty.
  std::vector<int64_t> recv_splits = splits;
  auto work = compat::all_to_all_single(*pg, recv, send, recv_splits, splits);
  const int bits = spec.bits;
  const int64_t block = spec.block;
  return comm::future_of(*work, buffer.device())
      ->then(
          [rows, send, buffer, layout, bits, block, unrotate](c10::ivalue::Future& f) {
            f.value();  // rethrows a failed collective
            const detail::QuantLayout& L = *layout;
            auto& pool = comm::StagingPool::instance();
            const bool f32 = buffer.scalar_type() == at::kFloat;
            // The sum lands in an fp32 bucket directly (its values were quantized already).
            at::Tensor sum_bytes = f32 ? at::Tensor() : pool.acquire(L.n * 4, buffer.options());
            const at::Tensor sum = f32 ? buffer : sum_bytes.view(at::kFloat);
            ops::dequantize_sum_into(rows.view({L.world, L.all_bytes}), L.all, bits, block,
                                     1.0f / static_cast<float>(L.world), sum, ops::ExactValues(),
                                     unrotate);
            if (!f32) {
              buffer.copy_(sum);
              comm::keep_until_current_stream_done(sum_bytes);
              pool.release(sum_bytes);
            }
            comm::keep_until_current_stream_done(rows);
            pool.release(rows);
            if (L.world != 2) {  // a buffer of its own (on 2 ranks a view of `rows`)
              comm::keep_until_current_stream_done(send);
              pool.release(send);
            }
            return c10::IValue(buffer);
          },
          c10::TensorType::get());
}
}  // namespace

QuantizedHook::QuantizedHook(QuantizedStatePtr state) : state_(std::move(state)) {
  TORCH_CHECK_TYPE(state_ != nullptr, "quantized_hook: state must be a QuantizedState");
}

c10::intrusive_ptr<c10::ivalue::Future> QuantizedHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name());
  QuantizedState& st = *state_;
  detail::QuantizedMemory& mem = st.memory();
  const ProcessGroupPtr pg = st.process_group();
  const QuantizedOptions o = st.options();
  const bool last = bucket.isLast();
  const int64_t iter = st.iter();
  const int64_t world = pg->getSize();
  const int64_t n = buffer.numel();
  // Keys from the first iteration on, warm-up included: DDP's initial buckets give every process
  // that builds the model the same keys, which a checkpoint's residuals are saved under.
  std::vector<int64_t> keys = mem.keys.keys_for(bucket, name(), kQuantizedWho);
  if (last) mem.keys.end_of_iteration();
  if (iter < o.start_iter || world == 1 || n == 0) {
    // Warm-up: allreduce_hook's mean. A group of one (or an empty bucket) has nothing to average.
    mem.deferred.flush();
    st.maybe_increase_iter(last);
    if (iter < o.start_iter) return comm::allreduce_mean(pg, buffer, ExchangeMode::kAuto);
    return detail::completed_future(buffer);
  }
  const int64_t rank = pg->getRank();
  const detail::QuantizedBucket& b = mem.bucket_for(bucket.getIndex(), std::move(keys), bucket, n,
                                                    world, rank, o, buffer.options());
  const std::shared_ptr<const detail::QuantLayout> layout = b.layout;
  const at::Tensor worker = b.worker, server = b.server;
  const detail::QuantLayout& L = *layout;
  st.maybe_increase_iter(last);
  if (L.gather) {
    mem.deferred.flush();  // a reduce-scatter bucket's second round, should the options change
    // Row r of the sum is rank r's message, quantized with rank r's stream.
    const kernels::QuantSpec spec = quant_spec_of(o, quant_stream_id(iter, 0, rank));
    return gather_exchange(pg, buffer, worker, layout, spec,
                           unrotate_of(spec, quant_stream_id(iter, 0, 0), 1));
  }

  // Round one: every other owner's blocks of (bucket + residual), quantized, to their owner. A
  // rank's own blocks cross no wire: they enter its sum as they are, and keep no residual.
  auto& pool = comm::StagingPool::instance();
  const int64_t own_bytes = L.message_bytes[static_cast<size_t>(rank)];
  at::Tensor send = pool.acquire(L.send_bytes - own_bytes, buffer.options());
  at::Tensor recv = pool.acquire((world - 1) * own_bytes, buffer.options());
  const kernels::QuantSpec worker_spec = quant_spec_of(o, quant_stream_id(iter, 0, rank));
  std::vector<int64_t> to_owners, from_others;
  for (int64_t j = 0, at = 0; j < world; ++j) {
    const int64_t bytes = j == rank ? 0 : L.message_bytes[static_cast<size_t>(j)];
    if (bytes > 0) {
      ops::quantize_ef_into(buffer, worker, L.to_owner[static_cast<size_t>(j)], worker_spec,
                            send.narrow(0, at, bytes));
    }
    at += bytes;
    to_owners.push_back(bytes);
    from_others.push_back(j == rank ? 0 : own_bytes);
  }
  auto work = compat::all_to_all_single(*pg, recv, send, from_others, to_owners);
  const FuturePtr round_one = comm::future_of(*work, buffer.device());

  // Round two, from the next runHook: the owner's means, re-quantized with its own residual, to
  // every rank. The step runs on this thread, in runHook; its callbacks hold buffers only.
  const FuturePtr result = comm::future_on(buffer);
  const kernels::QuantSpec server_spec = quant_spec_of(o, quant_stream_id(iter, 1, 0));
  // Round one's term t is rank t's message (this rank's own values at its row, not rotated);
  // round two's are the owners' means, all with rank 0's level-1 stream.
  const kernels::Unrotate unrotate_one = unrotate_of(worker_spec, quant_stream_id(iter, 0, 0), 1);
  const kernels::Unrotate unrotate_two = unrotate_of(server_spec, server_spec.stream, 0);
  comm::DeferredCollective::Step step{
      [pg, round_one, send, recv, buffer, server, server_spec, layout, own_bytes, result,
       unrotate_one, unrotate_two] {
        const detail::QuantLayout& L = *layout;
        const comm::OnPoolStream on_side(buffer.device());
        round_one->wait();   // on CUDA: the pool stream waits for the collective
        round_one->value();  // rethrows a failed round one
        auto& pool = comm::StagingPool::instance();
        const int bits = server_spec.bits;
        const int64_t block = server_spec.block;
        const int64_t world = L.world;
        at::Tensor send2 = pool.acquire(world * own_bytes, buffer.options());
        if (own_bytes > 0) {
          // The owned means in fp32, in a reused buffer (a fresh one would fault its pages in
          // every step): the others' messages and this rank's own values, in rank order.
          const at::Tensor mean_bytes = pool.acquire(L.owned.size() * block * 4, buffer.options());
          const at::Tensor mean = mean_bytes.view(at::kFloat);
          ops::ExactValues own{buffer, &L.to_owner[static_cast<size_t>(L.rank)], L.rank};
          ops::dequantize_sum_into(recv.view({world - 1, own_bytes}), L.owned, bits, block,
                                   1.0f / static_cast<float>(world), mean, own, unrotate_one);
          ops::quantize_ef_into(mean, server, L.owned, server_spec, send2.narrow(0, 0, own_bytes));
          for (int64_t r = 1; r < world; ++r) {
            send2.narrow(0, r * own_bytes, own_bytes).copy_(send2.narrow(0, 0, own_bytes));
          }
          comm::keep_until_current_stream_done(mean_bytes);
          pool.release(mean_bytes);
        }
        comm::keep_until_current_stream_done(send);
        comm::keep_until_current_stream_done(recv);
        pool.release(send);
        pool.release(recv);
        at::Tensor recv2 = pool.acquire(L.send_bytes, buffer.options());
        // Every owner's means to every rank, itself included.
        std::vector<int64_t> to_all(static_cast<size_t>(world), own_bytes);
        std::vector<int64_t> from_owners = L.message_bytes;
        auto work2 = compat::all_to_all_single(*pg, recv2, send2, from_owners, to_all);
        FuturePtr decoded = comm::future_of(*work2, buffer.device())
                                ->then(
                                    [send2, recv2, buffer, layout, bits, block,
                                     unrotate_two](c10::ivalue::Future& f) {
                                      f.value();  // rethrows a failed collective
                                      const detail::QuantLayout& L = *layout;
                                      for (int64_t j = 0, at = 0; j < L.world; ++j) {
                                        const int64_t bytes =
                                            L.message_bytes[static_cast<size_t>(j)];
                                        if (bytes > 0) {
                                          ops::dequantize_into(recv2.narrow(0, at, bytes),
                                                               L.to_owner[static_cast<size_t>(j)],
                                                               bits, block, buffer, unrotate_two);
                                        }
                                        at += bytes;
                                      }
                                      comm::keep_until_current_stream_done(send2);
                                      comm::keep_until_current_stream_done(recv2);
                                      auto& pool = comm::StagingPool::instance();
                                      pool.release(send2);
                                      pool.release(recv2);
                                      return c10::IValue(buffer);
                                    },
                                    c10::TensorType::get());
        c10::List<FuturePtr> parts(c10::FutureType::create(c10::TensorType::get()));
        parts.push_back(decoded);
        comm::complete_when_all_done(parts, buffer, result);
      },
      [result](std::exception_ptr error) {
        if (!result->completed()) result->setError(std::move(error));
      }};
  mem.deferred.submit(std::move(step), last);
  return result;
}

CommHookPtr quantized_hook(QuantizedStatePtr state) {
  return std::make_shared<QuantizedHook>(std::move(state));
}

}  // namespace hooks
}  // namespace ddpx
