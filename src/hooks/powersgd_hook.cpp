#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <ddpx/hooks/powersgd_hook.h>

#include <algorithm>
#include <cmath>

#include "comm/exchange.h"
#include "hooks/agreement.h"
#include "hooks/hook_utils.h"
#include "hooks/powersgd_memory.h"
#include "ops/cast.h"
#include "ops/lowrank.h"
#include "ops/orthogonalize.h"

namespace ddpx {
namespace hooks {

using comm::ExchangeMode;

using comm::ExchangeMode;
using comm::sum_into;
using detail::BucketLayout;
using detail::CompMatrix;
using detail::PowerSGDJob;
using detail::PowerSGDMemory;
using ops::error_feedback_apply_;
using ops::lowrank_project_;
using ops::lowrank_project_t_;
using ops::lowrank_reconstruct_;
using ops::MatrixPack;
using ops::orthogonalize_;
using ops::scaled_cast;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

namespace {

// Arithmetic dtype for a bucket: its own, except 16-bit on CPU (no half GEMM there), which
// computes in fp32 while P and Q still travel in the bucket's dtype.
at::ScalarType compute_dtype_for(const at::Tensor& input) {
  if (input.is_cuda()) return input.scalar_type();
  return input.element_size() == 2 ? at::kFloat : input.scalar_type();
}

std::string join_keys(const std::vector<int64_t>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size(); ++i) s += (i ? "," : "") + std::to_string(keys[i]);
  return s;
}

// Fills `dst` (a view) from the first memory found: live per-key memory, then a restored one.
// Returns whether one was found with the right number of elements.
template <typename Key>
bool claim_memory(const Key& key, const at::Tensor& dst, std::unordered_map<Key, at::Tensor>& live,
                  std::unordered_map<Key, at::Tensor>& restored) {
  auto it = live.find(key);
  if (it != live.end() && it->second.numel() == dst.numel()) {
    dst.copy_(it->second.reshape(dst.sizes()));
    return true;
  }
  auto rt = restored.find(key);
  if (rt != restored.end()) {
    at::Tensor src = rt->second;
    restored.erase(rt);
    if (src.numel() == dst.numel()) {
      dst.copy_(src.reshape(dst.sizes()));
      return true;
    }
  }
  return false;
}

// (n, m) of the matrix view torch uses: tensor.view(tensor.shape[0], -1).
std::pair<int64_t, int64_t> matrix_shape(const at::Tensor& g) {
  const int64_t n = g.dim() == 0 ? 1 : g.size(0);
  return {n, n == 0 ? 0 : g.numel() / n};
}

// What both hooks' layouts share: keys, dtypes, device, and where each gradient sits.
std::shared_ptr<BucketLayout> new_layout(const std::vector<int64_t>& keys,
                                         const std::vector<at::Tensor>& grads,
                                         const at::Tensor& input) {
  TORCH_CHECK(grads.size() == keys.size(), "PowerSGD: the bucket has ", grads.size(),
              " gradients but ", keys.size(), " parameters");
  auto L = std::make_shared<BucketLayout>();
  L->keys = keys;
  L->compute_dtype = compute_dtype_for(input);
  L->wire_dtype = input.scalar_type();
  L->device = input.device();
  const auto* base = static_cast<const char*>(input.data_ptr());
  for (const at::Tensor& g : grads) {
    L->offsets.push_back((static_cast<const char*>(g.data_ptr()) - base) /
                         static_cast<int64_t>(input.element_size()));
    L->numels.push_back(g.numel());
  }
  return L;
}

// Error-feedback residual buffer of `numel` elements; each parameter's slice takes over its
// memory (live, or from a checkpoint) and becomes its memory.
void claim_error_views(PowerSGDMemory& mem, BucketLayout& L, int64_t numel,
                       const at::TensorOptions& opts, const std::vector<at::Tensor>& grads) {
  L.error = at::zeros({numel}, opts);
  for (size_t i = 0; i < L.keys.size(); ++i) {
    at::Tensor view = L.error.narrow(0, L.offsets[i], L.numels[i]);
    // An error memory always has its parameter's size: another size means a corrupt checkpoint
    // or one saved for other parameter shapes (Q memories may differ: the rank may have changed).
    auto restored = mem.restored_error.find(L.keys[i]);
    TORCH_CHECK_VALUE(
        !mem.strict_restore || restored == mem.restored_error.end() ||
            restored->second.numel() == view.numel(),
        "PowerSGDState: the checkpoint's error-feedback memory for parameter ", L.keys[i], " has ",
        restored == mem.restored_error.end() ? 0 : restored->second.numel(),
        " elements, but that parameter has ", view.numel(), " (shape ", grads[i].sizes(),
        "): the checkpoint is corrupt or was saved for a model with other parameter "
        "shapes. Load it with load_state_dict(state_dict, strict=False) to drop the "
        "memories that do not fit");
    claim_memory(L.keys[i], view, mem.error, mem.restored_error);
    mem.error[L.keys[i]] = view;
  }
}

// Merges the uncompressed gradients into runs and, with two runs or more, lists their elements'
// bucket positions (see BucketLayout::uncompressed_runs).
void index_uncompressed(BucketLayout& L) {
  for (size_t i : L.uncompressed) {
    auto& runs = L.uncompressed_runs;
    if (!runs.empty() && runs.back().first + runs.back().second == L.offsets[i]) {
      runs.back().second += L.numels[i];
    } else {
      runs.emplace_back(L.offsets[i], L.numels[i]);
    }
  }
  if (L.uncompressed_runs.size() < 2) return;
  std::vector<int64_t> index;
  index.reserve(static_cast<size_t>(L.uncompressed_numel));
  for (const auto& run : L.uncompressed_runs) {
    for (int64_t k = 0; k < run.second; ++k) index.push_back(run.first + k);
  }
  L.uncompressed_index = at::tensor(index, at::kLong).to(L.device);
}

// The uncompressed gradients of `work` into `head` (packed runs), or back when `unpack`.
void copy_uncompressed(const BucketLayout& L, const at::Tensor& work, at::Tensor head,
                       bool unpack) {
  if (L.uncompressed_index.defined() && !unpack) {
    at::index_select_out(head, work, 0, L.uncompressed_index);
    return;
  }
  // index_copy_ is one launch on a GPU, but on CPU slower than copying a few long runs.
  if (L.uncompressed_index.defined() && !L.device.is_cpu()) {
    work.index_copy_(0, L.uncompressed_index, head);
    return;
  }
  int64_t pos = 0;
  for (const auto& run : L.uncompressed_runs) {
    at::Tensor in_work = work.narrow(0, run.first, run.second);
    at::Tensor in_head = head.narrow(0, pos, run.second);
    if (unpack) {
      in_work.copy_(in_head);
    } else {
      in_head.copy_(in_work);
    }
    pos += run.second;
  }
}

std::shared_ptr<BucketLayout> build_layerwise_layout(PowerSGDState& st,
                                                     const c10d::GradBucket& bucket,
                                                     const std::vector<int64_t>& keys,
                                                     const at::Tensor& input) {
  const auto& o = st.options();
  PowerSGDMemory& mem = st.memory();
  const std::vector<at::Tensor> grads = bucket.getGradients();
  auto L = new_layout(keys, grads, input);
  // Shapes in first-appearance order, each with its compressed gradients (torch's grouping).
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<size_t>>> shape_groups;
  std::vector<std::pair<int64_t, int64_t>> mshape(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    const auto nm = matrix_shape(g);
    mshape[i] = nm;
    const int64_t r = std::min({nm.first, nm.second, o.matrix_approximation_rank});
    const int64_t uncompressed = nm.first * nm.second, compressed = (nm.first + nm.second) * r;
    L->numel_before += uncompressed;
    if (static_cast<double>(compressed) * o.min_compression_rate <
        static_cast<double>(uncompressed)) {
      auto it = std::find_if(shape_groups.begin(), shape_groups.end(),
                             [&](const auto& e) { return e.first == nm; });
      if (it == shape_groups.end()) {
        shape_groups.push_back({nm, {}});
        it = std::prev(shape_groups.end());
      }
      it->second.push_back(i);
      L->numel_after += compressed;
    } else {
      L->uncompressed.push_back(i);
      L->uncompressed_numel += g.numel();
      L->numel_after += uncompressed;
    }
  }
  index_uncompressed(*L);
  std::vector<int64_t> p_rows, q_rows, ranks;  // Ps and Qs back to back, in comp's order
  for (const auto& sg : shape_groups) {
    const size_t begin = L->comp.size();
    for (size_t i : sg.second) {
      const int64_t n = mshape[i].first, m = mshape[i].second;
      const int64_t r = std::min({n, m, o.matrix_approximation_rank});
      L->comp.push_back(CompMatrix{i, n, m, r, L->total_p, L->total_q});
      p_rows.push_back(n);
      q_rows.push_back(m);
      ranks.push_back(r);
      L->total_p += n * r;
      L->total_q += m * r;
    }
    L->groups.emplace_back(begin, L->comp.size());
  }
  const auto opts = input.options().dtype(L->compute_dtype);
  L->round_one = at::empty({L->uncompressed_numel + L->total_p}, opts);
  L->q_factors = at::empty({L->total_q}, opts);
  L->p_pack = MatrixPack::back_to_back(p_rows, ranks, L->device, /*first=*/L->uncompressed_numel);
  L->q_pack = MatrixPack::back_to_back(q_rows, ranks, L->device);
  // Memories move to the new layout (after a bucket rebuild, or from a checkpoint).
  if (o.use_error_feedback) claim_error_views(mem, *L, input.numel(), opts, grads);
  bool all_q = !L->comp.empty();
  for (const auto& c : L->comp) {
    at::Tensor view = L->q_factors.narrow(0, c.q_offset, c.cols * c.rank);
    all_q = claim_memory(keys[c.index], view, mem.q, mem.restored_q) && all_q;
    mem.q[keys[c.index]] = view;
    mem.p[keys[c.index]] =
        L->round_one.narrow(0, L->uncompressed_numel + c.p_offset, c.rows * c.rank);
  }
  L->q_valid = all_q;
  return L;
}

std::shared_ptr<BucketLayout> build_batched_layout(PowerSGDState& st,
                                                   const std::vector<int64_t>& keys,
                                                   const c10d::GradBucket& bucket,
                                                   const at::Tensor& input) {
  const auto& o = st.options();
  PowerSGDMemory& mem = st.memory();
  auto L = new_layout(keys, bucket.getGradients(), input);
  L->total_length = input.numel();
  L->side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(L->total_length))));
  while (L->side * L->side < L->total_length) ++L->side;  // guard against sqrt rounding
  L->rank = std::min(L->side, o.matrix_approximation_rank);
  L->numel_before = L->total_length;
  L->numel_after = L->side * L->rank * 2;
  const auto opts = input.options().dtype(L->compute_dtype);
  L->padded = at::zeros({L->side * L->side}, opts);
  L->round_one = at::empty({L->side * L->rank}, opts);  // P
  L->q_factors = at::empty({L->side * L->rank}, opts);
  L->p_pack = MatrixPack({0}, {L->side}, {L->rank}, L->device);
  L->q_pack = MatrixPack({0}, {L->side}, {L->rank}, L->device);
  if (o.use_error_feedback) {
    claim_error_views(mem, *L, L->side * L->side, opts, bucket.getGradients());
  }
  L->batched_key = join_keys(keys);
  if (L->error.defined() && L->side * L->side > L->total_length) {
    at::Tensor pad = L->error.narrow(0, L->total_length, L->side * L->side - L->total_length);
    claim_memory(L->batched_key, pad, mem.batched_error_pad, mem.restored_batched_error_pad);
    mem.batched_error_pad[L->batched_key] = pad;
  }
  L->q_valid = claim_memory(L->batched_key, L->q_factors, mem.batched_q, mem.restored_batched_q);
  mem.restored_batched_q.erase(L->batched_key);  // a live memory won: the restored one is stale
  mem.batched_q[L->batched_key] = L->q_factors;
  return L;
}

