// reduce_scatter_hook: the owner-sharded exchange's scatter round (comm/sharded_exchange.h)
// over ZeRO's partition. See include/ddpx/hooks/zero_reduce_scatter_hook.h.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/zero_reduce_scatter_hook.h>
#include <ddpx/optim/zero_layout.h>

#include <algorithm>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <unordered_map>
#include <vector>

#include "comm/sharded_exchange.h"
#include "hooks/agreement.h"
#include "hooks/checkpoint_reader.h"
#include "hooks/hook_utils.h"

namespace ddpx {
namespace hooks {

namespace {
constexpr const char* kScatterWho = "reduce_scatter_hook";
constexpr const char* kScatterFormat = "ddpx.ReduceScatterState/1";

bool quantizes(const ReduceScatterOptions& o) { return o.bits != 32; }
bool keeps_residuals(const ReduceScatterOptions& o) { return quantizes(o) && o.use_error_feedback; }
}  // namespace

void ReduceScatterOptions::validate() const {
  TORCH_CHECK_VALUE(bits == 32 || bits == 8 || bits == 4 || bits == 2 || bits == 1, kScatterWho,
                    ": bits must be 32 (no quantization), 8, 4, 2 or 1, got ", bits);
  TORCH_CHECK_VALUE(block_size >= 8 && block_size % 8 == 0 && block_size <= (1 << 20), kScatterWho,
                    ": block_size must be a multiple of 8 in [8, 1048576], got ", block_size);
}

namespace detail {

// One bucket layout: its parameters' places in the partition and in the bucket, who owns what.
struct ScatterLayout {
  std::vector<const void*> impls;  // the bucket's parameters, by TensorImpl
  int64_t n = 0, bits = 0, block = 0;
  bool residuals = false;
  std::vector<int64_t> indices, offsets, lengths;  // per bucket parameter
  std::shared_ptr<const comm::ShardPlan> plan;
  // Where this rank's packed sum goes in the bucket: runs of consecutive values in bucket order,
  // [begin, begin + len) taking the sum's [offset, offset + len). (One copy per run and zeros in
  // the gaps: an index_copy_ of every owned value cost about a fifth of a ZeRO-2 iteration.)
  struct Run {
    int64_t begin, len, offset;
  };
  std::vector<Run> owned_runs;
  // Values this rank sends other ranks per step.
  int64_t sent_values = 0;
};

struct ScatterBucket {
  std::shared_ptr<const ScatterLayout> layout;
  at::Tensor residual;  // fp32 [n] (quantized with error feedback): zeros on the owned values
};

class ReduceScatterMemory {
 public:
  explicit ReduceScatterMemory(const optim::ZeroLayout& zero) { index_params(zero); }

  // The partition index of each parameter (again after add_param_group added some).
  void index_params(const optim::ZeroLayout& zero) {
    const auto& params = zero.params();
    for (size_t i = index_of.size(); i < params.size(); ++i) {
      index_of.emplace(params[i].unsafeGetTensorImpl(), static_cast<int64_t>(i));
    }
  }

  ScatterBucket& bucket_for(const c10d::GradBucket& b, int64_t n, const ProcessGroupPtr& pg,
                            const optim::ZeroLayout& zero, const ReduceScatterOptions& o,
                            const at::TensorOptions& options);
  void park_all();
  std::map<int64_t, at::Tensor> residuals() const;

