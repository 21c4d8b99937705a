// The bucketed in-place collective engine: one collective applied to many tensors of any
// layout, device and dtype, through at most two reused staging buckets, with tensors large
// enough reduced in their own storage. Parameter averaging runs on it (comm/average.h), and so
// does the C++ DDP's initial broadcast; ZeRO's parameter exchange shares its packer.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ddpx {
namespace comm {

// DDP's default bucket size.
constexpr int64_t kDefaultBucketBytes = 25 * 1024 * 1024;

struct BucketOptions {
  // Small tensors are packed into staging buckets of at most this many bytes (at most two in
  // flight: one being exchanged while the next is packed). Must be positive.
  int64_t bucket_cap_bytes = kDefaultBucketBytes;
  // The API named in error messages (average_parameters sets its own name).
  std::string caller = "run_bucketed";
};

// What one call did (for tests and benchmarks).
struct BucketStats {
  int64_t tensors = 0;          // tensors given
  int64_t collectives = 0;      // collectives issued (the layout check not counted)
  int64_t inplace_tensors = 0;  // tensors exchanged in their own storage (no copy)
  int64_t staged_tensors = 0;   // tensors packed into a staging bucket
  int64_t staging_bytes = 0;    // bytes of staging buffers allocated (all devices)
};

// The collective the engine applies, bucket by bucket. Implementations are stateless and
// const: one object may serve concurrent calls.
class BucketCollective {
 public:
  virtual ~BucketCollective() = default;

  // true: the tensors of one device travel together in one dtype (wire_dtype of their promoted
  // dtype), so values are cast on the way in and out; false: one pass per (device, dtype), values
  // travel in their own dtype, bit for bit.
  virtual bool promotes() const = 0;
  // The dtype the values of `dtype` travel in on `device` over `pg`.
  virtual at::ScalarType wire_dtype(at::ScalarType dtype, const c10::Device& device,
                                    const c10d::ProcessGroup& pg) const = 0;
  // Refuses a tensor this collective cannot exchange (c10::ValueError naming `caller` and the
  // tensor's index). Called for every tensor before anything is exchanged.
  virtual void check(const at::Tensor& tensor, size_t index, const std::string& caller) const {}
  // Starts the collective on `values` (1-D, contiguous: a staging bucket, or a tensor's own
  // storage), which it may modify first; the result lands in `values`.
  virtual c10::intrusive_ptr<c10d::Work> start(c10d::ProcessGroup& pg,
                                               const at::Tensor& values) const = 0;
};

// The mean over the group with torch's arithmetic: values promoted to the tensors' common dtype
// (as torch.cat promotes; 16-bit values as fp32 where backend_sums_natively() says so), divided
// by the group size, summed by the group's allreduce.
class AllreduceMean final : public BucketCollective {
 public:
  bool promotes() const override { return true; }
  // Only floating-point (and complex) values average.
  void check(const at::Tensor& tensor, size_t index, const std::string& caller) const override;
  at::ScalarType wire_dtype(at::ScalarType dtype, const c10::Device& device,
                            const c10d::ProcessGroup& pg) const override;
  c10::intrusive_ptr<c10d::Work> start(c10d::ProcessGroup& pg,
                                       const at::Tensor& values) const override;
};

// Every rank's tensors take the values of group rank `root`'s, bit for bit, whatever the dtype
// (their bytes travel: every backend broadcasts bytes).
class Broadcast final : public BucketCollective {
 public:
  // `root`: the group rank whose values every rank receives.
  explicit Broadcast(int64_t root);
  bool promotes() const override { return false; }
  at::ScalarType wire_dtype(at::ScalarType dtype, const c10::Device&,
                            const c10d::ProcessGroup&) const override {
    return dtype;
  }
  c10::intrusive_ptr<c10d::Work> start(c10d::ProcessGroup& pg,
                                       const at::Tensor& values) const override;
  // The group rank whose values every rank takes.
  int64_t root() const { return root_; }

 private:
  int64_t root_;
};

// Applies `collective` to every tensor of `tensors`, in place (the tensors keep their storage;
// autograd is not recorded), and blocks until done.
//
// Memory is bounded by about two buckets: contiguous tensors of the wire dtype and at least a
// quarter bucket (or 256 KiB, if less) are exchanged in their own storage (so are non-contiguous
// but dense ones, e.g. channels_last, in memory order, when every rank lays them out alike: checked
// with one tiny collective, as DDP checks parameter strides); the others are packed into two reused
// staging buckets (a tensor larger than a bucket travels in bucket-sized chunks; a non-contiguous,
// non-dense one larger than a bucket goes through a contiguous copy of itself that lives only
// while its chunks are in flight, one such copy at a time). Tensors stay on their own device,
// each device with its own buckets, in order of first appearance. At most ~2 buckets of
// collectives are in flight at any time.
//
// Tensors may share memory, and every element is exchanged once, from its original values: a
// tensor listed twice, or covered by a dense tensor of the same dtype in the list (a view of a
// listed parameter), is exchanged through the one that covers it; a tensor that overlaps another
// only partly is exchanged through a private copy, written back when all is done (the memory they
// share gets the copy's result: the same mean, up to the order the backend summed in).
//
// A null `pg` means "this rank is not a member": nothing happens. A group of one: nothing to
// exchange (tensors are counted). Every member rank must pass tensors of the same shapes, dtypes,
// device types and order, aliased alike (collectives are issued in that order); one tiny
// collective checks it first, and a mismatch raises c10::ValueError on every rank instead of
// hanging or aborting. Each tensor must be defined and strided (c10::ValueError otherwise).
BucketStats run_bucketed(const std::vector<at::Tensor>& tensors, const ProcessGroupPtr& pg,
                         const BucketCollective& collective, const BucketOptions& options = {});

}  // namespace comm
}  // namespace ddpx