std::shared_ptr<BucketLayout> layout_for(PowerSGDState& st, const c10d::GradBucket& bucket,
                                         const std::vector<int64_t>& keys, const at::Tensor& input,
                                         bool batched) {
  auto& slot = st.memory().layouts[bucket.getIndex()];
  const auto& o = st.options();
  // Options are settable between steps (as torch's attributes are) and apply at the next one:
  // a layout built for other values is rebuilt, and keeps every memory that still fits (error
  // feedback always does; Q factors when their rank is unchanged).
  if (slot && slot->keys == keys && slot->wire_dtype == input.scalar_type() &&
      slot->device == input.device() && (batched == !slot->batched_key.empty()) &&
      (!batched || slot->total_length == input.numel()) &&
      slot->built_rank == o.matrix_approximation_rank &&
      slot->built_min_compression_rate == o.min_compression_rate &&
      slot->error.defined() == o.use_error_feedback) {
    return slot;
  }
  slot = batched ? build_batched_layout(st, keys, bucket, input)
                 : build_layerwise_layout(st, bucket, keys, input);
  slot->built_rank = o.matrix_approximation_rank;
  slot->built_min_compression_rate = o.min_compression_rate;
  return slot;
}

// Fresh Q factors: one seed from the state's generator (draw_seed), then standard normals drawn on
// the CPU in torch's order and granularity (one draw per same-shape group when batching, else one
// per matrix), so the factors equal those of torch's hook.
// The draws land in one host buffer (pinned when Q lives on a GPU) that reaches Q in one copy,
// non-blocking on CUDA: one transfer per bucket instead of one synchronous pageable copy per
// matrix. The values are the same as drawing into each slice directly.
void randomize_q(PowerSGDState& st, BucketLayout& L, bool batch_same_shape) {
  const int64_t seed = st.draw_seed();
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  const auto cpu = at::TensorOptions().dtype(L.wire_dtype).device(at::kCPU);
  const bool on_gpu = !L.q_factors.device().is_cpu();
  at::Tensor staged =
      at::empty({L.q_factors.numel()}, cpu.dtype(L.q_factors.scalar_type()).pinned_memory(on_gpu));
  int64_t covered = 0;
  auto fill = [&](int64_t off, int64_t numel) {
    staged.narrow(0, off, numel).copy_(at::randn({numel}, gen, cpu));
    covered += numel;
  };
  if (!L.batched_key.empty()) {
    fill(0, L.q_factors.numel());
  } else {
    for (const auto& g : L.groups) {
      if (batch_same_shape) {
        const auto& first = L.comp[g.first];
        fill(first.q_offset, static_cast<int64_t>(g.second - g.first) * first.cols * first.rank);
      } else {
        for (size_t k = g.first; k < g.second; ++k) {
          fill(L.comp[k].q_offset, L.comp[k].cols * L.comp[k].rank);
        }
      }
    }
  }
  // Every Q is drawn: the layout packs them back to back.
  TORCH_INTERNAL_ASSERT(covered == L.q_factors.numel(), "randomize_q: drew ", covered, " of ",
                        L.q_factors.numel(), " Q values");
  L.q_factors.copy_(staged, /*non_blocking=*/on_gpu);
}

