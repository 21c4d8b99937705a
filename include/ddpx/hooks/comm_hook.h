// Base class of every ddpx communication hook, and the adapter that lets DDP's Reducer own one.
#pragma once

#include <ATen/core/ivalue.h>
#include <ddpx/common/process_group.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/comm.hpp>

namespace ddpx {
namespace hooks {

// A c10d::CommHookInterface with a name. Hooks are held by std::shared_ptr so that one object
// can serve DDP's Python path (ddp.register_comm_hook with a ddpx Python hook) and the native
// path (Reducer::register_comm_hook) alike.
//
// runHook is called from DDP's autograd thread, once per bucket, in bucket order (the same
// order on every rank). It must start communication and return without waiting for it; the
// future completes with the averaged gradient tensor. Hooks are not re-entrant per bucket but
// several buckets may be in flight at once.
class CommHook : public c10d::CommHookInterface {
 public:
  ~CommHook() override = default;

  // Name as in torch ("allreduce_hook", "fp16_compress_hook", ...).
  virtual std::string name() const = 0;

  // The hook futures complete with a Tensor; a list holding one Tensor is accepted too.
  at::Tensor parseHookResult(const c10::IValue& result) override;

 protected:
  // The epoch of the hook's state whose options the ranks last agreed on (none yet): a hook
  // checks, before its first collective, that every rank built the same hook with the same
  // options (src/hooks/agreement.h).
  std::optional<uint64_t> agreed_epoch_;
};

// How hooks are held and passed: shared by DDP, Python and wrapping hooks.
using CommHookPtr = std::shared_ptr<CommHook>;

// Owns a shared reference to a hook and forwards to it: Reducer::register_comm_hook takes a
// std::unique_ptr, while Python and other wrappers keep using the same hook object.
class SharedCommHook final : public c10d::CommHookInterface {
 public:
  // `hook` must not be null; runHook and parseHookResult forward to it, and hook() returns it.
  explicit SharedCommHook(CommHookPtr hook);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;
  const CommHookPtr& hook() const { return hook_; }

 private:
  CommHookPtr hook_;
};

}  // namespace hooks
}  // namespace ddpx
