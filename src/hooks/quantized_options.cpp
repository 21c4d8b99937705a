// quantized_hook's options: their checks and names, and what the hook derives from them (the
// codec, the draw streams, the fingerprint the ranks agree on).
#include <c10/util/Exception.h>
#include <ddpx/hooks/quantized_hook.h>

#include "hooks/quantized_memory.h"

namespace ddpx {
namespace hooks {

using comm::ExchangeMode;

void validate(const QuantizedOptions& o) {
  TORCH_CHECK_VALUE(o.bits == 1 || o.bits == 2 || o.bits == 4 || o.bits == 8, detail::kQuantizedWho,
                    ": bits must be 1, 2, 4 or 8, got ", o.bits);
  TORCH_CHECK_VALUE(o.block_size >= 8 && o.block_size % 8 == 0 && o.block_size <= (1 << 20),
                    detail::kQuantizedWho,
                    ": block_size must be a multiple of 8 in [8, 1048576], got ", o.block_size);
  TORCH_CHECK_VALUE(o.start_iter >= 0, detail::kQuantizedWho, ": start_iter must be >= 0, got ",
                    o.start_iter);
  // By name, so that an enum from C++ and a string from Python are refused alike.
  (void)parse_quantized_exchange(comm::exchange_mode_name(o.exchange));
  (void)parse_quantized_rotation(quantized_rotation_name(o.rotation));
  TORCH_CHECK_VALUE(
      o.rotation != QuantRotation::kHadamard || kernels::rotation_block_ok(o.block_size),
      detail::kQuantizedWho,
      ": rotation='hadamard' needs a block_size that is a power of "
      "two in [8, 8192], got ",
      o.block_size);
}

QuantRotation parse_quantized_rotation(const std::string& name) {
  if (name == "auto") return QuantRotation::kAuto;
  if (name == "hadamard") return QuantRotation::kHadamard;
  if (name == "none") return QuantRotation::kNone;
  TORCH_CHECK_VALUE(false, detail::kQuantizedWho,
                    ": rotation must be 'auto', 'hadamard' or 'none', got '", name, "'");
}

const char* quantized_rotation_name(QuantRotation rotation) {
  switch (rotation) {
    case QuantRotation::kAuto:
      return "auto";
    case QuantRotation::kHadamard:
      return "hadamard";
    case QuantRotation::kNone:
      return "none";
  }
  return "?";
}

bool rotates(const QuantizedOptions& o) {
  if (o.rotation == QuantRotation::kAuto) {
    return !o.use_error_feedback && kernels::rotation_block_ok(o.block_size);
  }
  return o.rotation == QuantRotation::kHadamard;
}

ExchangeMode parse_quantized_exchange(const std::string& name) {
  if (name == "auto") return ExchangeMode::kAuto;
  if (name == "allgather") return ExchangeMode::kAllgather;
  if (name == "reduce_scatter") return ExchangeMode::kReduceScatter;
  TORCH_CHECK_VALUE(false, detail::kQuantizedWho,
                    ": exchange must be 'auto', 'allgather' or 'reduce_scatter', got '", name, "'");
}

namespace detail {

uint64_t quant_stream_id(int64_t iter, int level, int64_t rank) {
  uint64_t s = static_cast<uint64_t>(iter);
  s = s * 0x100000001b3ULL + static_cast<uint64_t>(level);
  return s * 0x100000001b3ULL + static_cast<uint64_t>(rank);
}

std::shared_ptr<const comm::QuantCodec> quant_codec_of(const QuantizedOptions& o) {
  kernels::QuantSpec spec;
  spec.bits = static_cast<int>(o.bits);
  spec.block = o.block_size;
  spec.stochastic = o.stochastic_rounding;
  // Without error feedback nothing carries a 2-bit block's dropped values to the next step, so
  // its scale is fitted to the block (more values sent, less squared error); with it, max|v|
  // keeps every residual within half a step.
  spec.fitted_ternary = !o.use_error_feedback;
  spec.seed = static_cast<uint64_t>(o.random_seed);
  spec.rotate = rotates(o);
  spec.unbiased_sign = spec.rotate && !o.use_error_feedback;
  return std::make_shared<const comm::QuantCodec>(spec);
}

Fingerprint quantized_fingerprint(const QuantizedOptions& o, int64_t iter) {
  Fingerprint f("quantized_hook");
  f.add("bits", o.bits)
      .add("block_size", o.block_size)
      .add("use_error_feedback", o.use_error_feedback)
      .add("start_iter", o.start_iter)
      .add("random_seed", o.random_seed)
      .add("stochastic_rounding", o.stochastic_rounding)
      .add_choice("exchange", static_cast<int64_t>(o.exchange), exchange_mode_names())
      .add_choice("rotation", static_cast<int64_t>(o.rotation), {"auto", "hadamard", "none"})
      // The rotation's signs and the stochastic draws are keyed by the iteration: ranks one step
      // apart would decode each other's blocks with the wrong signs.
      .add("iter", iter);
  return f;
}

}  // namespace detail
}  // namespace hooks
}  // namespace ddpx
