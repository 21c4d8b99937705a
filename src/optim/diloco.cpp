// DiLoCo and Streaming DiLoCo (include/ddpx/optim/diloco.h). The outer gradients of a fragment
// go to a ddpx hook as GradBuckets of whole parameters, so that they travel as DDP's gradients
// do: allreduce_hook's mean (fp32), bf16_compress_hook's, or quantized_hook's with a residual
// per rank (one QuantizedState per fragment: its parameter keys are assigned in the fragment's
// own bucket order, the same after a restart whichever fragment synchronizes first).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ddpx/common/compat.h>
#include <ddpx/hooks/allreduce_hook.h>
#include <ddpx/hooks/compress_hook.h>
#include <ddpx/hooks/quantized_hook.h>
#include <ddpx/optim/diloco.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "hooks/agreement.h"
#include "hooks/checkpoint_reader.h"

namespace ddpx {
namespace optim {

namespace {
constexpr const char* kWho = "DiLoCo";
constexpr const char* kFormat = "ddpx.DiLoCo/1";

bool quantizes(const DiLoCoOptions& o) { return o.bits <= 8; }

hooks::QuantizedOptions quantized_options(const DiLoCoOptions& o) {
  hooks::QuantizedOptions q;
  q.bits = o.bits;
  q.block_size = o.block_size;
  q.use_error_feedback = o.use_error_feedback;
  q.start_iter = 0;  // every synchronization quantized: no warm-up of plain allreduces
  return q;
}
}  // namespace

void DiLoCoOptions::validate() const {
  TORCH_CHECK_VALUE(sync_every >= 1, kWho, ": sync_every must be at least 1, got ", sync_every);
  TORCH_CHECK_VALUE(fragments >= 1, kWho, ": fragments must be at least 1, got ", fragments);
  TORCH_CHECK_VALUE(fragments <= sync_every, kWho, ": fragments (", fragments,
                    ") must be at most sync_every (", sync_every,
                    "): each fragment synchronizes at its own step of the sync_every steps");
  TORCH_CHECK_VALUE(fragment_sync_delay >= 0 && fragment_sync_delay < sync_every, kWho,
                    ": fragment_sync_delay must be in [0, sync_every) = [0, ", sync_every,
                    "), got ", fragment_sync_delay,
                    " (a fragment's exchange lands before its next synchronization)");
  TORCH_CHECK_VALUE(fragment_update_alpha >= 0.0 && fragment_update_alpha <= 1.0, kWho,
                    ": fragment_update_alpha must be in [0, 1], got ", fragment_update_alpha);
  TORCH_CHECK_VALUE(bits == 32 || bits == 16 || bits == 8 || bits == 4 || bits == 2 || bits == 1,
                    kWho, ": bits must be 32 (fp32), 16 (bf16), 8, 4, 2 or 1, got ", bits);
  TORCH_CHECK_VALUE(bucket_cap_bytes > 0, kWho, ": bucket_cap_bytes must be positive, got ",
                    bucket_cap_bytes);
  if (quantizes(*this)) hooks::validate(quantized_options(*this));
}

// One fragment: its parameters [first, last), its buckets over `delta` (the flat fp32 outer
// gradient), the hook that exchanges them and the exchange in flight.
struct DiLoCoSync::Fragment {
  int64_t first = 0, last = 0;
  at::Tensor delta;
  struct Bucket {
    int64_t begin = 0, n = 0;  // in delta
    std::vector<at::Tensor> params;
    std::vector<size_t> offsets, lengths;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<c10::IntArrayRef> sizes;  // into shapes: GradBucket keeps IntArrayRefs
  };
  std::vector<Bucket> buckets;
  hooks::CommHookPtr hook;
  hooks::QuantizedStatePtr quantized;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> inflight;
  int64_t due = -1;  // the step of the pending outer step; -1: none pending
};

DiLoCoSync::DiLoCoSync(std::vector<at::Tensor> params, ProcessGroupPtr process_group,
                       DiLoCoOptions options)
    : params_(std::move(params)), pg_(std::move(process_group)), options_(options) {
  TORCH_CHECK_TYPE(pg_, kWho, ": process_group must be a ProcessGroup, got null");
  options_.validate();
  TORCH_CHECK_VALUE(!params_.empty(), kWho, ": no parameters to synchronize");
  const auto P = static_cast<int64_t>(params_.size());
  TORCH_CHECK_VALUE(options_.fragments <= P, kWho, ": fragments (", options_.fragments,
                    ") must be at most the number of parameters (", P, ")");
  int64_t total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK_VALUE(p.defined() && p.is_floating_point() && !p.is_sparse(), kWho, ": parameter ",
                      i, " must be a dense floating-point tensor");
    TORCH_CHECK_VALUE(p.scalar_type() != at::kDouble || !quantizes(options_), kWho, ": parameter ",
                      i, " is float64, which the quantized exchange (bits ", options_.bits,
                      ") does not take; use bits=32");
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(!params_[j].is_same(p), kWho, ": parameter ", i,
                        " is listed twice (also at ", j, ")");
    }
    total += p.numel();
  }
  {
    at::NoGradGuard no_grad;
    for (const at::Tensor& p : params_) global_.push_back(p.detach().clone());
  }
  // Contiguous fragments of about total / P values each: fragment f ends at the first parameter
  // whose end reaches (f + 1) * total / P, leaving at least one parameter per later fragment.
  int64_t at = 0, begin_param = 0;
  for (int64_t f = 0; f < options_.fragments; ++f) {
    auto frag = std::make_unique<Fragment>();
    frag->first = begin_param;
    int64_t end_param = begin_param;
    const int64_t target = (f + 1) * total / options_.fragments;
    const int64_t keep_for_later = options_.fragments - 1 - f;
    while (end_param < P - keep_for_later &&
           (end_param == begin_param || at < target || f == options_.fragments - 1)) {
      at += params_[static_cast<size_t>(end_param)].numel();
      ++end_param;
    }
    frag->last = end_param;
    begin_param = end_param;
    fragments_.push_back(std::move(frag));
  }
  for (auto& fp : fragments_) {
    Fragment& f = *fp;
    int64_t n = 0;
    const bool fp64 =
        std::any_of(params_.begin() + f.first, params_.begin() + f.last,
                    [](const at::Tensor& p) { return p.scalar_type() == at::kDouble; });
    // Whole parameters per bucket, up to bucket_cap_bytes of fp32 (a larger one alone).
    const int64_t cap_values = std::max<int64_t>(1, options_.bucket_cap_bytes / 4);
    for (int64_t i = f.first; i < f.last; ++i) {
      const at::Tensor& p = params_[static_cast<size_t>(i)];
      if (f.buckets.empty() ||
          (f.buckets.back().n > 0 && f.buckets.back().n + p.numel() > cap_values)) {
        f.buckets.emplace_back();
        f.buckets.back().begin = n;
      }
      auto& b = f.buckets.back();
      b.params.push_back(p);
      b.offsets.push_back(static_cast<size_t>(b.n));
      b.lengths.push_back(static_cast<size_t>(p.numel()));
      b.shapes.emplace_back(p.sizes().begin(), p.sizes().end());
      b.n += p.numel();
      n += p.numel();
    }
    for (auto& b : f.buckets) {
      for (const auto& s : b.shapes) b.sizes.emplace_back(s);
    }
    f.delta = at::zeros({n}, params_[static_cast<size_t>(f.first)].options().dtype(
                                 fp64 ? at::kDouble : at::kFloat));
    if (options_.bits == 32) {
      f.hook = hooks::allreduce_hook(pg_);
    } else if (options_.bits == 16) {
      f.hook = hooks::bf16_compress_hook(pg_);
    } else {
      f.quantized = std::make_shared<hooks::QuantizedState>(pg_, quantized_options(options_));
      f.hook = hooks::quantized_hook(f.quantized);
    }
  }
}

