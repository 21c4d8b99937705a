// The bucketed in-place collective engine. See include/ddpx/comm/bucketed.h.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <ddpx/comm/bucketed.h>
#include <ddpx/comm/exchange_mode.h>

#include <algorithm>
#include <deque>
#include <unordered_map>
#include <utility>

#include "comm/digest.h"
#include "comm/packer.h"

namespace ddpx {
namespace comm {

namespace {

// ---- aliasing -------------------------------------------------------------------------------

// The bytes of its storage a tensor can touch: [begin, end) from the storage's start.
struct Footprint {
  const void* storage = nullptr;  // null: no memory (an empty tensor)
  int64_t begin = 0, end = 0;
};

Footprint footprint_of(const at::Tensor& t) {
  Footprint f;
  if (t.numel() == 0) return f;
  int64_t lo = 0, hi = 0;  // element offsets of the first and last element, from storage_offset
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.size(d) - 1) * t.stride(d);
    (span < 0 ? lo : hi) += span;
  }
  const int64_t elem = static_cast<int64_t>(t.element_size());
  f.storage = t.storage().unsafeGetStorageImpl();
  f.begin = (t.storage_offset() + lo) * elem;
  f.end = (t.storage_offset() + hi + 1) * elem;
  return f;
}

bool intersect(const Footprint& a, const Footprint& b) {
  return a.storage != nullptr && a.storage == b.storage && a.begin < b.end && b.begin < a.end;
}

// `outer` covers every element of `inner`: a dense tensor of the same dtype whose bytes include
// inner's (a dense tensor owns every byte of its footprint).
bool covers(const at::Tensor& outer, const Footprint& fo, const at::Tensor& inner,
            const Footprint& fi) {
  return outer.scalar_type() == inner.scalar_type() && outer.is_non_overlapping_and_dense() &&
         fo.storage == fi.storage && fo.begin <= fi.begin && fi.end <= fo.end;
}

// How the tensors of a call are exchanged when some share memory. Exchanging overlapping memory
// concurrently corrupts it (an in-place allreduce divides memory that another allreduce is still
// summing), and exchanging it twice would average a mean again. So: a tensor whose memory
// another (dense, same dtype) tensor of the list covers is dropped, since exchanging that one
// exchanges it (a tensor listed twice, a view of a parameter listed with the parameter); a
// tensor that overlaps a kept one only partly is exchanged through a private copy of its
// original values, written back once every collective is done. Every element is thus exchanged
// from its original values; memory that a kept tensor and a copy share ends up with the copy's
// result (the same mean, up to the order the backend summed in). Indices into the list, in its
// order; the same on every rank whose tensors are aliased alike (agree() checks it).
struct Aliasing {
  std::vector<size_t> direct;  // exchanged in their own memory (or staged), no two overlapping
  std::vector<size_t> copied;  // exchanged through a private copy, then written back
};

Aliasing resolve_aliasing(const std::vector<at::Tensor>& tensors) {
  enum class Fate { kDirect, kCopied, kDropped };
  std::vector<Fate> fate(tensors.size(), Fate::kDirect);
  std::vector<Footprint> foot(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) foot[i] = footprint_of(tensors[i]);
  auto covered = [&](size_t outer, size_t inner) {
    return covers(tensors[outer], foot[outer], tensors[inner], foot[inner]);
  };
  // The kept tensors of each storage: only tensors of one storage can share memory.
  std::unordered_map<const void*, std::vector<size_t>> kept;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (foot[i].storage == nullptr) continue;  // no memory
    std::vector<size_t>& same = kept[foot[i].storage];
    bool dropped = false, clash = false;
    for (auto it = same.begin(); it != same.end() && !dropped;) {
      if (!intersect(foot[*it], foot[i])) {
        ++it;
      } else if (covered(*it, i)) {
        dropped = true;  // exchanged with a tensor that covers it
      } else if (covered(i, *it)) {
        fate[*it] = Fate::kDropped;  // this one covers an earlier one: it takes its place
        it = same.erase(it);
      } else {
        clash = clash || fate[*it] == Fate::kDirect;
        ++it;
      }
    }
    if (dropped) {
      fate[i] = Fate::kDropped;
      continue;
    }
    fate[i] = clash ? Fate::kCopied : Fate::kDirect;
    same.push_back(i);
  }
  Aliasing out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (fate[i] == Fate::kDirect) out.direct.push_back(i);
    if (fate[i] == Fate::kCopied) out.copied.push_back(i);
  }
  return out;
}

// ---- agreement across ranks -----------------------------------------------------------------

struct Agreement {
  bool same_tensors;  // count, shapes, dtypes, device types and aliasing agree on every rank
  bool same_layouts;  // and so do strides and density
};

