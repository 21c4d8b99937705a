#include <ddpx/hooks/exchange.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <ddpx/common/compat.h>
#include <ddpx/compression/cast.h>

namespace ddpx {
namespace hooks {

ExchangeMode parse_exchange_mode(const std::string& name) {
  if (name == "auto") return ExchangeMode::kAuto;
  if (name == "allreduce") return ExchangeMode::kAllreduce;
  if (name == "allgather") return ExchangeMode::kAllgather;
  TORCH_CHECK(false, "exchange must be one of 'auto', 'allreduce', 'allgather', got '", name, "'");
}

const char* exchange_mode_name(ExchangeMode mode) {
  switch (mode) {
    case ExchangeMode::kAuto:
      return "auto";
    case ExchangeMode::kAllreduce:
      return "allreduce";
    case ExchangeMode::kAllgather:
      return "allgather";
  }
  TORCH_CHECK(false, "invalid ExchangeMode ", static_cast<int>(mode));
}

ExchangeMode resolve_exchange_mode(ExchangeMode mode, const c10d::ProcessGroup& pg,
                                   const at::Tensor& values) {
  if (mode != ExchangeMode::kAuto) return mode;
  const bool is16 = values.element_size() == 2;
  if (is16 && (values.device().is_cpu() || compat::backend_name(pg) == "gloo")) {
    return ExchangeMode::kAllgather;
  }
  return ExchangeMode::kAllreduce;
}

c10::intrusive_ptr<c10::ivalue::Future> sum_into(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                 const at::Tensor& values, const at::Tensor& out,
                                                 double scale, ExchangeMode mode) {
  TORCH_INTERNAL_ASSERT(pg);
  TORCH_INTERNAL_ASSERT(values.is_contiguous() && out.is_contiguous());
  TORCH_INTERNAL_ASSERT(values.numel() == out.numel());
  const auto resolved = resolve_exchange_mode(mode, *pg, values);

  if (resolved == ExchangeMode::kAllgather) {
    const int64_t world = pg->getSize();
    const int64_t n = values.numel();
    const int64_t nbytes = n * static_cast<int64_t>(values.element_size());
    // Gloo's allgather moves bytes; viewing the values as uint8 keeps any dtype on the wire
    // (torch 1.13's Gloo has no bfloat16 at all).
    at::Tensor gathered = at::empty({world, nbytes}, values.options().dtype(at::kByte));
    std::vector<at::Tensor> inputs{values.reshape({-1}).view(at::kByte)};
    std::vector<std::vector<at::Tensor>> outputs{gathered.unbind(0)};
    auto work = pg->allgather(outputs, inputs);
    return work->getFuture()->then(
        [gathered, values, out, scale, world, n](c10::ivalue::Future& f) {
          f.value();  // rethrows a failed collective: then() does not propagate errors itself
          sum_rows_into(gathered.view(values.scalar_type()).view({world, n}), out, scale);
          return c10::IValue(out);
        },
        c10::TensorType::get());
  }

  std::vector<at::Tensor> tensors{values};
  auto work = pg->allreduce(tensors);
  return work->getFuture()->then(
      [values, out, scale](c10::ivalue::Future& f) {
        f.value();  // rethrows a failed collective
        if (!values.is_same(out) || scale != 1.0) scaled_cast_into(values, out, scale);
        return c10::IValue(out);
      },
      c10::TensorType::get());
}

c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& tensor, ExchangeMode mode) {
  const double inv_world = 1.0 / pg->getSize();
  if (resolve_exchange_mode(mode, *pg, tensor) == ExchangeMode::kAllgather) {
    return sum_into(pg, tensor, tensor, inv_world, ExchangeMode::kAllgather);
  }
  tensor.div_(pg->getSize());
  return sum_into(pg, tensor, tensor, 1.0, ExchangeMode::kAllreduce);
}

}  // namespace hooks
}  // namespace ddpx
