// Second collectives issued from runHook in a fixed order, never from a completion callback.
//
// Some hooks need a second collective whose input depends on the first one's result: PowerSGD's
// round two (Q = M^T P needs the summed P), ZeRO's overlap step (the parameter exchange after
// the update that the reduced gradient allows). Issuing it from the first collective's
// completion callback lets ranks order it differently against the next bucket's collectives
// (callbacks run when data arrives, at different times on different ranks), and collectives
// issued in different orders on different ranks mismatch or hang. With this helper a hook
// instead defers the second step of bucket i to its next runHook call:
//
//   runHook(i): issue bucket i's first collective; submit(step i) issues the step deferred by
//               runHook(i-1), then keeps step i (or issues it at once when bucket i is the last
//               of the backward pass).
//
// Every rank then issues 1(0) 1(1) 2(0) 1(2) 2(1) ... 1(last) 2(last-1) 2(last): the same order,
// whatever the timing.
//
// Cost: a deferred step starts by waiting for its own first collective, so runHook(i) blocks
// DDP's autograd thread until bucket i-1's first collective has completed. DDP calls runHook(i)
// only once bucket i's gradients are computed, by which time bucket i-1's collective has had the
// whole of that computation to finish; what is left of it is the wait. The last bucket waits for
// its own first collective too. A hook that cannot afford either wait should not defer. On a
// device the hooks take that wait on a stream from torch's pool (comm::OnPoolStream), so that the
// device-side wait does not hold back the autograd stream's remaining backward kernels.
//
// Not thread-safe: called from runHook only (DDP's autograd thread, one bucket at a time).
#pragma once

#include <exception>
#include <functional>
#include <optional>

namespace ddpx {
namespace comm {

class DeferredCollective {
 public:
  struct Step {
    // Waits for the first collective and issues the second (and whatever follows it).
    std::function<void()> issue;
    // Receives an exception thrown by `issue` (e.g. a failed first collective): it must reach
    // the bucket's future, since the runHook that issues the step belongs to another bucket.
    std::function<void(std::exception_ptr)> fail;
  };

  // Issues the step deferred by the previous call (if any), then defers `step`, or issues it at
  // once when `last` (the last bucket of a backward pass leaves nothing deferred).
  void submit(Step step, bool last);
  // Issues the deferred step, if any. A runHook that takes another path (plain allreduce before
  // compression starts, an error) calls it first, so that the order above holds.
  void flush();
  // Whether a step is waiting for the next runHook.
  bool pending() const { return pending_.has_value(); }
  // Forgets the deferred step without issuing it (its bucket's future never completes: only for
  // a state being reset between backward passes, when nothing is deferred anyway).
  void clear() { pending_.reset(); }

 private:
  static void run(Step& step);
  std::optional<Step> pending_;
};

}  // namespace comm
}  // namespace ddpx