// Every rank must build the same plan (the same collectives, in the same order, of the same
// sizes): one tiny collective compares two hashes across the ranks. The first covers what the
// plan is made of (the tensors' number, shapes, dtypes, device types, and how they alias, which
// decides which are exchanged through copies): ranks that differ there would issue different
// collectives, so the call raises on every rank instead (Gloo would abort the process, NCCL hang).
// The second covers the layouts, which torch does not require to match across ranks (DDP checks
// parameter strides; direct callers of average_parameters need not): when they match, contiguous
// and dense non-contiguous tensors (channels_last, transposes) are exchanged in their own storage
// (the collectives are elementwise, so memory order is as good as logical order); otherwise every
// tensor is copied through the staging buckets in logical order.
Agreement agree(const std::vector<at::Tensor>& tensors, const Aliasing& aliasing,
                const ProcessGroupPtr& pg) {
  Digest what, layout;
  what.mix(static_cast<int64_t>(tensors.size()));
  for (const at::Tensor& t : tensors) {
    what.mix(static_cast<int64_t>(t.scalar_type()));
    what.mix(static_cast<int64_t>(t.device().type()));
    what.mix(t.dim());
    for (int64_t v : t.sizes()) what.mix(v);
    layout.mix(t.is_non_overlapping_and_dense() ? 1 : 2);
    for (int64_t v : t.strides()) layout.mix(v);
  }
  for (const auto* list : {&aliasing.direct, &aliasing.copied}) {
    what.mix(-1);
    for (size_t i : *list) what.mix(static_cast<int64_t>(i));
  }
  const std::vector<bool> same =
      all_ranks_agree({what.value(), layout.value()}, pg, tensors.front().device());
  return {same[0], same[0] && same[1]};
}

struct InFlight {
  size_t message;
  int slot;  // staging slot, -1 for in place
  c10::intrusive_ptr<c10d::Work> work;
};

// `own_storage`: the ranks lay the tensors out alike (agree()), so dense ones may travel in their
// own storage, in memory order. The messages then depend on the layouts only through it (the same
// on every rank).
void run_on_device(const std::vector<at::Tensor>& params, const ProcessGroupPtr& pg,
                   const BucketCollective& collective, at::ScalarType dtype, int64_t cap_bytes,
                   bool own_storage, BucketStats& stats) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  Packer packer(params, dtype, cap_bytes, own_storage ? OwnStorage::kDense : OwnStorage::kNever);
  const int64_t cap_elems = std::max<int64_t>(1, cap_bytes / elem);
  const auto options = params.front().options().dtype(dtype);
  const std::vector<PackMessage>& messages = packer.messages();

  // Two staging buffers, sized to the largest bucket of this call and allocated only if used.
  at::Tensor slots[2];
  bool slot_busy[2] = {false, false};
  std::deque<InFlight> in_flight;
  int64_t in_flight_elems = 0;

  auto finish_oldest = [&] {
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    f.work->wait();
    in_flight_elems -= messages[f.message].numel;
    if (f.slot >= 0) {
      // copy_ casts back to each tensor's dtype.
      packer.unpack(f.message, slots[f.slot]);
      slot_busy[f.slot] = false;
    }
  };

  try {
    for (size_t m = 0; m < messages.size(); ++m) {
      const PackMessage& msg = messages[m];
      at::Tensor values;
      int slot = -1;
      if (msg.own_source >= 0) {
        values = packer.own_values(m);
        ++stats.inplace_tensors;
      } else {
        while (slot_busy[0] && slot_busy[1]) finish_oldest();
        // A bucket that starts a temporary copy waits for the previous copy to be written
        // back: one copy alive at a time.
        if (packer.starts_temporary(m)) {
          while (packer.live_temporaries() > 0 && !in_flight.empty()) finish_oldest();
        }
        slot = slot_busy[0] ? 1 : 0;
        if (!slots[slot].defined()) {
          slots[slot] = at::empty({packer.max_staged()}, options);
          stats.staging_bytes += packer.max_staged() * elem;
        }
        slot_busy[slot] = true;
        values = slots[slot].narrow(0, 0, msg.numel);
        packer.pack(m, values);
      }
      // At most ~two buckets' worth of collectives in flight (staged ones are bounded by the two
      // slots already; this also keeps Gloo's per-collective buffers few).
      while (!in_flight.empty() && in_flight_elems + msg.numel > 2 * cap_elems) finish_oldest();
      // Any preparation of the values (AllreduceMean's division) runs while the previous
      // collectives are in flight.
      auto work = collective.start(*pg, values);
      ++stats.collectives;
      in_flight.push_back(InFlight{m, slot, std::move(work)});
      in_flight_elems += msg.numel;
    }
    while (!in_flight.empty()) finish_oldest();
  } catch (...) {
    // Collectives still in flight write into the staging buffers and parameters: let them end
    // before those are released, then report the first error.
    for (auto& f : in_flight) {
      try {
        f.work->wait();
      } catch (...) {
      }
    }
    throw;
  }
  stats.staged_tensors += packer.staged_sources();
}

