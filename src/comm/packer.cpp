// The one tensor packer. See packer.h.
#include "comm/packer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace ddpx {
namespace comm {

namespace {
constexpr int64_t kOwnStorageMaxThreshold = 256 * 1024;
}  // namespace

int64_t own_storage_min_bytes(int64_t cap_bytes) {
  return std::max<int64_t>(1, std::min<int64_t>(cap_bytes / 4, kOwnStorageMaxThreshold));
}

Packer::Packer(std::vector<at::Tensor> tensors, at::ScalarType dtype, int64_t cap_bytes,
               OwnStorage own)
    : sources_tensors_(std::move(tensors)) {
  TORCH_CHECK_VALUE(cap_bytes > 0, "Packer: cap_bytes must be positive, got ", cap_bytes);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t cap_elems = std::max<int64_t>(1, cap_bytes / elem);
  const int64_t min_bytes = own_storage_min_bytes(cap_bytes);
  sources_.resize(sources_tensors_.size());
  PackMessage open;  // the staging bucket being filled
  auto close = [&] {
    if (open.numel == 0) return;
    max_staged_ = std::max(max_staged_, open.numel);
    messages_.push_back(std::move(open));
    open = PackMessage{};
  };
  for (size_t i = 0; i < sources_tensors_.size(); ++i) {
    const at::Tensor& t = sources_tensors_[i];
    Source& src = sources_[i];
    const int64_t n = t.numel();
    const bool contiguous = t.is_contiguous();
    const bool dense = own == OwnStorage::kDense && t.is_non_overlapping_and_dense();
    if (contiguous || dense) {
      src.memory_order = !contiguous;
    } else {
      src.access = n <= cap_elems ? Access::kWhole : Access::kTemporary;
    }
    if (n == 0) continue;
    const bool may_own = own != OwnStorage::kNever && (contiguous || dense);
    if (may_own && t.scalar_type() == dtype &&
        n * static_cast<int64_t>(t.element_size()) >= min_bytes) {
      PackMessage alone;
      alone.own_source = static_cast<int64_t>(i);
      alone.numel = n;
      messages_.push_back(std::move(alone));
      continue;
    }
    // A tensor that fits a bucket goes in one run of one bucket (a whole-tensor copy needs it);
    // a larger one starts a bucket of its own, so that no bucket holds the end of one temporary
    // copy and the start of another: with run_bucketed's wait, at most one copy is alive. By
    // numel only, whatever the access, so every rank cuts the same buckets.
    if ((n <= cap_elems && open.numel + n > cap_elems) || n > cap_elems) close();
    int64_t done = 0;
    while (done < n) {
      if (open.numel == cap_elems) close();
      const int64_t len = std::min(n - done, cap_elems - open.numel);
      open.segments.push_back(PackSegment{i, done, open.numel, len});
      open.numel += len;
      done += len;
      ++src.segments;
    }
    src.pending = src.segments;
  }
  close();
  starting_.resize(messages_.size());
  std::vector<bool> seen(sources_.size(), false);
  for (size_t m = 0; m < messages_.size(); ++m) {
    const PackMessage& msg = messages_[m];
    if (msg.own_source >= 0) {
      starting_[m].push_back(static_cast<size_t>(msg.own_source));
      continue;
    }
    for (const PackSegment& s : msg.segments) {
      if (!seen[s.source]) starting_[m].push_back(s.source);
      seen[s.source] = true;
    }
  }
}

int64_t Packer::staged_sources() const {
  return std::count_if(sources_.begin(), sources_.end(),
                       [](const Source& s) { return s.segments > 0; });
}

bool Packer::starts_temporary(size_t m) const {
  const PackMessage& msg = messages_[m];
  if (msg.segments.empty()) return false;
  const Source& first = sources_[msg.segments.front().source];
  return first.access == Access::kTemporary && !first.temporary.defined();
}

// A kFlat source's storage as a 1-D view in memory order, or undefined if the tensor is no
// longer laid out as planned (its data rebound to a tensor of another layout).
at::Tensor Packer::flat(size_t source) const {
  const at::Tensor& t = sources_tensors_[source];
  if (!flat_now(source)) return at::Tensor();
  if (!sources_[source].memory_order) return t.view({-1});
  return t.as_strided({t.numel()}, {1}, t.storage_offset());
}

at::Tensor Packer::own_values(size_t m) const {
  const int64_t i = messages_[m].own_source;
  TORCH_CHECK(i >= 0, "Packer: message ", m, " is a staging bucket");
  at::Tensor values = flat(static_cast<size_t>(i));
  TORCH_CHECK(values.defined(), "tensor ", i,
              " changed its memory layout after the exchange was planned");
  return values;
}

void Packer::take_temporary(size_t source) {
  Source& src = sources_[source];
  if (src.temporary.defined()) return;
  src.temporary = sources_tensors_[source].contiguous().view({-1});
  ++live_temporaries_;
}

void Packer::done_with(const PackSegment& seg, bool write_back) {
  Source& src = sources_[seg.source];
  if (src.access != Access::kTemporary) return;
  if (--src.pending > 0) return;
  const at::Tensor& t = sources_tensors_[seg.source];
  if (write_back && src.temporary.defined()) t.copy_(src.temporary.view(t.sizes()));
  if (src.temporary.defined()) --live_temporaries_;
  src.temporary = at::Tensor();
  src.pending = src.segments;  // ready for the next exchange (ZeRO reuses its packers)
}

bool Packer::flat_now(size_t source) const {
  const at::Tensor& t = sources_tensors_[source];
  return sources_[source].memory_order ? t.is_non_overlapping_and_dense() : t.is_contiguous();
}

namespace {

// memcpy for what is most of a staged exchange: many small CPU tensors already in the wire dtype
// (an ATen copy per tensor costs microseconds of dispatch each). A flat tensor's data pointer is
// its first element in memory order.
bool same_bytes_on_cpu(const at::Tensor& t, const at::Tensor& bucket) {
  return t.device().is_cpu() && bucket.device().is_cpu() && t.scalar_type() == bucket.scalar_type();
}

char* bytes_at(const at::Tensor& t, int64_t element) {
  return static_cast<char*>(t.data_ptr()) + element * static_cast<int64_t>(t.element_size());
}

}  // namespace

void Packer::pack(size_t m, const at::Tensor& bucket) { transfer(m, bucket, /*into_bucket=*/true); }

void Packer::unpack(size_t m, const at::Tensor& bucket) {
  transfer(m, bucket, /*into_bucket=*/false);
}

// Copies each segment of message m between its tensor and `bucket`, in the given direction.
void Packer::transfer(size_t m, const at::Tensor& bucket, bool into_bucket) {
  // `dst.copy_(src)` one way, `src.copy_(dst)` the other.
  auto copy = [into_bucket](const at::Tensor& in_bucket, const at::Tensor& own) {
    if (into_bucket) {
      in_bucket.copy_(own);
    } else {
      own.copy_(in_bucket);
    }
  };
  for (const PackSegment& seg : messages_[m].segments) {
    const at::Tensor& t = sources_tensors_[seg.source];
    Source& src = sources_[seg.source];
    const at::Tensor slot = bucket.narrow(0, seg.dst_offset, seg.len);
    if (src.access == Access::kTemporary) {
      take_temporary(seg.source);
      copy(slot, src.temporary.narrow(0, seg.src_offset, seg.len));
      if (!into_bucket) done_with(seg, /*write_back=*/true);
    } else if (src.access == Access::kFlat && flat_now(seg.source)) {
      if (same_bytes_on_cpu(t, bucket)) {
        char* in_bucket = bytes_at(bucket, seg.dst_offset);
        char* own = bytes_at(t, seg.src_offset);
        std::memcpy(into_bucket ? in_bucket : own, into_bucket ? own : in_bucket,
                    static_cast<size_t>(seg.len) * t.element_size());
      } else {
        copy(slot, flat(seg.source).narrow(0, seg.src_offset, seg.len));
      }
    } else {
      // kWhole, or a kFlat tensor whose data were rebound to another layout since (then only a
      // whole-tensor segment can be found in it).
      check_whole(seg);
      copy(slot.view(t.sizes()), t);
    }
  }
}

void Packer::check_whole(const PackSegment& seg) const {
  TORCH_CHECK(seg.src_offset == 0 && seg.len == sources_tensors_[seg.source].numel(), "tensor ",
              seg.source, " changed its memory layout after the exchange was planned");
}

void Packer::release(size_t m) {
  for (const PackSegment& seg : messages_[m].segments) done_with(seg, /*write_back=*/false);
}

}  // namespace comm
}  // namespace ddpx
