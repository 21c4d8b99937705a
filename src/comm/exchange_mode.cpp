// ExchangeMode and the 16-bit rule. See include/ddpx/comm/exchange_mode.h.
#include <c10/util/Exception.h>
#include <ddpx/comm/exchange_mode.h>
#include <ddpx/common/compat.h>

namespace ddpx {
namespace comm {

bool backend_sums_natively(const c10d::ProcessGroup& pg, at::ScalarType dtype,
                           const c10::Device& device) {
  const bool is16 = dtype == at::kHalf || dtype == at::kBFloat16;
  return !(is16 && (device.is_cpu() ||
                    compat::backend_kind(pg, device.type()) == compat::BackendKind::kGloo));
}

ExchangeMode parse_exchange_mode(const std::string& name) {
  if (name == "auto") return ExchangeMode::kAuto;
  if (name == "allreduce") return ExchangeMode::kAllreduce;
  if (name == "allgather") return ExchangeMode::kAllgather;
  if (name == "reduce_scatter") return ExchangeMode::kReduceScatter;
  TORCH_CHECK(false,
              "exchange must be one of 'auto', 'allreduce', 'allgather', 'reduce_scatter', got '",
              name, "'");
}

const char* exchange_mode_name(ExchangeMode mode) {
  switch (mode) {
    case ExchangeMode::kAuto:
      return "auto";
    case ExchangeMode::kAllreduce:
      return "allreduce";
    case ExchangeMode::kAllgather:
      return "allgather";
    case ExchangeMode::kReduceScatter:
      return "reduce_scatter";
  }
  TORCH_CHECK(false, "invalid ExchangeMode ", static_cast<int>(mode));
}

ExchangeMode resolve_exchange_mode(ExchangeMode mode, const c10d::ProcessGroup& pg,
                                   at::ScalarType wire_dtype, const c10::Device& device,
                                   bool two_rounds) {
  if (mode != ExchangeMode::kAuto) return mode;
  if (backend_sums_natively(pg, wire_dtype, device)) return ExchangeMode::kAllreduce;
  // On 2 ranks both exchanges send numel 16-bit values; the gather does it in one round, with no
  // 16-bit rounding of the sum.
  return two_rounds && pg.getSize() >= 3 ? ExchangeMode::kReduceScatter : ExchangeMode::kAllgather;
}

}  // namespace comm
}  // namespace ddpx