at::Tensor matrix_of(const PowerSGDJob& job, const CompMatrix& c) {
  const BucketLayout& L = *job.layout;
  return job.work.narrow(0, L.offsets[c.index], c.rows * c.cols).view({c.rows, c.cols});
}
at::Tensor p_of(const BucketLayout& L, const CompMatrix& c, int64_t count = 1) {
  return L.round_one.narrow(0, L.uncompressed_numel + c.p_offset, count * c.rows * c.rank)
      .view({count, c.rows, c.rank});
}
at::Tensor q_of(const BucketLayout& L, const CompMatrix& c, int64_t count = 1) {
  return L.q_factors.narrow(0, c.q_offset, count * c.cols * c.rank).view({count, c.cols, c.rank});
}

// The error memory of a compressed matrix, shaped as its matrix_of view.
at::Tensor error_of(const BucketLayout& L, const CompMatrix& c) {
  return L.error.narrow(0, L.offsets[c.index], c.rows * c.cols).view({c.rows, c.cols});
}

// Runs f(matrices [b, n, m], P [b, n, r], Q [b, m, r], err) per same-shape group (batched
// products) or per matrix; err is the matrix's error memory [1, n, m] when the job fuses the
// error feedback into the products, else undefined.
template <typename F>
void for_each_item(const PowerSGDJob& job, F&& f) {
  const BucketLayout& L = *job.layout;
  for (size_t gi = 0; gi < L.groups.size(); ++gi) {
    const auto& g = L.groups[gi];
    const int64_t count = static_cast<int64_t>(g.second - g.first);
    if (job.batch_same_shape && count > 1) {
      f(L.stacked[gi], p_of(L, L.comp[g.first], count), q_of(L, L.comp[g.first], count),
        at::Tensor());
    } else {
      for (size_t k = g.first; k < g.second; ++k) {
        const CompMatrix& c = L.comp[k];
        f(matrix_of(job, c).unsqueeze(0), p_of(L, c), q_of(L, c),
          job.fused_error_feedback ? error_of(L, c).unsqueeze(0) : at::Tensor());
      }
    }
  }
}

