// The one tensor packer (private to src/): how a list of tensors of one device travels as a
// sequence of messages, each either one tensor's own storage or a staging bucket packed with runs
// of tensors. Under run_bucketed (parameter averaging, the C++ DDP's initial broadcast) and ZeRO's
// parameter exchange (ZeroShards).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddpx {
namespace comm {

// Which tensors may travel in their own storage (no staging copy) when large enough.
enum class OwnStorage {
  kNever,       // every tensor is staged (run_bucketed when the ranks' layouts differ)
  kContiguous,  // contiguous tensors (ZeRO: the replicas share one layout by construction)
  kDense,       // contiguous ones and dense non-contiguous ones (channels_last, transposes), in
                // memory order: only when every rank lays them out alike (run_bucketed checks)
};

// The smallest tensor, in bytes, that travels in its own storage with buckets of `cap_bytes`: a
// quarter bucket, and at most 256 KiB. A message that large already amortises its latency, while
// staging it would cost two copies and staging memory.
int64_t own_storage_min_bytes(int64_t cap_bytes);

// A run of `len` elements of source tensor `source` (flattened, in logical order), from element
// `src_offset`, packed at element `dst_offset` of a staging bucket.
struct PackSegment {
  size_t source;
  int64_t src_offset;
  int64_t dst_offset;
  int64_t len;
};

// One message: a source in its own storage (own_source >= 0), or a staging bucket of segments.
struct PackMessage {
  int64_t own_source = -1;
  std::vector<PackSegment> segments;
  int64_t numel = 0;
};

class Packer {
 public:
  // `tensors`: defined, strided, on one device. `dtype`: what the values travel in (staged values
  // are cast to it and back; a tensor of another dtype never travels in its own storage).
  // `cap_bytes` > 0: a staging bucket holds at most that many bytes of `dtype`. A tensor that
  // fits a bucket goes whole into one; a larger one starts a bucket of its own and is split
  // across buckets. The plan depends on the tensors' sizes, dtypes and (through `own`) layouts
  // only, so ranks with alike tensors cut alike messages.
  //
  // The packer keeps the tensor handles, not views of their storage: a parameter whose data is
  // rebound later (ZeRO's bucket views, `p.data = ...`) is read and written where it is now.
  Packer(std::vector<at::Tensor> tensors, at::ScalarType dtype, int64_t cap_bytes, OwnStorage own);

  const std::vector<at::Tensor>& tensors() const { return sources_tensors_; }
  const std::vector<PackMessage>& messages() const { return messages_; }
  // Elements of the largest staging bucket (0: none).
  int64_t max_staged() const { return max_staged_; }
  // Tensors with at least one element in a staging bucket.
  int64_t staged_sources() const;
  // The sources whose first element travels in message m, in order (ZeRO updates a parameter
  // just before its first message is sent).
  const std::vector<size_t>& starting_in(size_t m) const { return starting_[m]; }

  // Message m's own-storage tensor as a 1-D view (memory order). Raises if that tensor is no
  // longer laid out as when planned.
  at::Tensor own_values(size_t m) const;
  // Copies message m's segments into `bucket` (1-D, contiguous, of the dtype given at construction,
  // at least numel), cast.
  void pack(size_t m, const at::Tensor& bucket);
  // Copies `bucket`'s values of message m back into the tensors, cast back to their dtypes.
  void unpack(size_t m, const at::Tensor& bucket);
  // The sender's side of a one-way message (a broadcast's root): message m's values are not
  // written back, but its temporary copies are released as unpack would.
  void release(size_t m);

  // A tensor that is neither contiguous nor dense in the planned way and is larger than a bucket
  // travels through a contiguous copy of itself ("temporary"), made when its first segment is
  // packed or unpacked and written back (by unpack) and freed after its last one.
  int live_temporaries() const { return live_temporaries_; }
  // Whether message m's first segment starts a temporary copy not made yet (run_bucketed waits
  // for the previous copy to be released first: one alive at a time).
  bool starts_temporary(size_t m) const;

 private:
  enum class Access {
    kFlat,       // contiguous, or dense and own storage allowed: its storage in memory order
    kWhole,      // otherwise, fits one bucket: copied whole through a view of the bucket
    kTemporary,  // otherwise, larger than a bucket: through a temporary contiguous copy
  };
  struct Source {
    Access access = Access::kFlat;
    bool memory_order = false;  // kFlat of a dense non-contiguous tensor
    at::Tensor temporary;       // kTemporary: the copy while in use
    int64_t segments = 0;       // segments in all
    int64_t pending = 0;        // kTemporary: segments not unpacked or released yet
  };

  // Whether a kFlat source is still laid out as planned (its data may have been rebound).
  bool flat_now(size_t source) const;
  at::Tensor flat(size_t source) const;
  void check_whole(const PackSegment& seg) const;
  void transfer(size_t m, const at::Tensor& bucket, bool into_bucket);
  void take_temporary(size_t source);
  void done_with(const PackSegment& seg, bool write_back);

  std::vector<at::Tensor> sources_tensors_;
  std::vector<Source> sources_;
  std::vector<PackMessage> messages_;
  std::vector<std::vector<size_t>> starting_;
  int64_t max_staged_ = 0;
  int live_temporaries_ = 0;
};

}  // namespace comm
}  // namespace ddpx
