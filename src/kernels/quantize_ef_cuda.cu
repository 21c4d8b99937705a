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

// In shared memory, y = H y for len = 2^k values: the CPU kernels' stages (quantize_ef_cpu.cpp,
// hadamard), each pair (i, i + h) to (a + b, a - b), so the sums are the CPU's bit for bit.
// Every thread of the block calls it after a barrier; it returns after one.
__device__ void hadamard_shared(float* y, int64_t len) {
  for (int64_t h = 1; h < len; h *= 2) {
    for (int64_t p = threadIdx.x; p < len / 2; p += blockDim.x) {
      const int64_t i = (p / h) * 2 * h + (p % h);
      const float a = y[i], b = y[i + h];
      y[i] = __fadd_rn(a, b);
      y[i + h] = __fadd_rn(a, -b);
    }
    __syncthreads();
  }
}

// Value i of a rotated block, rotated back: y[i] times D's sign and the inverse factor.
__device__ __forceinline__ float unrotated(const float* y, int64_t i, uint64_t seed,
                                           uint64_t stream, uint64_t draw, float factor) {
  const bool flip = detail::rotation_flip(seed, stream, draw + static_cast<uint64_t>(i));
  return detail::q_mul(y[i], flip ? -factor : factor);
}

// Dynamic shared memory: a rotated block's values (block floats; none without rotation).
extern __shared__ float rotated_block[];

template <typename T>
__global__ void quantize_ef_kernel(const T* x, float* residual, const BlockRef* refs, int64_t first,
                                   QuantSpec spec, float* scales, uint8_t* codes) {
  const int bits = spec.bits;
  const int64_t block = spec.block;
  const int64_t b = first + blockIdx.x;
  const int64_t begin = refs[b].begin;
  const int64_t len = refs[b].len;
  const uint64_t draw = refs[b].draw;
  // A whole block of a rotating spec: its values, rotated (c H D v), in shared memory; the
  // codes and scale are theirs. The condition is the same for every thread of the block.
  const bool rot = spec.rotate && len == block;
  float* y = rotated_block;
  if (rot) {
    const float c = detail::rotation_forward_factor(block);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const bool flip =
          detail::rotation_flip(spec.seed, spec.stream, draw + static_cast<uint64_t>(i));
      y[i] = detail::q_mul(value_at(x, residual, begin + i), flip ? -c : c);
    }
    __syncthreads();
    hadamard_shared(y, len);
  }
  // The value the codes are taken of: rotated or as it is.
  const auto val = [&](int64_t i) { return rot ? y[i] : value_at(x, residual, begin + i); };
  float absmax = 0.0f, abssum = 0.0f;
  // Bit 0: a NaN or infinity; bit 1: a nonzero value of x itself (an idle block has none).
  int flags = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float a = fabsf(val(i));
    absmax = a > absmax ? a : absmax;
    abssum = __fadd_rn(abssum, a);
    flags |= !(a <= 3.4028234663852886e+38f) ? 1 : 0;
    flags |= Elem<T>::load(x[begin + i]) != 0.0f ? 2 : 0;
  }
  __shared__ float smax[kThreads], ssum[kThreads];
  __shared__ int sbad[kThreads], souter[kThreads];
  smax[threadIdx.x] = absmax;
  ssum[threadIdx.x] = abssum;
  sbad[threadIdx.x] = flags;
  __syncthreads();
  reduce_slots(ssum, smax, sbad, /*or_ints=*/true);
  const bool bad = (sbad[0] & 1) != 0;
  // With error feedback, a block whose values are all zero (a parameter DDP found unused) sends
  // zeros and keeps its residual (quantize_ef.h): the same for every thread of the block.
  const bool idle = residual != nullptr && !bad && (sbad[0] & 2) == 0;
  const bool stochastic =
      detail::rounds_stochastically(spec.stochastic, spec.unbiased_sign, bits, rot);
  float scale = bad    ? NAN
                : idle ? 0.0f
                       : detail::block_scale(bits, stochastic, smax[0], ssum[0], len);
  if (!bad && !idle && detail::ternary_fit(bits, spec.stochastic, spec.fitted_ternary)) {
    // The fitted 2-bit scale (quantize_ef.h): a second reduction, of the magnitudes above the
    // mean. `bad` and the branch are the same for every thread of the block, so the barriers are
    // reached by all.
    const float mean = detail::q_div(ssum[0], static_cast<float>(len));
    const float absmax = smax[0];
    float above_sum = 0.0f;
    int above = 0;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const float a = fabsf(val(i));
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
      const float a = fabsf(val(i));
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
  } else if (!bad && !idle && rot && bits == 1 && spec.unbiased_sign && !spec.stochastic) {
    // The unbiased sign scale (quantize_ef_inl.h): sums of |y| / max|y| and its square.
    const float absmax = smax[0];
    const float inv_m = detail::inverse_scale(absmax);
    float sq = 0.0f, l1 = 0.0f;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const float a = detail::q_mul(fabsf(y[i]), inv_m);
      sq = __fadd_rn(sq, detail::q_mul(a, a));
      l1 = __fadd_rn(l1, a);
    }
    __syncthreads();  // every thread has read smax[0]
    ssum[threadIdx.x] = sq;
    smax[threadIdx.x] = l1;  // a sum this time
    __syncthreads();
    reduce_slots(ssum, nullptr, nullptr, /*or_ints=*/false);
    reduce_slots(smax, nullptr, nullptr, /*or_ints=*/false);
    if (inv_m > 0.0f) scale = detail::unbiased_sign_scale(absmax, ssum[0], smax[0]);
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
      if (idle) {
        byte |= detail::zero_code(bits) << (k * bits);
        continue;
      }
      const float v = val(i);
      const float u =
          stochastic ? detail::uniform01(spec.seed, spec.stream, draw + static_cast<uint64_t>(i))
                     : 0.0f;
      const uint32_t code = detail::encode(v, scale, inv, bits, stochastic, u);
      const float d = detail::decode(code, scale, bits);
      if (rot) {
        y[i] = d;  // rotated back below (only this thread reads and writes y[i] here)
      } else if (residual) {
        residual[begin + i] = detail::q_add(v, -d);
      }
      byte |= code << (k * bits);
    }
    cb[j] = static_cast<uint8_t>(byte);
  }
  if (rot && !bad && !idle && residual) {
    // The residual of a rotated block: v minus what the receiver decodes.
    __syncthreads();
    hadamard_shared(y, len);
    const float f = detail::rotation_inverse_factor(block);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      residual[begin + i] = detail::q_add(value_at(x, residual, begin + i),
                                          -unrotated(y, i, spec.seed, spec.stream, draw, f));
    }
  }
}