DiLoCoSync::~DiLoCoSync() {
  // Exchanges still in flight hold the fragments' buffers: let them land first.
  for (auto& f : fragments_) {
    for (auto& fut : f->inflight) {
      try {
        fut->wait();
      } catch (...) {  // a failed exchange: nothing to keep
      }
    }
  }
}

int64_t DiLoCoSync::first_sync_step(int64_t fragment) const {
  check_fragment(fragment);
  return (fragment + 1) * options_.sync_every / options_.fragments;
}

void DiLoCoSync::check_fragment(int64_t fragment) const {
  TORCH_CHECK_INDEX(fragment >= 0 && fragment < static_cast<int64_t>(fragments_.size()), kWho,
                    ": fragment ", fragment, " out of range [0, ", fragments_.size(), ")");
}

std::vector<std::pair<int64_t, int64_t>> DiLoCoSync::fragment_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& f : fragments_) out.emplace_back(f->first, f->last);
  return out;
}

std::vector<int64_t> DiLoCoSync::pending() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < fragments_.size(); ++i) {
    if (fragments_[i]->due >= 0) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

void DiLoCoSync::start_exchange(Fragment& f) {
  if (!agreed_) {
    // Ranks built with other schedules would exchange different fragments at different steps:
    // one all-gather before the first exchange names the option instead.
    hooks::detail::Fingerprint fingerprint(kWho);
    options_.for_each_field([&](const char* name, auto value) { fingerprint.add(name, value); });
    fingerprint.add("parameters", static_cast<int64_t>(params_.size())).add("step", step_);
    hooks::detail::check_agreement(pg_, fingerprint, f.delta.device());
    agreed_ = true;
  }
  {
    at::NoGradGuard no_grad;
    // The outer gradient: global minus local, in the buffer's dtype.
    for (int64_t i = f.first, off = 0; i < f.last; ++i) {
      const at::Tensor& p = params_[static_cast<size_t>(i)];
      at::Tensor d = f.delta.narrow(0, off, p.numel()).view(p.sizes());
      d.copy_(global_[static_cast<size_t>(i)]);
      d.sub_(p.detach());
      off += p.numel();
    }
  }
  const auto count = f.buckets.size();
  const double before = f.quantized ? std::get<2>(f.quantized->compression_stats()) : 0.0;
  f.inflight.clear();
  for (size_t k = 0; k < count; ++k) {
    auto& b = f.buckets[k];
    at::Tensor buffer = f.delta.narrow(0, b.begin, b.n);
    c10d::GradBucket bucket =
        compat::make_grad_bucket(k, count, buffer, b.offsets, b.lengths, b.sizes, b.params);
    f.inflight.push_back(f.hook->runHook(bucket));
    if (!f.quantized) message_bytes_ += b.n * (options_.bits == 16 ? 2 : f.delta.element_size());
  }
  if (f.quantized) {
    message_bytes_ += static_cast<int64_t>(std::get<2>(f.quantized->compression_stats()) - before);
  }
  f.due = step_ + options_.fragment_sync_delay;
}

void DiLoCoSync::wait_exchange(Fragment& f) {
  for (size_t k = 0; k < f.inflight.size(); ++k) {
    auto& fut = f.inflight[k];
    fut->wait();
    TORCH_CHECK(!fut->hasError(), kWho,
                ": the exchange of an outer gradient failed: ", fut->tryRetrieveErrorMessage());
    at::Tensor mean = f.hook->parseHookResult(fut->value());
    at::Tensor buffer = f.delta.narrow(0, f.buckets[k].begin, f.buckets[k].n);
    if (!mean.is_same(buffer)) buffer.copy_(mean.view(-1));
  }
  f.inflight.clear();
}

std::vector<int64_t> DiLoCoSync::after_inner_step() {
  TORCH_CHECK(open_ < 0, kWho, ": after_inner_step between begin_outer and end_outer");
  ++step_;
  std::vector<int64_t> due;
  for (size_t i = 0; i < fragments_.size(); ++i) {
    Fragment& f = *fragments_[i];
    const int64_t first = first_sync_step(static_cast<int64_t>(i));
    if (step_ >= first && (step_ - first) % options_.sync_every == 0) {
      TORCH_CHECK(f.due < 0, kWho, ": fragment ", i, " is due to synchronize at step ", step_,
                  " while its previous exchange is still pending");
      start_exchange(f);
    }
  }
  for (size_t i = 0; i < fragments_.size(); ++i) {
    if (fragments_[i]->due == step_) due.push_back(static_cast<int64_t>(i));
  }
  return due;
}

void DiLoCoSync::begin_outer(int64_t fragment) {
  check_fragment(fragment);
  TORCH_CHECK(open_ < 0, kWho, ": begin_outer(", fragment, ") while fragment ", open_,
              "'s outer step is open");
  Fragment& f = *fragments_[static_cast<size_t>(fragment)];
  TORCH_CHECK(f.due >= 0, kWho, ": fragment ", fragment, " has no pending outer gradient");
  wait_exchange(f);
  at::NoGradGuard no_grad;
  open_local_.clear();
  open_grads_.clear();
  for (at::Tensor& p : params_) {
    open_grads_.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  const bool mixes = options_.fragment_update_alpha != 0.0;
  for (int64_t i = f.first, off = 0; i < f.last; ++i) {
    at::Tensor& p = params_[static_cast<size_t>(i)];
    // The local values are needed only to mix them back in (end_outer).
    if (mixes) open_local_.push_back(p.detach().clone());
    p.detach().copy_(global_[static_cast<size_t>(i)]);
    // The averaged outer gradient itself where the dtypes agree: the buffer is not read again
    // before the fragment's next exchange overwrites it.
    const at::Tensor d = f.delta.narrow(0, off, p.numel()).view(p.sizes());
    p.mutable_grad() = d.scalar_type() == p.scalar_type() ? d : d.to(p.scalar_type());
    off += p.numel();
  }
  open_ = fragment;
}

void DiLoCoSync::end_outer(int64_t fragment) {
  check_fragment(fragment);
  TORCH_CHECK(open_ == fragment, kWho, ": end_outer(", fragment, ") without begin_outer(", fragment,
              ")");
  Fragment& f = *fragments_[static_cast<size_t>(fragment)];
  at::NoGradGuard no_grad;
  const double alpha = options_.fragment_update_alpha;
  for (int64_t i = f.first; i < f.last; ++i) {
    at::Tensor p = params_[static_cast<size_t>(i)].detach();
    global_[static_cast<size_t>(i)].copy_(p);
    if (alpha != 0.0) {
      // local = alpha * local + (1 - alpha) * global
      const at::Tensor& local = open_local_[static_cast<size_t>(i - f.first)];
      p.mul_(1.0 - alpha).add_(local, alpha);
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = open_grads_[i];
  open_local_.clear();
  open_grads_.clear();
  f.due = -1;
  open_ = -1;
}

void DiLoCoSync::outer_sgd_step(int64_t fragment, const SGDOptions& options,
                                std::vector<at::Tensor>& momentum_buffers) {
  TORCH_CHECK_VALUE(momentum_buffers.size() == params_.size(), kWho, ": ", momentum_buffers.size(),
                    " momentum buffers for ", params_.size(), " parameters");
  options.validate();
  begin_outer(fragment);
  const Fragment& f = *fragments_[static_cast<size_t>(fragment)];
  std::vector<at::Tensor> ps, gs, bufs;
  for (int64_t i = f.first; i < f.last; ++i) {
    ps.push_back(params_[static_cast<size_t>(i)].detach());
    gs.push_back(params_[static_cast<size_t>(i)].grad());
    bufs.push_back(momentum_buffers[static_cast<size_t>(i)]);
  }
  try {
    at::NoGradGuard no_grad;
    sgd_step(ps, gs, bufs, options);
  } catch (...) {
    end_outer(fragment);
    throw;
  }
  for (int64_t i = f.first; i < f.last; ++i) {
    momentum_buffers[static_cast<size_t>(i)] = bufs[static_cast<size_t>(i - f.first)];
  }
  end_outer(fragment);
}

c10::impl::GenericDict DiLoCoSync::state_dict() {
  TORCH_CHECK(open_ < 0, kWho, ": state_dict between begin_outer and end_outer");
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("format", std::string(kFormat));
  options_.for_each_field([&](const char* name, auto value) { d.insert(name, value); });
  d.insert("step", step_);
  d.insert("rank", static_cast<int64_t>(pg_->getRank()));
  d.insert("world_size", static_cast<int64_t>(pg_->getSize()));
  c10::impl::GenericDict global(c10::IntType::get(), c10::TensorType::get());
  for (size_t i = 0; i < global_.size(); ++i) {
    global.insert(static_cast<int64_t>(i), global_[i].detach().cpu().clone());
  }
  d.insert("global", global);
  c10::impl::GenericDict pending(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericDict quantized(c10::IntType::get(), c10::AnyType::get());
  for (size_t i = 0; i < fragments_.size(); ++i) {
    Fragment& f = *fragments_[i];
    if (f.due >= 0) {
      wait_exchange(f);
      c10::impl::GenericDict p(c10::StringType::get(), c10::AnyType::get());
      p.insert("due", f.due);
      p.insert("outer_gradient", f.delta.detach().cpu().clone());
      pending.insert(static_cast<int64_t>(i), p);
    }
    if (f.quantized) quantized.insert(static_cast<int64_t>(i), f.quantized->state_dict());
  }
  d.insert("pending", pending);
  d.insert("quantized", quantized);
  return d;
}

void DiLoCoSync::load_state_dict(const c10::impl::GenericDict& d, bool allow_reshard) {
  TORCH_CHECK(open_ < 0, kWho, ": load_state_dict between begin_outer and end_outer");
  const hooks::detail::CheckpointReader in(d, "DiLoCo.load_state_dict");
  TORCH_CHECK_VALUE(in.get_string("format") == kFormat,
                    "DiLoCo.load_state_dict: not a ddpx DiLoCo state");
  options_.for_each_field([&](const char* key, auto mine) {
    using T = decltype(mine);
    T saved;
    if constexpr (std::is_same_v<T, bool>) {
      saved = in.get_bool(key);
    } else if constexpr (std::is_same_v<T, double>) {
      saved = in.get_double(key);
    } else {
      saved = in.get_int(key);
    }
    TORCH_CHECK_VALUE(saved == mine, "DiLoCo.load_state_dict: the state was saved with ", key, "=",
                      saved, ", this DiLoCo has ", key, "=", mine);
  });
  const int64_t step = in.get_int("step");
  TORCH_CHECK_VALUE(step >= 0, "DiLoCo.load_state_dict: step must be >= 0, got ", step);
  auto global = in.get_tensors<int64_t>("global");
  TORCH_CHECK_VALUE(global.size() == params_.size(), "DiLoCo.load_state_dict: ", global.size(),
                    " global parameters saved, this DiLoCo has ", params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto it = global.find(static_cast<int64_t>(i));
    TORCH_CHECK_VALUE(it != global.end() && it->second.sizes() == params_[i].sizes(),
                      "DiLoCo.load_state_dict: global parameter ", i,
                      " is missing or not of the parameter's shape ", params_[i].sizes());
  }
  const c10::IValue pv = in.get("pending");
  TORCH_CHECK_TYPE(pv.isGenericDict(), "DiLoCo.load_state_dict: 'pending' must be a dict");
  const c10::IValue qv = in.get("quantized");
  TORCH_CHECK_TYPE(qv.isGenericDict(), "DiLoCo.load_state_dict: 'quantized' must be a dict");
  const int64_t saved_rank = in.get_int("rank"), saved_world = in.get_int("world_size");
  const bool same_rank = saved_rank == pg_->getRank() && saved_world == pg_->getSize();
  // The pending outer gradients, checked before anything changes.
  std::vector<std::tuple<int64_t, int64_t, at::Tensor>> pending;
  for (const auto& kv : pv.toGenericDict()) {
    TORCH_CHECK_TYPE(kv.key().isInt() && kv.value().isGenericDict(),
                     "DiLoCo.load_state_dict: 'pending' must map fragments to dicts");
    const int64_t i = kv.key().toInt();
    check_fragment(i);
    const c10::impl::GenericDict entry = kv.value().toGenericDict();  // the reader keeps a ref
    const hooks::detail::CheckpointReader p(entry, "DiLoCo.load_state_dict");
    const c10::IValue g = p.get("outer_gradient");
    TORCH_CHECK_TYPE(g.isTensor(), "DiLoCo.load_state_dict: 'outer_gradient' must be a tensor");
    const int64_t n = fragments_[static_cast<size_t>(i)]->delta.numel();
    TORCH_CHECK_VALUE(g.toTensor().numel() == n, "DiLoCo.load_state_dict: the pending outer ",
                      "gradient of fragment ", i, " has ", g.toTensor().numel(),
                      " values, the fragment ", n);
    const int64_t due = p.get_int("due");
    TORCH_CHECK_VALUE(due >= step, "DiLoCo.load_state_dict: fragment ", i, " is due at step ", due,
                      ", before the saved step ", step);
    pending.emplace_back(i, due, g.toTensor());
  }
  for (const auto& kv : qv.toGenericDict()) {
    TORCH_CHECK_TYPE(kv.key().isInt() && kv.value().isGenericDict(),
                     "DiLoCo.load_state_dict: 'quantized' must map fragments to dicts");
    check_fragment(kv.key().toInt());
  }
  // Everything checked: now change the state (the quantized states check their own).
  for (auto& f : fragments_) wait_exchange(*f);
  for (const auto& kv : qv.toGenericDict()) {
    const int64_t i = kv.key().toInt();
    check_fragment(i);
    Fragment& f = *fragments_[static_cast<size_t>(i)];
    TORCH_CHECK_VALUE(f.quantized, "DiLoCo.load_state_dict: quantized state for fragment ", i,
                      " of a DiLoCo that does not quantize");
    if (!same_rank && allow_reshard) {
      TORCH_WARN("DiLoCo.load_state_dict: the residuals were saved by rank ", saved_rank, " of ",
                 saved_world, "; they restart from zero on rank ", pg_->getRank(), " of ",
                 pg_->getSize());
      f.quantized = std::make_shared<hooks::QuantizedState>(pg_, quantized_options(options_));
      f.hook = hooks::quantized_hook(f.quantized);
      continue;
    }
    f.quantized->load_state_dict(kv.value().toGenericDict(), allow_reshard);
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < global_.size(); ++i) global_[i].copy_(global[static_cast<int64_t>(i)]);
  for (auto& f : fragments_) f->due = -1;
  for (const auto& [i, due, g] : pending) {
    Fragment& f = *fragments_[static_cast<size_t>(i)];
    f.delta.copy_(g);
    f.due = due;
  }
  step_ = step;
  agreed_ = false;
}

// --- DiLoCo ---

SGDOptions DiLoCo::default_outer() {
  SGDOptions o;
  o.lr = 0.7;
  o.momentum = 0.9;
  o.nesterov = true;
  return o;
}

namespace {
std::vector<at::Tensor> inner_params(const std::shared_ptr<torch::optim::Optimizer>& inner) {
  TORCH_CHECK_TYPE(inner != nullptr, kWho, ": the inner optimizer must not be null");
  std::vector<at::Tensor> out;
  for (const auto& g : inner->param_groups()) {
    for (const auto& p : g.params()) out.push_back(p);
  }
  return out;
}
}  // namespace

DiLoCo::DiLoCo(std::shared_ptr<torch::optim::Optimizer> inner, ProcessGroupPtr process_group,
               DiLoCoOptions options, SGDOptions outer)
    : inner_(std::move(inner)),
      sync_(std::make_unique<DiLoCoSync>(inner_params(inner_), std::move(process_group), options)),
      outer_(outer),
      momentum_(sync_->params().size()) {
  outer_.validate();
}

void DiLoCo::set_outer_options(const SGDOptions& outer) {
  outer.validate();
  outer_ = outer;
}

at::Tensor DiLoCo::step(torch::optim::Optimizer::LossClosure closure) {
  at::Tensor loss = inner_->step(std::move(closure));
  for (const int64_t f : sync_->after_inner_step()) sync_->outer_sgd_step(f, outer_, momentum_);
  return loss;
}

void DiLoCo::zero_grad(bool set_to_none) { compat::zero_grad(*inner_, set_to_none); }

std::vector<torch::optim::OptimizerParamGroup>& DiLoCo::param_groups() {
  return inner_->param_groups();
}

void DiLoCo::save(torch::serialize::OutputArchive& archive) {
  inner_->save(archive);
  torch::serialize::OutputArchive mine;
  mine.write("state", c10::IValue(sync_->state_dict()));
  for (size_t i = 0; i < momentum_.size(); ++i) {
    if (momentum_[i].defined()) mine.write("momentum_" + std::to_string(i), momentum_[i]);
  }
  archive.write(kStateKey, mine);
}

void DiLoCo::load(torch::serialize::InputArchive& archive, bool allow_reshard) {
  torch::serialize::InputArchive mine;
  TORCH_CHECK_VALUE(archive.try_read(kStateKey, mine), kWho, ": the archive has no '", kStateKey,
                    "' (not saved by ddpx::optim::DiLoCo::save)");
  c10::IValue state;
  mine.read("state", state);
  TORCH_CHECK_TYPE(state.isGenericDict(), kWho, ": the archive's state is not a dict");
  sync_->load_state_dict(state.toGenericDict(), allow_reshard);
  for (size_t i = 0; i < momentum_.size(); ++i) {
    at::Tensor t;
    momentum_[i] = mine.try_read("momentum_" + std::to_string(i), t) ? t : at::Tensor();
  }
  inner_->load(archive);
}

}  // namespace optim
}  // namespace ddpx