// The error feedback of the uncompressed gradients (compensate, or take the residual), when the
// compressed ones have theirs inside the products.
void uncompressed_error_feedback(const PowerSGDJob& job, bool compensate) {
  const BucketLayout& L = *job.layout;
  for (const auto& run : L.uncompressed_runs) {
    at::Tensor w = job.work.narrow(0, run.first, run.second);
    at::Tensor e = L.error.narrow(0, run.first, run.second);
    if (compensate) {
      error_feedback_apply_(w, e);
    } else {
      e.sub_(w);
    }
  }
}

// Round one: compensate, draw or orthogonalise Q, P = MQ, and start the allreduce of
// [uncompressed | Ps] (layer-wise) or P (batched).
std::shared_ptr<PowerSGDJob> start_round_one(PowerSGDState& st, const c10d::GradBucket& bucket,
                                             const std::vector<int64_t>& keys,
                                             const at::Tensor& input, bool batched) {
  const auto& o = st.options();
  auto job = std::make_shared<PowerSGDJob>();
  job->layout = layout_for(st, bucket, keys, input, batched);
  BucketLayout& L = *job->layout;
  job->batched = batched;
  job->warm_start = o.warm_start;
  job->batch_same_shape = o.batch_tensors_with_same_shape && !batched;
  job->epsilon = o.orthogonalization_epsilon;
  job->world = st.process_group()->getSize();
  job->input = input;
  job->result = comm::future_on(input);
  st.add_compression_stats(L.numel_before, L.numel_after);

  if (batched) {
    L.padded.narrow(0, 0, L.total_length).copy_(input);
    if (L.side * L.side > L.total_length) {
      L.padded.narrow(0, L.total_length, L.side * L.side - L.total_length).zero_();
    }
    job->work = L.padded;
  } else {
    if (input.scalar_type() == L.compute_dtype) {
      job->work = input;
    } else {
      if (!L.work_copy.defined()) {
        L.work_copy = at::empty(input.sizes(), input.options().dtype(L.compute_dtype));
      }
      L.work_copy.copy_(input);
      job->work = L.work_copy;
    }
  }
  job->fused_error_feedback =
      o.use_error_feedback && L.error.defined() && L.device.is_cpu() && !job->batch_same_shape;
  if (job->fused_error_feedback) {
    if (!batched) uncompressed_error_feedback(*job, /*compensate=*/true);
  } else if (o.use_error_feedback) {
    error_feedback_apply_(job->work, L.error);
  }

  if (!o.warm_start || !L.q_valid) randomize_q(st, L, job->batch_same_shape);
  orthogonalize_(L.q_factors, L.q_pack, job->epsilon);

  if (batched) {
    lowrank_project_(L.padded.view({1, L.side, L.side}), L.q_factors.view({1, L.side, L.rank}),
                     L.round_one.view({1, L.side, L.rank}),
                     job->fused_error_feedback ? L.error.view({1, L.side, L.side}) : at::Tensor());
  } else {
    if (job->batch_same_shape) {
      L.stacked.resize(L.groups.size());
      for (size_t gi = 0; gi < L.groups.size(); ++gi) {
        const auto& g = L.groups[gi];
        if (g.second - g.first < 2) continue;
        std::vector<at::Tensor> mats;
        for (size_t k = g.first; k < g.second; ++k) mats.push_back(matrix_of(*job, L.comp[k]));
        if (!L.stacked[gi].defined()) {
          const CompMatrix& c = L.comp[g.first];
          L.stacked[gi] =
              at::empty({static_cast<int64_t>(mats.size()), c.rows, c.cols}, job->work.options());
        }
        at::stack_out(L.stacked[gi], mats);
      }
    }
    for_each_item(*job, [](const at::Tensor& m, const at::Tensor& p, const at::Tensor& q,
                           const at::Tensor& err) { lowrank_project_(m, q, p, err); });
    if (L.uncompressed_numel > 0) {
      copy_uncompressed(L, job->work, L.round_one.narrow(0, 0, L.uncompressed_numel), false);
    }
  }
  // P (and the uncompressed values) travel in the bucket's dtype.
  at::Tensor wire =
      L.wire_dtype == L.compute_dtype ? L.round_one : scaled_cast(L.round_one, L.wire_dtype, 1.0);
  job->round1 = sum_into(st.process_group(), wire, L.round_one, 1.0, ExchangeMode::kAuto);
  return job;
}