// Block m of a message of `blocks` blocks: dst gets its dequantized values (or, with `count`
// messages `message_bytes` apart, the sum of post_scale times each, in message order).
// E: the exact term's element type (ExactTerm; float with a null x when there is none).
template <typename E>
__global__ void dequantize_sum_kernel(const uint8_t* messages, int64_t count, int64_t message_bytes,
                                      int64_t blocks, const BlockRef* refs, int bits, int64_t block,
                                      float post_scale, float* dst, const E* exact,
                                      const BlockRef* exact_refs, int64_t exact_row,
                                      Unrotate unrotate) {
  const int64_t m = blockIdx.x;
  const int64_t begin = refs[m].begin, len = refs[m].len;
  const int64_t block_bytes = block * bits / 8;
  const int64_t terms = count + (exact ? 1 : 0);
  if (unrotate.on && len == block) {
    // Term by term: the message's block decoded into shared memory and rotated back, then added
    // into dst (the accumulator; the CPU's order: 0, then every term in turn, then the scale).
    float* y = rotated_block;
    const float f = detail::rotation_inverse_factor(block);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) dst[begin + i] = 0.0f;
    for (int64_t t = 0; t < terms; ++t) {
      if (exact && t == exact_row) {
        for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
          dst[begin + i] = __fadd_rn(
              dst[begin + i], __fmul_rn(Elem<E>::load(exact[exact_refs[m].begin + i]), post_scale));
        }
        continue;
      }
      const int64_t r = exact && t > exact_row ? t - 1 : t;
      const uint8_t* message = messages + r * message_bytes;
      const float scale = reinterpret_cast<const float*>(message)[m];
      const uint8_t* cb = message + 4 * blocks + m * block_bytes;
      for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
        y[i] = detail::decode(detail::unpack_code(cb, i, bits), scale, bits);
      }
      __syncthreads();
      hadamard_shared(y, len);
      const uint64_t stream = unrotate.stream_of(t);
      for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
        dst[begin + i] = __fadd_rn(
            dst[begin + i],
            __fmul_rn(unrotated(y, i, unrotate.seed, stream, refs[m].draw, f), post_scale));
      }
      __syncthreads();  // y is read before the next term overwrites it
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t t = 0; t < terms; ++t) {
      if (exact && t == exact_row) {
        acc = __fadd_rn(acc, __fmul_rn(Elem<E>::load(exact[exact_refs[m].begin + i]), post_scale));
        continue;
      }
      const int64_t r = exact && t > exact_row ? t - 1 : t;
      const uint8_t* message = messages + r * message_bytes;
      const float scale = reinterpret_cast<const float*>(message)[m];
      const uint8_t* cb = message + 4 * blocks + m * block_bytes;
      acc = __fadd_rn(acc, __fmul_rn(detail::decode(detail::unpack_code(cb, i, bits), scale, bits),
                                     post_scale));
    }
    dst[begin + i] = acc;
  }
}

