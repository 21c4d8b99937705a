#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <ddpx/hooks/post_localsgd_hook.h>

#include "comm/exchange.h"
#include "hooks/agreement.h"
#include "hooks/hook_utils.h"

namespace ddpx {
namespace hooks {

using comm::ExchangeMode;

namespace {
constexpr const char* kWho = "PostLocalSGDState";

void check_global_group(const ProcessGroupPtr& pg) {
  TORCH_CHECK_TYPE(pg, kWho, ": process_group must be a ProcessGroup, got null");
}

void check_start(int64_t start) {
  TORCH_CHECK_VALUE(start >= 0, kWho, ": start_localSGD_iter must be >= 0, got ", start);
}
}  // namespace

PostLocalSGDState::PostLocalSGDState(ProcessGroupPtr process_group, ProcessGroupPtr subgroup,
                                     int64_t start_localSGD_iter,
                                     bool post_local_gradient_allreduce, Logger logger)
    : process_group_(std::move(process_group)),
      subgroup_(std::move(subgroup)),
      start_localSGD_iter_(start_localSGD_iter),
      post_local_gradient_allreduce_(post_local_gradient_allreduce),
      logger_(std::move(logger)) {
  check_global_group(process_group_);
  check_start(start_localSGD_iter_);
  log("Local SGD will be started after " + std::to_string(start_localSGD_iter_) + " iterations");
}

void PostLocalSGDState::set_process_group(ProcessGroupPtr pg) {
  check_global_group(pg);
  process_group_ = std::move(pg);
  ++epoch_;
}

void PostLocalSGDState::set_subgroup(ProcessGroupPtr pg) {
  subgroup_ = std::move(pg);
  ++epoch_;
}

void PostLocalSGDState::set_start_localSGD_iter(int64_t value) {
  check_start(value);
  start_localSGD_iter_ = value;
  ++epoch_;
}

void PostLocalSGDState::set_post_local_gradient_allreduce(bool value) {
  post_local_gradient_allreduce_ = value;
  ++epoch_;
}

void PostLocalSGDState::set_iter(int64_t value) {
  TORCH_CHECK_VALUE(value >= 0, kWho, ": iter must be >= 0, got ", value);
  iter_ = value;
  ++epoch_;
}

void PostLocalSGDState::maybe_increase_iter(bool bucket_is_last) {
  // Bucket 0 is the last bucket of an iteration: count the iteration there.
  if (bucket_is_last) {
    ++iter_;
  }
  // As torch: logged on every call that leaves iter at start_localSGD_iter (the hook stops
  // calling once iter reaches it, so it logs once there).
  if (iter_ == start_localSGD_iter_) {
    log("Start to apply local SGD after " + std::to_string(iter_) + " iterations.");
  }
}

void PostLocalSGDState::log(const std::string& line) const {
  if (logger_) {
    logger_(line);
  } else {
    LOG(INFO) << line;
  }
}

c10::impl::GenericDict PostLocalSGDState::state_dict() const {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("format", std::string("ddpx.PostLocalSGDState/1"));
  d.insert("iter", iter_);
  d.insert("start_localSGD_iter", start_localSGD_iter_);
  d.insert("post_local_gradient_allreduce", post_local_gradient_allreduce_);
  return d;
}

void PostLocalSGDState::load_state_dict(const c10::impl::GenericDict& d) {
  auto get = [&](const char* key) -> c10::IValue {
    auto it = d.find(c10::IValue(std::string(key)));
    TORCH_CHECK_VALUE(it != d.end(), kWho, ".load_state_dict: missing key '", key, "'");
    return it->value();
  };
  // "format" is optional (a hand-written dict of the three values loads too).
  auto format = d.find(c10::IValue(std::string("format")));
  TORCH_CHECK_VALUE(
      format == d.end() || (format->value().isString() &&
                            format->value().toStringRef() == "ddpx.PostLocalSGDState/1"),
      kWho, ".load_state_dict: not a ddpx PostLocalSGDState state_dict");
  const c10::IValue iter = get("iter");
  const c10::IValue start = get("start_localSGD_iter");
  const c10::IValue allreduce = get("post_local_gradient_allreduce");
  TORCH_CHECK_TYPE(iter.isInt() && start.isInt() && allreduce.isBool(), kWho,
                   ".load_state_dict: 'iter' and 'start_localSGD_iter' must be ints and "
                   "'post_local_gradient_allreduce' a bool");
  check_start(start.toInt());
  TORCH_CHECK_VALUE(iter.toInt() >= 0, kWho, ".load_state_dict: iter must be >= 0, got ",
                    iter.toInt());
  iter_ = iter.toInt();
  start_localSGD_iter_ = start.toInt();
  post_local_gradient_allreduce_ = allreduce.toBool();
  ++epoch_;
}

PostLocalSGDHook::PostLocalSGDHook(std::shared_ptr<PostLocalSGDState> state)
    : state_(std::move(state)) {
  TORCH_CHECK_TYPE(state_ != nullptr, "post_localSGD_hook: state must be a PostLocalSGDState");
}

c10::intrusive_ptr<c10::ivalue::Future> PostLocalSGDHook::runHook(c10d::GradBucket& bucket) {
  const at::Tensor& buffer = bucket.getBuffer();
  detail::check_bucket(buffer, name(), /*sparse_ok=*/true);
  PostLocalSGDState& st = *state_;
  detail::agree_once(agreed_epoch_, st.process_group(), buffer.device(), st.epoch(), [&] {
    return detail::Fingerprint(name())
        .add("start_localSGD_iter", st.start_localSGD_iter())
        .add("post_local_gradient_allreduce", st.post_local_gradient_allreduce())
        .add("iter", st.iter());
  });
  // Global averaging for the first start_localSGD_iter iterations.
  if (st.iter() < st.start_localSGD_iter()) {
    st.maybe_increase_iter(bucket.isLast());
    return comm::allreduce_mean(st.process_group(), buffer, ExchangeMode::kAuto);
  }
  // Then no gradient synchronisation at all, or averaging within the subgroup only.
  if (!st.post_local_gradient_allreduce()) {
    return detail::completed_future(buffer);
  }
  TORCH_CHECK_VALUE(st.subgroup(), name(),
                    ": local SGD has started and post_local_gradient_allreduce is true, but the "
                    "state has no subgroup; pass the intra-node subgroup to PostLocalSGDState "
                    "(C++ cannot create it), or set post_local_gradient_allreduce to false");
  // A subgroup of one (e.g. one GPU per machine) averages nothing: dividing by 1 and an
  // allreduce over one rank leave the values as they are, so skip both.
  if (st.subgroup()->getSize() == 1) return detail::completed_future(buffer);
  return comm::allreduce_mean(st.subgroup(), buffer, ExchangeMode::kAuto);
}

CommHookPtr post_localSGD_hook(std::shared_ptr<PostLocalSGDState> state) {
  return std::make_shared<PostLocalSGDHook>(std::move(state));
}

}  // namespace hooks
}  // namespace ddpx