void finish(PowerSGDJob& job) {
  BucketLayout& L = *job.layout;
  if (job.batched) {
    job.input.copy_(L.padded.narrow(0, 0, L.total_length));
  } else {
    if (job.batch_same_shape) {
      for (size_t gi = 0; gi < L.stacked.size(); ++gi) {
        if (!L.stacked[gi].defined()) continue;
        const auto& g = L.groups[gi];
        for (size_t k = g.first; k < g.second; ++k) {
          matrix_of(job, L.comp[k]).copy_(L.stacked[gi][static_cast<int64_t>(k - g.first)]);
        }
      }
    }
  }
  // The compensated input minus what the step applies: the residual for the next step (the
  // compressed matrices' already taken by their reconstruction when fused).
  if (job.fused_error_feedback) {
    if (!job.batched) uncompressed_error_feedback(job, /*compensate=*/false);
  } else if (L.error.defined()) {
    L.error.sub_(job.work);
  }
  if (!job.batched && !job.work.is_same(job.input)) job.input.copy_(job.work);
  L.q_valid = job.warm_start;
  job.result->markCompleted(c10::IValue(job.input));
}

// Waits for round one of `job`, then starts round two (Q = M^T P, allreduced); the job's result
// completes when round two has been decompressed.
void start_round_two(const ProcessGroupPtr& pg, const std::shared_ptr<PowerSGDJob>& job) {
  BucketLayout& L = *job->layout;
  // Issued from the next bucket's runHook: on a device, the wait for round one and round two's
  // kernels go on a pool stream, not on DDP's autograd stream, which would otherwise stall the
  // rest of backward until round one's collective is done. What they read was written on the
  // autograd stream before round one's collective was issued, and round one's future completes
  // after that collective, so waiting on it orders them; round two's collective waits for this
  // stream; the result completes on its callback's stream (finish), which DDP waits on. Every
  // buffer they touch is the layout's (persistent) or the bucket's.
  const comm::OnPoolStream on_side(job->input.device());
  job->round1->wait();
  job->round1->value();  // rethrows a failed round one
  if (L.uncompressed_numel > 0) {
    at::Tensor unc = L.round_one.narrow(0, 0, L.uncompressed_numel);
    unc.div_(job->world);
    copy_uncompressed(L, job->work, unc, true);
  }
  if (!job->batched && L.comp.empty()) {
    finish(*job);
    return;
  }
  orthogonalize_(L.round_one, L.p_pack, job->epsilon);
  if (job->batched) {
    lowrank_project_t_(L.padded.view({1, L.side, L.side}), L.round_one.view({1, L.side, L.rank}),
                       L.q_factors.view({1, L.side, L.rank}));
  } else {
    for_each_item(*job, [](const at::Tensor& m, const at::Tensor& p, const at::Tensor& q,
                           const at::Tensor&) { lowrank_project_t_(m, p, q); });
  }
  at::Tensor wire =
      L.wire_dtype == L.compute_dtype ? L.q_factors : scaled_cast(L.q_factors, L.wire_dtype, 1.0);
  // The sum, then a division by the world size as torch's hook does (`div_(world_size)`): the
  // same rounding as torch for any world size, where a multiplication by 1/W differs in the last
  // bit unless W is a power of two. Hence torch's div_ below, not an in-place scaled_cast.
  FuturePtr round2 = sum_into(pg, wire, L.q_factors, 1.0, ExchangeMode::kAuto);
  round2->addCallback([job](c10::ivalue::Future& f) {
    if (f.hasError()) {
      job->result->setError(f.exception_ptr());
      return;
    }
    try {
      BucketLayout& L = *job->layout;
      L.q_factors.div_(job->world);
      if (job->batched) {
        lowrank_reconstruct_(
            L.round_one.view({1, L.side, L.rank}), L.q_factors.view({1, L.side, L.rank}),
            L.padded.view({1, L.side, L.side}),
            job->fused_error_feedback ? L.error.view({1, L.side, L.side}) : at::Tensor());
      } else {
        for_each_item(*job, [](const at::Tensor& m, const at::Tensor& p, const at::Tensor& q,
                               const at::Tensor& err) { lowrank_reconstruct_(p, q, m, err); });
      }
      finish(*job);
    } catch (...) {
      job->result->setError(std::current_exception());
    }
  });
}

