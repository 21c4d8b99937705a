// The staging buffers and stream bookkeeping of the hooks' exchanges (private to src/comm).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <ddpx/common/compat.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace ddpx {
namespace comm {

// Reuses CPU staging buffers across calls, so that a step does not allocate (and fault in)
// world_size x bucket bytes per bucket. Bounded; CUDA tensors come from torch's caching
// allocator. (What makes the exchange fast is the all-to-all itself: Gloo's allgather copies
// through a flat buffer of its own, which the all-to-all avoids; benchmarks/bench_collectives.py
// times the two.)
class StagingPool {
 public:
  // Never destroyed: a lease may be released by a future or a state that outlives static
  // destruction at exit.
  static StagingPool& instance() {
    static StagingPool* pool = new StagingPool();
    return *pool;
  }

  // A buffer of the pool, given back when the last copy of the lease goes (so every future and
  // callback that uses it holds it, and no call pairs an acquire with a release by hand). A device
  // buffer is not pooled: it is freed then, and whoever read it on another stream than its
  // allocation's records that stream (keep_until_current_stream_done) where it reads it.
  class Lease {
   public:
    Lease() = default;
    Lease(int64_t nbytes, const at::TensorOptions& options)
        : held_(std::make_shared<Held>(instance().acquire(nbytes, options))) {}
    // The buffer (undefined for a default-constructed lease).
    const at::Tensor& get() const {
      static const at::Tensor none;
      return held_ ? held_->t : none;
    }

   private:
    struct Held {
      explicit Held(at::Tensor tensor) : t(std::move(tensor)) {}
      ~Held() { instance().release(std::move(t)); }
      Held(const Held&) = delete;
      Held& operator=(const Held&) = delete;
      at::Tensor t;
    };
    std::shared_ptr<Held> held_;
  };

  at::Tensor acquire(int64_t nbytes, const at::TensorOptions& options) {
    if (options.device().is_cpu()) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(nbytes);
      if (it != free_.end()) {
        at::Tensor t = std::move(it->second);
        free_.erase(it);
        held_ -= nbytes;
        return t;
      }
    }
    return at::empty({nbytes}, options.dtype(at::kByte));
  }

  void release(at::Tensor t) {
    if (!t.device().is_cpu()) return;
    const int64_t nbytes = t.numel();
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_ + nbytes > kMaxHeldBytes) return;
    held_ += nbytes;
    free_.emplace(nbytes, std::move(t));
  }

 private:
  static constexpr int64_t kMaxHeldBytes = int64_t(512) << 20;
  std::mutex mutex_;
  std::multimap<int64_t, at::Tensor> free_;
  int64_t held_ = 0;
};

// `t` is about to be read on the current stream by work its owners may outlive (a future's
// callback reading a buffer that is not in the parent future's value, so the future machinery
// does not record it): tell the caching allocator, so that its memory is not handed out again
// before that stream is done with it. Nothing to do on CPU.
void keep_until_current_stream_done(const at::Tensor& t);

// The future of a collective's `work` on `device` tensors, taken without making the current
// stream wait for the collective (see exchange.cpp).
c10::intrusive_ptr<c10::ivalue::Future> future_of(c10d::Work& work, const c10::Device& device);

// Completes `result` with `value` once every one of `parts` has (or with the first error): the
// completing callback takes a pool stream (OnPoolStream) and waits on each part there, so that
// on CUDA the result's events are recorded after the parts' kernels. For a future created before
// its parts (a hook's result whose collectives are issued later, from the next runHook).
void complete_when_all_done(const c10::List<c10::intrusive_ptr<c10::ivalue::Future>>& parts,
                            const at::Tensor& value,
                            const c10::intrusive_ptr<c10::ivalue::Future>& result);

}  // namespace comm
}  // namespace ddpx
