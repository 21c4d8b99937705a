// CUDA implementation of the block quantization with error feedback (quantize_ef_cuda.h).
//   quantize: one CUDA block per quantization block: a strided pass reduces max|v|, sum|v| and
//     "non-finite" in shared memory; then each thread encodes the values of whole code bytes,
//     packs them and writes their residuals (the values are recomputed from x and the old
//     residual, which only this thread reads and writes).
//   dequantize (sum): one CUDA block per quantization block, a strided loop over its values (a
//     sum's exact term read at its row of the summation order).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "quantize_ef_cuda.h"
#include "quantize_ef_inl.h"

namespace ddpx {
namespace kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};
template <>
struct Elem<double> {
  __device__ static float load(double v) { return static_cast<float>(v); }
  __device__ static double store(float v) { return v; }
};
template <>
struct Elem<__half> {
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename T>
__device__ __forceinline__ float value_at(const T* x, const float* residual, int64_t i) {
  const float v = Elem<T>::load(x[i]);
  return residual ? detail::q_add(v, residual[i]) : v;
}

// A tree reduction of the block's kThreads shared slots into slot 0: `sum` by fp32 sums, `max`
// (unless null) by maximum, `ints` (unless null) by OR (or_ints) or by sum. Every thread calls it
// after writing its slots and a barrier; it returns after a barrier. The tree fixes the summation
// order, the same in both of the quantize kernel's reductions.
__device__ __forceinline__ void reduce_slots(float* sum, float* max, int* ints, bool or_ints) {
  for (int step = kThreads / 2; step > 0; step /= 2) {
    if (threadIdx.x < step) {
      const int i = threadIdx.x, j = threadIdx.x + step;
      sum[i] = __fadd_rn(sum[i], sum[j]);
      if (max) max[i] = fmaxf(max[i], max[j]);
      if (ints) ints[i] = or_ints ? (ints[i] | ints[j]) : ints[i] + ints[j];
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void quantize_ef_kernel(const T* x, float* residual, const BlockRef* refs, int64_t first,
                                   QuantSpec spec, float* scales, uint8_t* codes) {
  const int bits = spec.bits;
  const int64_t block = spec.block;
  const int64_t b = first + blockIdx.x;
  const int64_t begin = refs[b].begin;
  const int64_t len = refs[b].len;
  const uint64_t draw = refs[b].draw;
  float absmax = 0.0f, abssum = 0.0f;
  int nonfinite = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float a = fabsf(value_at(x, residual, begin + i));
    absmax = a > absmax ? a : absmax;
    abssum = __fadd_rn(abssum, a);
    nonfinite |= !(a <= 3.4028234663852886e+38f);
  }
  __shared__ float smax[kThreads], ssum[kThreads];
  __shared__ int sbad[kThreads], souter[kThreads];
  smax[threadIdx.x] = absmax;
  ssum[threadIdx.x] = abssum;
  sbad[threadIdx.x] = nonfinite;
  __syncthreads();
  reduce_slots(ssum, smax, sbad, /*or_ints=*/true);
  const bool bad = sbad[0] != 0;
  float scale = bad ? NAN : detail::block_scale(bits, spec.stochastic, smax[0], ssum[0], len);
  if (!bad && detail::ternary_fit(bits, spec.stochastic, spec.fitted_ternary)) {
    // The fitted 2-bit scale (quantize_ef.h): a second reduction, of the magnitudes above the
    // mean. `bad` and the branch are the same for every thread of the block, so the barriers are
    // reached by all.
    const float mean = detail::q_div(ssum[0], static_cast<float>(len));
    const float absmax = smax[0];
    float above_sum = 0.0f;
    int above = 0;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const float a = fabsf(value_at(x, residual, begin + i));
      if (a > mean) {
        above_sum = __fadd_rn(above_sum, a);
        ++above;
      }
    }
    __syncthreads();  // every thread has read ssum[0] and smax[0]
    ssum[threadIdx.x] = above_sum;
    sbad[threadIdx.x] = above;
    __syncthreads();
    reduce_slots(ssum, nullptr, sbad, /*or_ints=*/false);
    const float t = detail::ternary_scale(mean, ssum[0], sbad[0], absmax);
    // A third: the sums that choose between the ternary code at t and the midrise code.
    const float inv_t = detail::inverse_scale(t);
    const float h0 = detail::midrise_start(mean);
    float t1 = 0.0f, m1 = 0.0f;
    int tk = 0, outer = 0;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const float a = fabsf(value_at(x, residual, begin + i));
      if (detail::ternary_nonzero(a, inv_t)) {
        t1 = __fadd_rn(t1, a);
        ++tk;
      }
      const bool out = detail::midrise_outer(a, h0);
      m1 = __fadd_rn(m1, out ? detail::q_mul(3.0f, a) : a);
      outer += out ? 1 : 0;
    }
    __syncthreads();  // every thread has read ssum[0] and sbad[0]
    ssum[threadIdx.x] = t1;
    sbad[threadIdx.x] = tk;
    smax[threadIdx.x] = m1;  // a sum this time
    souter[threadIdx.x] = outer;
    __syncthreads();
    reduce_slots(ssum, nullptr, sbad, /*or_ints=*/false);
    reduce_slots(smax, nullptr, souter, /*or_ints=*/false);
    const float h = detail::midrise_step(t, ssum[0], sbad[0], smax[0], len + 8 * souter[0]);
    scale = h > 0.0f ? -h : t;
  }
  if (threadIdx.x == 0) scales[b] = scale;
  const float inv = detail::encode_factor(scale, bits);
  const int per = 8 / bits;
  const int64_t block_bytes = block * bits / 8;
  uint8_t* cb = codes + b * block_bytes;
  for (int64_t j = threadIdx.x; j < block_bytes; j += blockDim.x) {
    uint32_t byte = 0;
    for (int k = 0; k < per; ++k) {
      const int64_t i = j * per + k;
      if (i >= len) break;  // the short last block's unused codes stay 0
      if (bad) {
        if (residual) residual[begin + i] = 0.0f;
        continue;
      }
      const float v = value_at(x, residual, begin + i);
      const float u = spec.stochastic ? detail::uniform01(spec.seed, spec.stream,
                                                          draw + static_cast<uint64_t>(i))
                                      : 0.0f;
      const uint32_t code = detail::encode(v, scale, inv, bits, spec.stochastic, u);
      if (residual) residual[begin + i] = detail::q_add(v, -detail::decode(code, scale, bits));
      byte |= code << (k * bits);
    }
    cb[j] = static_cast<uint8_t>(byte);
  }
}

// Block m of a message of `blocks` blocks: dst gets its dequantized values (or, with `count`
// messages `message_bytes` apart, post_scale times their sum in message order).
// E: the exact term's element type (ExactTerm; float with a null x when there is none).
template <typename E>
__global__ void dequantize_sum_kernel(const uint8_t* messages, int64_t count, int64_t message_bytes,
                                      int64_t blocks, const BlockRef* refs, int bits, int64_t block,
                                      float post_scale, float* dst, const E* exact,
                                      const BlockRef* exact_refs, int64_t exact_row) {
  const int64_t m = blockIdx.x;
  const int64_t begin = refs[m].begin, len = refs[m].len;
  const int64_t block_bytes = block * bits / 8;
  const int64_t terms = count + (exact ? 1 : 0);
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t t = 0; t < terms; ++t) {
      if (exact && t == exact_row) {
        acc = __fadd_rn(acc, Elem<E>::load(exact[exact_refs[m].begin + i]));
        continue;
      }
      const int64_t r = exact && t > exact_row ? t - 1 : t;
      const uint8_t* message = messages + r * message_bytes;
      const float scale = reinterpret_cast<const float*>(message)[m];
      const uint8_t* cb = message + 4 * blocks + m * block_bytes;
      acc = __fadd_rn(acc, detail::decode(detail::unpack_code(cb, i, bits), scale, bits));
    }
    dst[begin + i] = __fmul_rn(acc, post_scale);
  }
}