// Round two of `job` as a deferred step: issued by the next runHook (or at once for the last
// bucket); a failure goes to the bucket's own future (DDP reports it when it waits).
comm::DeferredCollective::Step round_two_step(const ProcessGroupPtr& pg,
                                              const std::shared_ptr<PowerSGDJob>& job) {
  return {[pg, job] { start_round_two(pg, job); },
          [job](std::exception_ptr error) {
            if (!job->result->completed()) job->result->setError(std::move(error));
          }};
}

}  // namespace

PowerSGDHook::PowerSGDHook(PowerSGDStatePtr state, bool batched)
    : state_(std::move(state)), batched_(batched) {
  TORCH_CHECK_TYPE(state_ != nullptr, name(), ": state must be a PowerSGDState, got None");
}

std::string PowerSGDHook::name() const {
  return batched_ ? "batched_powerSGD_hook" : "powerSGD_hook";
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::runHook(c10d::GradBucket& bucket) {
  PowerSGDState& st = *state_;
  comm::DeferredCollective& round_two = st.memory().round_two;
  const at::Tensor input = bucket.getBuffer();
  const bool is_last = bucket.isLast();
  std::vector<int64_t> keys;
  try {
    detail::check_bucket(input, name(), /*sparse_ok=*/true);
    detail::agree_once(agreed_epoch_, st.process_group(), input.device(), st.epoch(), [&] {
      const PowerSGDOptions& o = st.options();
      return detail::Fingerprint(name())
          .add("matrix_approximation_rank", o.matrix_approximation_rank)
          .add("start_powerSGD_iter", o.start_powerSGD_iter)
          .add("min_compression_rate", o.min_compression_rate)
          .add("use_error_feedback", o.use_error_feedback)
          .add("warm_start", o.warm_start)
          .add("orthogonalization_epsilon", o.orthogonalization_epsilon)
          .add("random_seed", o.random_seed)
          .add("batch_tensors_with_same_shape", o.batch_tensors_with_same_shape)
          // The warm-up's end and the Q seeds' draws follow the iteration.
          .add("iter", st.iter());
    });
    keys = st.keys_for(bucket, name());
  } catch (...) {
    round_two.flush();
    throw;
  }
  if (st.iter() < st.options().start_powerSGD_iter) {
    round_two.flush();
    st.maybe_increase_iter(is_last);
    return comm::allreduce_mean(st.process_group(), input, ExchangeMode::kAuto);
  }
  if (input.is_sparse()) {
    round_two.flush();
    TORCH_CHECK(false, name(),
                ": sparse gradients cannot be compressed (DDP gives sparse buckets for "
                "nn.Embedding(sparse=True)); they are averaged by plain allreduce only before "
                "start_powerSGD_iter. Use dense gradients, or allreduce_hook");
  }
  std::shared_ptr<PowerSGDJob> job;
  try {
    job = start_round_one(st, bucket, keys, input, batched_);
  } catch (...) {
    round_two.flush();
    throw;
  }
  st.maybe_report_stats(is_last);
  round_two.submit(round_two_step(st.process_group(), job), is_last);
  // Every bucket, as torch's hook: only the last one counts the iteration, but any logs "Start to
  // apply PowerSGD" while iter equals start_powerSGD_iter (torch's records, one per bucket).
  st.maybe_increase_iter(is_last);
  return job->result;
}

CommHookPtr powerSGD_hook(PowerSGDStatePtr state) {
  return std::make_shared<PowerSGDHook>(std::move(state), false);
}

CommHookPtr batched_powerSGD_hook(PowerSGDStatePtr state) {
  return std::make_shared<PowerSGDHook>(std::move(state), true);
}

}  // namespace hooks
}  // namespace ddpx