template <typename D>
__global__ void dequantize_kernel(const uint8_t* message, int64_t blocks, const BlockRef* refs,
                                  int bits, int64_t block, D* dst, Unrotate unrotate) {
  const int64_t m = blockIdx.x;
  const int64_t begin = refs[m].begin, len = refs[m].len;
  const float scale = reinterpret_cast<const float*>(message)[m];
  const uint8_t* cb = message + 4 * blocks + m * (block * bits / 8);
  if (unrotate.on && len == block) {
    float* y = rotated_block;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      y[i] = detail::decode(detail::unpack_code(cb, i, bits), scale, bits);
    }
    __syncthreads();
    hadamard_shared(y, len);
    const float f = detail::rotation_inverse_factor(block);
    const uint64_t stream = unrotate.stream_of(0);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      dst[begin + i] = Elem<D>::store(unrotated(y, i, unrotate.seed, stream, refs[m].draw, f));
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    dst[begin + i] = Elem<D>::store(detail::decode(detail::unpack_code(cb, i, bits), scale, bits));
  }
}

[[noreturn]] void bad_dtype(DType t) {
  throw std::invalid_argument("ddpx quantize_ef CUDA kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

// The dynamic shared memory of a launch: one rotated block (rotation_block_ok bounds it to 32
// KiB), or none.
size_t rotation_smem(bool rotate, int64_t block) {
  if (!rotate) return 0;
  if (!rotation_block_ok(block)) {
    throw std::invalid_argument("ddpx quantize_ef CUDA kernels: cannot rotate blocks of " +
                                std::to_string(block) + " values");
  }
  return static_cast<size_t>(block) * sizeof(float);
}

// Grids of at most 2^31 - 1 blocks: launched in slices of message blocks.
constexpr int64_t kSlice = int64_t(1) << 30;

template <typename T>
void quantize_typed(const void* x, float* residual, const BlockRef* refs, int64_t blocks,
                    const QuantSpec& spec, float* scales, uint8_t* codes, cudaStream_t stream) {
  for (int64_t b = 0; b < blocks; b += kSlice) {
    const int64_t count = std::min(kSlice, blocks - b);
    quantize_ef_kernel<T>
        <<<static_cast<unsigned>(count), kThreads, rotation_smem(spec.rotate, spec.block),
           stream>>>(static_cast<const T*>(x), residual, refs, b, spec, scales, codes);
    DDPX_CUDA_CHECK(cudaGetLastError());
  }
}

template <typename D>
void dequantize_typed(const uint8_t* message, int64_t blocks, const BlockRef* refs, int bits,
                      int64_t block, void* dst, const Unrotate& unrotate, cudaStream_t stream) {
  dequantize_kernel<D>
      <<<static_cast<unsigned>(blocks), kThreads, rotation_smem(unrotate.on, block), stream>>>(
          message, blocks, refs, bits, block, static_cast<D*>(dst), unrotate);
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
                                const Unrotate& unrotate, cudaStream_t stream) {
  if (blocks <= 0) return;
  const size_t smem = rotation_smem(unrotate.on, block);
  // One launch: message blocks beyond 2^31 - 1 would need 2^31 blocks of `block` values.
  const auto launch = [&](auto* x) {
    dequantize_sum_kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
        messages, count, message_bytes, blocks, refs, bits, block, post_scale, dst, x, exact.refs,
        exact.row, unrotate);
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
                            int64_t block, void* dst, DType dst_t, const Unrotate& unrotate,
                            cudaStream_t stream) {
  if (blocks <= 0) return;
  switch (dst_t) {
    case DType::kFloat32:
      return dequantize_typed<float>(message, blocks, refs, bits, block, dst, unrotate, stream);
    case DType::kFloat64:
      return dequantize_typed<double>(message, blocks, refs, bits, block, dst, unrotate, stream);
    case DType::kFloat16:
      return dequantize_typed<__half>(message, blocks, refs, bits, block, dst, unrotate, stream);
    case DType::kBFloat16:
      return dequantize_typed<__nv_bfloat16>(message, blocks, refs, bits, block, dst, unrotate,
                                             stream);
  }
  bad_dtype(dst_t);
}

}  // namespace kernels
}  // namespace ddpx