template <typename D>
__global__ void dequantize_kernel(const uint8_t* message, int64_t blocks, const BlockRef* refs,
                                  int bits, int64_t block, D* dst) {
  const int64_t m = blockIdx.x;
  const int64_t begin = refs[m].begin, len = refs[m].len;
  const float scale = reinterpret_cast<const float*>(message)[m];
  const uint8_t* cb = message + 4 * blocks + m * (block * bits / 8);
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    dst[begin + i] = Elem<D>::store(detail::decode(detail::unpack_code(cb, i, bits), scale, bits));
  }
}

[[noreturn]] void bad_dtype(DType t) {
  throw std::invalid_argument("ddpx quantize_ef CUDA kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

// Grids of at most 2^31 - 1 blocks: launched in slices of message blocks.
constexpr int64_t kSlice = int64_t(1) << 30;

template <typename T>
void quantize_typed(const void* x, float* residual, const BlockRef* refs, int64_t blocks,
                    const QuantSpec& spec, float* scales, uint8_t* codes, cudaStream_t stream) {
  for (int64_t b = 0; b < blocks; b += kSlice) {
    const int64_t count = std::min(kSlice, blocks - b);
    quantize_ef_kernel<T><<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
        static_cast<const T*>(x), residual, refs, b, spec, scales, codes);
    DDPX_CUDA_CHECK(cudaGetLastError());
  }
}

template <typename D>
void dequantize_typed(const uint8_t* message, int64_t blocks, const BlockRef* refs, int bits,
                      int64_t block, void* dst, cudaStream_t stream) {
  dequantize_kernel<D><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      message, blocks, refs, bits, block, static_cast<D*>(dst));
  DDPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void quantize_ef_blocks_cuda(const void* x, DType t, float* residual, const BlockRef* refs,
                             int64_t blocks, const QuantSpec& spec, float* scales, uint8_t* codes,
                             cudaStream_t stream) {
  if (blocks <= 0) return;
  switch (t) {
    case DType::kFloat32:
      return quantize_typed<float>(x, residual, refs, blocks, spec, scales, codes, stream);
    case DType::kFloat64:
      return quantize_typed<double>(x, residual, refs, blocks, spec, scales, codes, stream);
    case DType::kFloat16:
      return quantize_typed<__half>(x, residual, refs, blocks, spec, scales, codes, stream);
    case DType::kBFloat16:
      return quantize_typed<__nv_bfloat16>(x, residual, refs, blocks, spec, scales, codes, stream);
  }
  bad_dtype(t);
}

void dequantize_sum_blocks_cuda(const uint8_t* messages, int64_t count, int64_t message_bytes,
                                int64_t blocks, const BlockRef* refs, int bits, int64_t block,
                                float post_scale, float* dst, const ExactTerm& exact,
                                cudaStream_t stream) {
  if (blocks <= 0) return;
  // One launch: message blocks beyond 2^31 - 1 would need 2^31 blocks of `block` values.
  const auto launch = [&](auto* x) {
    dequantize_sum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        messages, count, message_bytes, blocks, refs, bits, block, post_scale, dst, x, exact.refs,
        exact.row);
    DDPX_CUDA_CHECK(cudaGetLastError());
  };
  if (exact.x == nullptr) return launch(static_cast<const float*>(nullptr));
  switch (exact.t) {
    case DType::kFloat32:
      return launch(static_cast<const float*>(exact.x));
    case DType::kFloat64:
      return launch(static_cast<const double*>(exact.x));
    case DType::kFloat16:
      return launch(static_cast<const __half*>(exact.x));
    case DType::kBFloat16:
      return launch(static_cast<const __nv_bfloat16*>(exact.x));
  }
  bad_dtype(exact.t);
}

void dequantize_blocks_cuda(const uint8_t* message, int64_t blocks, const BlockRef* refs, int bits,
                            int64_t block, void* dst, DType dst_t, cudaStream_t stream) {
  if (blocks <= 0) return;
  switch (dst_t) {
    case DType::kFloat32:
      return dequantize_typed<float>(message, blocks, refs, bits, block, dst, stream);
    case DType::kFloat64:
      return dequantize_typed<double>(message, blocks, refs, bits, block, dst, stream);
    case DType::kFloat16:
      return dequantize_typed<__half>(message, blocks, refs, bits, block, dst, stream);
    case DType::kBFloat16:
      return dequantize_typed<__nv_bfloat16>(message, blocks, refs, bits, block, dst, stream);
  }
  bad_dtype(dst_t);
}

}  // namespace kernels
}  // namespace ddpx