  std::unordered_map<const void*, int64_t> index_of;  // partition index of each parameter
  std::unordered_map<size_t, ScatterBucket> live;     // by bucket index
  std::map<int64_t, at::Tensor> parked;               // residuals out of any bucket
  int64_t sent_elements = 0, sent_bytes = 0, layouts_built = 0;
};

namespace {
std::shared_ptr<ScatterLayout> make_scatter_layout(const c10d::GradBucket& b, int64_t n,
                                                   const ProcessGroupPtr& pg,
                                                   const optim::ZeroLayout& zero,
                                                   const ReduceScatterMemory& mem,
                                                   const ReduceScatterOptions& o,
                                                   const at::TensorOptions& options) {
  auto L = std::make_shared<ScatterLayout>();
  L->n = n;
  L->bits = o.bits;
  L->block = o.block_size;
  L->residuals = keeps_residuals(o);
  const int64_t world = pg->getSize(), rank = pg->getRank();
  std::vector<std::vector<kernels::BlockRef>> to_owner(static_cast<size_t>(world));
  int64_t offset = 0;
  for (const at::Tensor& p : b.getParameters()) {
    auto it = mem.index_of.find(p.unsafeGetTensorImpl());
    TORCH_CHECK_VALUE(it != mem.index_of.end(), kScatterWho, ": a parameter of DDP's bucket (of ",
                      "shape ", p.sizes(),
                      ") is not one of the ZeroRedundancyOptimizer's "
                      "parameters: build the optimizer over ddp.parameters()");
    L->impls.push_back(p.unsafeGetTensorImpl());
    L->indices.push_back(it->second);
    L->offsets.push_back(offset);
    L->lengths.push_back(p.numel());
    for (const optim::ZeroPiece& piece : zero.pieces(static_cast<size_t>(it->second))) {
      auto& refs = to_owner[static_cast<size_t>(piece.owner)];
      // Raw values travel by piece (merged with the previous one where they touch); quantized
      // ones in blocks of block_size from the piece's start (the last may be short).
      const int64_t step = quantizes(o) ? o.block_size : piece.end - piece.begin;
      for (int64_t at = piece.begin; at < piece.end; at += step) {
        const int64_t len = std::min(step, piece.end - at);
        if (!quantizes(o) && !refs.empty() && refs.back().begin + refs.back().len == offset + at) {
          refs.back().len += len;
        } else {
          refs.push_back({offset + at, len, 0});
        }
      }
    }
    offset += p.numel();
  }
  TORCH_CHECK(offset == n, kScatterWho, ": the bucket's parameters hold ", offset,
              " values and its buffer ", n);
  // This rank's sum is packed back to back in its blocks' order (bucket order).
  const auto& mine = to_owner[static_cast<size_t>(rank)];
  std::vector<int64_t> owned_offsets;
  int64_t owned_values = 0;
  for (const auto& r : mine) {
    owned_offsets.push_back(owned_values);
    auto& runs = L->owned_runs;
    if (!runs.empty() && runs.back().begin + runs.back().len == r.begin) {
      runs.back().len += r.len;
    } else {
      runs.push_back({r.begin, r.len, owned_values});
    }
    owned_values += r.len;
  }
  for (int64_t j = 0; j < world; ++j) {
    if (j == rank) continue;
    for (const auto& r : to_owner[static_cast<size_t>(j)]) L->sent_values += r.len;
  }
  const comm::RawCodec raw(options.dtype().toScalarType());
  kernels::QuantSpec spec;
  spec.bits = static_cast<int>(o.bits == 32 ? 8 : o.bits);
  spec.block = o.block_size;
  const comm::QuantCodec quant(spec);
  L->plan = std::make_shared<const comm::ShardPlan>(
      world, rank, std::move(to_owner), owned_offsets, owned_values,
      quantizes(o) ? static_cast<const comm::Codec&>(quant) : raw, options.device());
  return L;
}
}  // namespace

ScatterBucket& ReduceScatterMemory::bucket_for(const c10d::GradBucket& b, int64_t n,
                                               const ProcessGroupPtr& pg,
                                               const optim::ZeroLayout& zero,
                                               const ReduceScatterOptions& o,
                                               const at::TensorOptions& options) {
  std::vector<const void*> impls;
  for (const at::Tensor& p : b.getParameters()) impls.push_back(p.unsafeGetTensorImpl());
  const size_t index = b.getIndex();
  auto it = live.find(index);
  if (it != live.end()) {
    const ScatterLayout& L = *it->second.layout;
    if (L.impls == impls && L.n == n && L.bits == o.bits && L.block == o.block_size &&
        L.residuals == keeps_residuals(o)) {
      return it->second;
    }
  }
  // A new layout. If one of its parameters is still held by a layout (DDP rebuilt its buckets,
  // or new options), every bucket's residuals go back to per-parameter form first, then this one
  // takes its parameters'. (Parking on every miss would rebuild each bucket on every step: the
  // first bucket's layout would park the second's, and so on.)
  bool held = it != live.end();
  for (const auto& entry : live) {
    const auto& other = entry.second.layout->impls;
    for (const void* p : impls) {
      held = held || std::find(other.begin(), other.end(), p) != other.end();
    }
  }
  if (held) park_all();
  index_params(zero);
  ScatterBucket q;
  q.layout = make_scatter_layout(b, n, pg, zero, *this, o, options);
  ++layouts_built;
  const ScatterLayout& L = *q.layout;
  if (L.residuals) {
    q.residual = at::zeros({n}, options.dtype(at::kFloat));
    for (size_t i = 0; i < L.indices.size(); ++i) {
      auto r = parked.find(L.indices[i]);
      if (r == parked.end()) continue;
      TORCH_CHECK_VALUE(r->second.numel() == L.lengths[i], kScatterWho, ": the residual of ",
                        "parameter ", L.indices[i], " has ", r->second.numel(),
                        " values, the parameter ", L.lengths[i]);
      q.residual.narrow(0, L.offsets[i], L.lengths[i]).copy_(r->second);
      parked.erase(r);
    }
  }
  return live[index] = std::move(q);
}

void ReduceScatterMemory::park_all() {
  for (const auto& entry : live) {
    const ScatterBucket& b = entry.second;
    if (!b.residual.defined()) continue;
    const ScatterLayout& L = *b.layout;
    for (size_t i = 0; i < L.indices.size(); ++i) {
      parked[L.indices[i]] = b.residual.narrow(0, L.offsets[i], L.lengths[i]).clone();
    }
  }
  live.clear();
}

std::map<int64_t, at::Tensor> ReduceScatterMemory::residuals() const {
  std::map<int64_t, at::Tensor> out;
  for (const auto& [k, t] : parked) out[k] = t.detach().cpu().clone();
  for (const auto& entry : live) {
    const ScatterBucket& b = entry.second;
    if (!b.residual.defined()) continue;
    const ScatterLayout& L = *b.layout;
    for (size_t i = 0; i < L.indices.size(); ++i) {
      out[L.indices[i]] = b.residual.narrow(0, L.offsets[i], L.lengths[i]).detach().cpu().clone();
    }
  }
  return out;
}

}  // namespace detail

ReduceScatterState::ReduceScatterState(ProcessGroupPtr process_group,
                                       std::shared_ptr<const optim::ZeroLayout> layout,
                                       ReduceScatterOptions options)
    : pg_(std::move(process_group)), layout_(std::move(layout)), options_(options) {
  TORCH_CHECK_TYPE(pg_, kScatterWho, ": process_group must be a ProcessGroup, got null");
  TORCH_CHECK_TYPE(layout_, kScatterWho, ": the ZeRO layout must not be null");
  TORCH_CHECK_VALUE(layout_->world_size() == pg_->getSize() && layout_->rank() == pg_->getRank(),
                    kScatterWho, ": the ZeRO partition is for rank ", layout_->rank(), " of ",
                    layout_->world_size(), ", the process group's rank is ", pg_->getRank(), " of ",
                    pg_->getSize());
  options_.validate();
  memory_ = std::make_unique<detail::ReduceScatterMemory>(*layout_);
}

ReduceScatterState::~ReduceScatterState() = default;

void ReduceScatterState::set_options(const ReduceScatterOptions& options) {
  options.validate();
  options_ = options;
  ++epoch_;
}

int64_t ReduceScatterState::sent_elements() const { return memory_->sent_elements; }
int64_t ReduceScatterState::sent_bytes() const { return memory_->sent_bytes; }
int64_t ReduceScatterState::layouts_built() const { return memory_->layouts_built; }

std::map<int64_t, at::Tensor> ReduceScatterState::residuals() const { return memory_->residuals(); }

c10::impl::GenericDict ReduceScatterState::state_dict() const {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("format", std::string(kScatterFormat));
  d.insert("bits", options_.bits);
  d.insert("block_size", options_.block_size);
  d.insert("use_error_feedback", options_.use_error_feedback);
  d.insert("rank", static_cast<int64_t>(pg_->getRank()));
  d.insert("world_size", static_cast<int64_t>(pg_->getSize()));
  c10::impl::GenericDict residuals(c10::IntType::get(), c10::TensorType::get());
  for (const auto& [k, t] : memory_->residuals()) residuals.insert(k, t);
  d.insert("residuals", residuals);
  return d;
}

void ReduceScatterState::load_state_dict(const c10::impl::GenericDict& d, bool allow_reshard) {
  const detail::CheckpointReader in(d, "ReduceScatterState.load_state_dict");
  TORCH_CHECK_VALUE(in.get_string("format") == kScatterFormat,
                    "ReduceScatterState.load_state_dict: not a ddpx reduce_scatter_hook state");
  ReduceScatterOptions o;
  o.bits = in.get_int("bits");
  o.block_size = in.get_int("block_size");
  o.use_error_feedback = in.get_bool("use_error_feedback");
  o.validate();
  auto residuals = in.get_tensors<int64_t>("residuals");
  if (!residuals.empty()) {
    const int64_t saved_rank = in.get_int("rank"), saved_world = in.get_int("world_size");
    TORCH_CHECK_VALUE(
        allow_reshard || (saved_rank == pg_->getRank() && saved_world == pg_->getSize()),
        "ReduceScatterState.load_state_dict: the residuals were saved by rank ", saved_rank, " of ",
        saved_world, ", and this is rank ", pg_->getRank(), " of ", pg_->getSize(),
        "; each rank's residuals are its own");
    const int64_t count = static_cast<int64_t>(layout_->params().size());
    for (const auto& [k, t] : residuals) {
      TORCH_CHECK_VALUE(k >= 0 && k < count && t.scalar_type() == at::kFloat && t.dim() == 1 &&
                            t.numel() == layout_->params()[static_cast<size_t>(k)].numel(),
                        "ReduceScatterState.load_state_dict: the residual of parameter ", k,
                        " does not fit this optimizer's parameters (", count, " of them)");
    }
  }
  options_ = o;
  ++epoch_;
  memory_->live.clear();
  memory_->parked = std::map<int64_t, at::Tensor>(residuals.begin(), residuals.end());
}

ReduceScatterHook::ReduceScatterHook(std::shared_ptr<ReduceScatterState> state)
    : state_(std::move(state)) {
  TORCH_CHECK_TYPE(state_ != nullptr, kScatterWho, ": state must be a ReduceScatterState");
}

c10::intrusive_ptr<c10::ivalue::Future> ReduceScatterHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name());
  ReduceScatterState& st = *state_;
  const ProcessGroupPtr& pg = st.process_group();
  const ReduceScatterOptions o = st.options();
  detail::agree_once(agreed_epoch_, pg, buffer.device(), st.epoch(), [&] {
    return detail::Fingerprint(name())
        .add("bits", o.bits)
        .add("block_size", o.block_size)
        .add("use_error_feedback", o.use_error_feedback)
        .add_choice("partition", static_cast<int64_t>(st.layout().partition()),
                    {"sorted_greedy", "balanced"});
  });
  const int64_t n = buffer.numel();
  if (pg->getSize() == 1 || n == 0) return detail::completed_future(buffer);
  detail::ReduceScatterMemory& mem = st.memory();
  const detail::ScatterBucket& b = mem.bucket_for(bucket, n, pg, st.layout(), o, buffer.options());
  const std::shared_ptr<const detail::ScatterLayout> layout = b.layout;
  std::shared_ptr<const comm::Codec> codec;
  if (o.bits == 32) {
    codec = std::make_shared<const comm::RawCodec>(buffer.scalar_type());
  } else {
    kernels::QuantSpec spec;
    spec.bits = static_cast<int>(o.bits);
    spec.block = o.block_size;
    codec = std::make_shared<const comm::QuantCodec>(spec);
  }
  auto scatter =
      std::make_shared<comm::OwnerScatter>(pg, layout->plan, codec, buffer, b.residual, 0);
  mem.sent_elements += layout->sent_values;
  mem.sent_bytes += layout->plan->scatter_send_bytes();
  const double inv_world = 1.0 / static_cast<double>(pg->getSize());
  const at::ScalarType acc = codec->sum_dtype(buffer.scalar_type());
  return scatter->sent()->then(
      [scatter, layout, buffer, inv_world, acc](c10::ivalue::Future&) {
        // The owner's mean of its values, then the bucket: that mean there, zeros elsewhere.
        const at::Tensor sum = at::empty({layout->plan->owned_values}, buffer.options().dtype(acc));
        scatter->sum_into(sum, inv_world, comm::TermStreams{});
        const at::Tensor mean = sum.to(buffer.scalar_type());
        int64_t at = 0;
        for (const auto& r : layout->owned_runs) {
          if (r.begin > at) buffer.narrow(0, at, r.begin - at).zero_();
          buffer.narrow(0, r.begin, r.len).copy_(mean.narrow(0, r.offset, r.len));
          at = r.begin + r.len;
        }
        if (at < buffer.numel()) buffer.narrow(0, at, buffer.numel() - at).zero_();
        return c10::IValue(buffer);
      },
      c10::TensorType::get());
}

CommHookPtr reduce_scatter_hook(std::shared_ptr<ReduceScatterState> state) {
  return std::make_shared<ReduceScatterHook>(std::move(state));
}

}  // namespace hooks
}  // namespace ddpx
