// CPU implementation of the uint8 min-max quantization (quantize.h): one pass per channel for
// its min and max, one to quantize, plain loops that GCC vectorises (the rounding is two
// additions, see quantize_inl.h). Compiled with -ffp-contract=off: every product and sum is
// rounded on its own, as in torch.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "convert_inl.h"
#include "quantize.h"
#include "quantize_inl.h"

namespace ddpx {
namespace kernels {
namespace {

[[noreturn]] void bad_dtype(DType t) {
  throw std::invalid_argument("ddpx quantize kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

// Per element type: the value as fp32 (what the observer sees) and q before the zero point,
// round(x / scale) with the quotient rounded to the element type first.
struct F32 {
  using T = float;
  static float load(float v) { return v; }
  static float rounded_quotient(float v, float s) {
    return detail::round_even(detail::q_div(v, s));
  }
};
struct F64 {
  using T = double;
  static float load(double v) { return static_cast<float>(v); }
  static double rounded_quotient(double v, float s) {
    return detail::round_even(v / static_cast<double>(s));
  }
};
struct F16 {
  using T = uint16_t;
  static float load(uint16_t v) { return detail::half_to_float(v); }
  static float rounded_quotient(uint16_t v, float s) {
    const float q = detail::q_div(detail::half_to_float(v), s);
    return detail::round_even(detail::half_to_float(detail::float_to_half(q)));
  }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return detail::bf16_to_float(v); }
  static float rounded_quotient(uint16_t v, float s) {
    const float q = detail::q_div(detail::bf16_to_float(v), s);
    return detail::round_even(detail::bf16_to_float(detail::float_to_bf16(q)));
  }
};

template <typename E>
void quantize_row(const typename E::T* x, int64_t n, int64_t channel, int64_t channels,
                  uint8_t* row) {
  float* scales = reinterpret_cast<float*>(row);
  float* zero_points = scales + channels;
  uint8_t* q = row + 8 * channels;
  for (int64_t c = 0; c < channels; ++c) {
    const int64_t begin = std::min(n, c * channel);
    const int64_t end = std::min(n, begin + channel);
    const typename E::T* xc = x + begin;
    const int64_t len = end - begin;
    // Started at 0: the observer's parameters take min(min, 0) and max(max, 0) anyway, and a
    // channel's zero padding (or an all-padding channel) is covered by the same 0.
    // Eight independent lanes, so that GCC keeps them in one vector register (a single running
    // min is a loop-carried chain it will not vectorise without -ffast-math).
    constexpr int kLanes = 8;
    float mns[kLanes] = {}, mxs[kLanes] = {};
    int nans[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float v = E::load(xc[i + l]);
        mns[l] = v < mns[l] ? v : mns[l];
        mxs[l] = v > mxs[l] ? v : mxs[l];
        nans[l] |= v != v;
      }
    }
    for (; i < len; ++i) {
      const float v = E::load(xc[i]);
      mns[0] = v < mns[0] ? v : mns[0];
      mxs[0] = v > mxs[0] ? v : mxs[0];
      nans[0] |= v != v;
    }
    float mn = 0.0f, mx = 0.0f;
    int nan = 0;
    for (int l = 0; l < kLanes; ++l) {
      mn = mns[l] < mn ? mns[l] : mn;
      mx = mxs[l] > mx ? mxs[l] : mx;
      nan |= nans[l];
    }
    float scale, zero_point;
    detail::minmax_qparams(nan ? NAN : mn, mx, &scale, &zero_point);
    scales[c] = scale;
    zero_points[c] = zero_point;
    uint8_t* qc = q + begin;
    if (!(scale == scale)) {
      std::memset(qc, 0, static_cast<size_t>(len));
      continue;
    }
    for (int64_t i = 0; i < len; ++i) {
      qc[i] = detail::to_byte(E::rounded_quotient(xc[i], scale), zero_point);
    }
  }
  const int64_t used = 8 * channels + n;
  std::memset(row + used, 0, static_cast<size_t>(quantized_row_bytes(n, channels) - used));
}

template <typename Store>
void dequantize_mean(const uint8_t* peers, const uint8_t* own, int64_t own_row, int64_t rows,
                     int64_t n, int64_t channel, int64_t channels, Store store) {
  const int64_t row_bytes = quantized_row_bytes(n, channels);
  // Blocks of at most kBlock values of one channel: the fp32 sums stay in L1 while every row
  // adds its values in rank order.
  constexpr int64_t kBlock = 2048;
  float acc[kBlock];
  for (int64_t c = 0; c < channels; ++c) {
    const int64_t cbegin = std::min(n, c * channel);
    const int64_t cend = std::min(n, cbegin + channel);
    for (int64_t begin = cbegin; begin < cend; begin += kBlock) {
      const int64_t len = std::min(kBlock, cend - begin);
      for (int64_t i = 0; i < len; ++i) acc[i] = 0.0f;
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* base =
            r == own_row ? own : peers + (r < own_row || own_row < 0 ? r : r - 1) * row_bytes;
        float scale, zero_point;
        std::memcpy(&scale, base + 4 * c, sizeof scale);
        std::memcpy(&zero_point, base + 4 * (channels + c), sizeof zero_point);
        const uint8_t* q = base + 8 * channels + begin;
        for (int64_t i = 0; i < len; ++i) {
          acc[i] = acc[i] + detail::dequantize(q[i], scale, zero_point);
        }
      }
      const float divisor = static_cast<float>(rows);
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / divisor;
      store(acc, begin, len);
    }
  }
}

}  // namespace

int64_t quantized_row_bytes(int64_t n, int64_t channels) {
  return (8 * channels + n + 15) / 16 * 16;
}

void quantize_row_cpu(const void* x, DType t, int64_t n, int64_t channel, int64_t channels,
                      uint8_t* row) {
  switch (t) {
    case DType::kFloat32:
      return quantize_row<F32>(static_cast<const float*>(x), n, channel, channels, row);
    case DType::kFloat64:
      return quantize_row<F64>(static_cast<const double*>(x), n, channel, channels, row);
    case DType::kFloat16:
      return quantize_row<F16>(static_cast<const uint16_t*>(x), n, channel, channels, row);
    case DType::kBFloat16:
      return quantize_row<BF16>(static_cast<const uint16_t*>(x), n, channel, channels, row);
  }
  bad_dtype(t);
}

void dequantize_mean_cpu(const uint8_t* peers, const uint8_t* own, int64_t own_row, int64_t rows,
                         int64_t n, int64_t channel, int64_t channels, void* dst, DType dst_t) {
  switch (dst_t) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(dst);
      return dequantize_mean(peers, own, own_row, rows, n, channel, channels,
                             [d](const float* v, int64_t at, int64_t len) {
                               std::memcpy(d + at, v, static_cast<size_t>(len) * sizeof(float));
                             });
    }
    case DType::kFloat64: {
      double* d = static_cast<double*>(dst);
      return dequantize_mean(peers, own, own_row, rows, n, channel, channels,
                             [d](const float* v, int64_t at, int64_t len) {
                               for (int64_t i = 0; i < len; ++i) d[at + i] = v[i];
                             });
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return dequantize_mean(peers, own, own_row, rows, n, channel, channels,
                             [d](const float* v, int64_t at, int64_t len) {
                               for (int64_t i = 0; i < len; ++i) {
                                 d[at + i] = detail::float_to_half(v[i]);
                               }
                             });
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      return dequantize_mean(peers, own, own_row, rows, n, channel, channels,
                             [d](const float* v, int64_t at, int64_t len) {
                               for (int64_t i = 0; i < len; ++i) {
                                 d[at + i] = detail::float_to_bf16(v[i]);
                               }
                             });
    }
  }
  bad_dtype(dst_t);
}

}  // namespace kernels
}  // namespace ddpx