// Groups `tensors` as the collective travels: per device in order of first appearance, and per
// dtype too when the collective does not promote.
struct Pass {
  at::Device device;
  at::ScalarType dtype;  // promoted (or own) dtype of the pass's tensors
  std::vector<at::Tensor> tensors;
};

std::vector<Pass> passes_of(const std::vector<at::Tensor>& tensors, bool promotes) {
  std::vector<Pass> passes;
  for (const at::Tensor& t : tensors) {
    auto it = std::find_if(passes.begin(), passes.end(), [&](const Pass& p) {
      return p.device == t.device() && (promotes || p.dtype == t.scalar_type());
    });
    if (it == passes.end()) {
      passes.push_back(Pass{t.device(), t.scalar_type(), {}});
      it = std::prev(passes.end());
    }
    it->dtype = c10::promoteTypes(it->dtype, t.scalar_type());
    it->tensors.push_back(t);
  }
  return passes;
}

}  // namespace

at::ScalarType AllreduceMean::wire_dtype(at::ScalarType dtype, const c10::Device& device,
                                         const c10d::ProcessGroup& pg) const {
  return backend_sums_natively(pg, dtype, device) ? dtype : at::kFloat;
}

void AllreduceMean::check(const at::Tensor& tensor, size_t index, const std::string& caller) const {
  TORCH_CHECK_VALUE(tensor.is_floating_point() || tensor.is_complex(), caller, ": tensor ", index,
                    " has dtype ", tensor.scalar_type(), "; only floating-point values average");
}

c10::intrusive_ptr<c10d::Work> AllreduceMean::start(c10d::ProcessGroup& pg,
                                                    const at::Tensor& values) const {
  // torch's order of operations: divide by the group size, then sum.
  values.div_(pg.getSize());
  std::vector<at::Tensor> tensors{values};
  return pg.allreduce(tensors);
}

Broadcast::Broadcast(int64_t root) : root_(root) {
  TORCH_CHECK_VALUE(root >= 0, "Broadcast: root must be a group rank >= 0, got ", root);
}

c10::intrusive_ptr<c10d::Work> Broadcast::start(c10d::ProcessGroup& pg,
                                                const at::Tensor& values) const {
  TORCH_CHECK_VALUE(root_ < pg.getSize(), "Broadcast: root ", root_,
                    " is not a rank of a group of ", pg.getSize());
  // As raw bytes: bit for bit whatever the dtype, and every backend broadcasts bytes (torch
  // 1.13's Gloo has no bfloat16).
  std::vector<at::Tensor> tensors{values.view(at::kByte)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root_;
  return pg.broadcast(tensors, opts);
}

BucketStats run_bucketed(const std::vector<at::Tensor>& tensors, const ProcessGroupPtr& pg,
                         const BucketCollective& collective, const BucketOptions& options) {
  TORCH_CHECK_VALUE(options.bucket_cap_bytes > 0, options.caller,
                    ": bucket_cap_bytes must be positive, got ", options.bucket_cap_bytes);
  BucketStats stats;
  if (!pg || tensors.empty()) return stats;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].defined(), options.caller, ": tensor ", i, " is undefined");
    TORCH_CHECK_VALUE(tensors[i].layout() == at::kStrided, options.caller, ": tensor ", i,
                      " is not a dense tensor (layout ", tensors[i].layout(), ")");
    collective.check(tensors[i], i, options.caller);
  }
  stats.tensors = static_cast<int64_t>(tensors.size());
  // A group of one: nothing to exchange (an average over one rank is x / 1 = x, bit for bit).
  if (pg->getSize() == 1) return stats;

  c10::AutoGradMode no_grad(false);
  const Aliasing aliasing = resolve_aliasing(tensors);
  const Agreement agreed = agree(tensors, aliasing, pg);
  TORCH_CHECK_VALUE(agreed.same_tensors, options.caller,
                    ": the ranks of the group passed different tensors (their number, shapes, "
                    "dtypes or devices differ, or they share memory differently); every rank must "
                    "pass the same list, in the same order (this rank passed ",
                    tensors.size(), ")");
  std::vector<at::Tensor> members;
  for (size_t i : aliasing.direct) members.push_back(tensors[i]);
  std::vector<at::Tensor> copies;
  for (size_t i : aliasing.copied) copies.push_back(tensors[i].clone(at::MemoryFormat::Contiguous));
  members.insert(members.end(), copies.begin(), copies.end());
  for (const Pass& pass : passes_of(members, collective.promotes())) {
    run_on_device(pass.tensors, pg, collective, collective.wire_dtype(pass.dtype, pass.device, *pg),
                  options.bucket_cap_bytes, agreed.same_layouts, stats);
  }
  for (size_t k = 0; k < copies.size(); ++k) tensors[aliasing.copied[k]].copy_(copies[k]);
  return stats;
}

}  // namespace comm
}  // namespace ddpx
