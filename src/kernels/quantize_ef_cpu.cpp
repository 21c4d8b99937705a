// CPU implementation of the block quantization with error feedback (quantize_ef.h). Per block:
// one pass loads the values (plus the residual) into a buffer and reduces max|v| and sum|v| in
// SIMD lanes, one encodes, packs and writes the new residual. Compiled with -ffp-contract=off,
// like the uint8 kernels: the CUDA kernels round every product and sum alike.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "convert_inl.h"
#include "quantize_ef.h"
#include "quantize_ef_inl.h"

namespace ddpx {
namespace kernels {
namespace {

[[noreturn]] void bad_dtype(DType t) {
  throw std::invalid_argument("ddpx quantize_ef kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

struct LoadF32 {
  using T = float;
  static float load(float v) { return v; }
};
struct LoadF64 {
  using T = double;
  static float load(double v) { return static_cast<float>(v); }
};
struct LoadF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return detail::half_to_float(v); }
};
struct LoadBF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return detail::bf16_to_float(v); }
};

template <typename L>
void quantize_blocks(const typename L::T* x, float* residual, const BlockRef* refs, int64_t first,
                     int64_t last, const QuantSpec& spec, float* scales, uint8_t* codes) {
  const int bits = spec.bits;
  const int64_t block = spec.block;
  const int64_t block_bytes = packed_block_bytes(bits, block);
  const int per = 8 / bits;
  // One block's values and codes; thread_local so that threads running other block ranges of the
  // same message do not share them.
  thread_local std::vector<float> v;
  thread_local std::vector<uint8_t> code;
  v.resize(static_cast<size_t>(block));
  code.resize(static_cast<size_t>(block));
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = refs[b].begin;
    const int64_t len = refs[b].len;
    const typename L::T* xb = x + begin;
    float* rb = residual ? residual + begin : nullptr;
    float* vb = v.data();
    float absmax = 0.0f, abssum = 0.0f;
    int nonfinite = 0;
    if (rb) {
#pragma omp simd reduction(max : absmax) reduction(+ : abssum) reduction(| : nonfinite)
      for (int64_t i = 0; i < len; ++i) {
        const float value = detail::q_add(L::load(xb[i]), rb[i]);
        vb[i] = value;
        const float a = fabsf(value);
        absmax = a > absmax ? a : absmax;
        abssum += a;
        nonfinite |= !(a <= 3.4028234663852886e+38f);  // NaN or infinity
      }
    } else {
#pragma omp simd reduction(max : absmax) reduction(+ : abssum) reduction(| : nonfinite)
      for (int64_t i = 0; i < len; ++i) {
        const float value = L::load(xb[i]);
        vb[i] = value;
        const float a = fabsf(value);
        absmax = a > absmax ? a : absmax;
        abssum += a;
        nonfinite |= !(a <= 3.4028234663852886e+38f);
      }
    }
    uint8_t* cb = codes + b * block_bytes;
    if (nonfinite) {
      scales[b] = NAN;
      std::memset(cb, 0, static_cast<size_t>(block_bytes));
      if (rb) std::fill(rb, rb + len, 0.0f);
      continue;
    }
    const float scale = detail::block_scale(bits, spec.stochastic, absmax, abssum, len);
    scales[b] = scale;
    uint8_t* cv = code.data();
    if (spec.stochastic) {
      const uint64_t base = refs[b].draw;
      for (int64_t i = 0; i < len; ++i) {
        const float u = detail::uniform01(spec.seed, spec.stream, base + static_cast<uint64_t>(i));
        cv[i] = static_cast<uint8_t>(detail::encode(vb[i], scale, bits, true, u));
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        cv[i] = static_cast<uint8_t>(detail::encode(vb[i], scale, bits, false, 0.0f));
      }
    }
    // The short last block's unused codes are zeros: a message's bytes depend on its values only.
    std::fill(cv + len, cv + block, uint8_t(0));
    if (rb) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        rb[i] = detail::q_add(vb[i], -detail::decode(cv[i], scale, bits));
      }
    }
    if (bits == 8) {
      std::memcpy(cb, cv, static_cast<size_t>(block));
    } else {
      for (int64_t j = 0; j < block_bytes; ++j) {
        uint32_t byte = 0;
        for (int k = 0; k < per; ++k) byte |= static_cast<uint32_t>(cv[j * per + k]) << (k * bits);
        cb[j] = static_cast<uint8_t>(byte);
      }
    }
  }
}

template <typename Store>
void dequantize_blocks(const uint8_t* message, int64_t blocks, const BlockRef* refs, int64_t first,
                       int64_t last, int bits, int64_t block, Store store) {
  const auto* scales = reinterpret_cast<const float*>(message);
  const uint8_t* codes = message + 4 * blocks;
  const int64_t block_bytes = packed_block_bytes(bits, block);
  for (int64_t b = first; b < last; ++b) {
    const int64_t begin = refs[b].begin;
    const int64_t len = refs[b].len;
    const float scale = scales[b];
    const uint8_t* cb = codes + b * block_bytes;
    if (bits == 8) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) store(begin + i, detail::decode(cb[i], scale, 8));
    } else {
      for (int64_t i = 0; i < len; ++i) {
        store(begin + i, detail::decode(detail::unpack_code(cb, i, bits), scale, bits));
      }
    }
  }
}

}  // namespace

bool valid_quant_bits(int bits) { return bits == 1 || bits == 2 || bits == 4 || bits == 8; }

int64_t packed_block_bytes(int bits, int64_t block) { return block * bits / 8; }

int64_t quantized_message_bytes(int64_t blocks, int bits, int64_t block) {
  return (4 * blocks + blocks * packed_block_bytes(bits, block) + 15) / 16 * 16;
}

void quantize_ef_blocks_cpu(const void* x, DType t, float* residual, const BlockRef* refs,
                            int64_t first, int64_t last, const QuantSpec& spec, float* scales,
                            uint8_t* codes) {
  switch (t) {
    case DType::kFloat32:
      return quantize_blocks<LoadF32>(static_cast<const float*>(x), residual, refs, first, last,
                                      spec, scales, codes);
    case DType::kFloat64:
      return quantize_blocks<LoadF64>(static_cast<const double*>(x), residual, refs, first, last,
                                      spec, scales, codes);
    case DType::kFloat16:
      return quantize_blocks<LoadF16>(static_cast<const uint16_t*>(x), residual, refs, first, last,
                                      spec, scales, codes);
    case DType::kBFloat16:
      return quantize_blocks<LoadBF16>(static_cast<const uint16_t*>(x), residual, refs, first, last,
                                       spec, scales, codes);
  }
  bad_dtype(t);
}

void dequantize_sum_blocks_cpu(const uint8_t* messages, int64_t count, int64_t message_bytes,
                               int64_t blocks, const BlockRef* refs, int64_t first, int64_t last,
                               int bits, int64_t block, float post_scale, float* dst) {
  for (int64_t b = first; b < last; ++b) {
    std::fill(dst + refs[b].begin, dst + refs[b].begin + refs[b].len, 0.0f);
  }
  for (int64_t r = 0; r < count; ++r) {
    dequantize_blocks(messages + r * message_bytes, blocks, refs, first, last, bits, block,
                      [dst](int64_t i, float d) { dst[i] = detail::q_add(dst[i], d); });
  }
  for (int64_t b = first; b < last; ++b) {
    float* d = dst + refs[b].begin;
    for (int64_t i = 0; i < refs[b].len; ++i) d[i] = detail::q_mul(d[i], post_scale);
  }
}

void dequantize_blocks_cpu(const uint8_t* message, int64_t blocks, const BlockRef* refs,
                           int64_t first, int64_t last, int bits, int64_t block, void* dst,
                           DType dst_t) {
  switch (dst_t) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(dst);
      return dequantize_blocks(message, blocks, refs, first, last, bits, block,
                               [d](int64_t i, float v) { d[i] = v; });
    }
    case DType::kFloat64: {
      double* d = static_cast<double*>(dst);
      return dequantize_blocks(message, blocks, refs, first, last, bits, block,
                               [d](int64_t i, float v) { d[i] = v; });
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return dequantize_blocks(message, blocks, refs, first, last, bits, block,
                               [d](int64_t i, float v) { d[i] = detail::float_to_half(v); });
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return dequantize_blocks(message, blocks, refs, first, last, bits, block,
                               [d](int64_t i, float v) { d[i] = detail::float_to_bf16(v); });
    }
  }
  bad_dtype(dst_t);
}

}  // namespace kernels
}  // namespace ddpx
