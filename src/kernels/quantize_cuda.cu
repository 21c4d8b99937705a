// CUDA implementation of the uint8 min-max quantization (quantize_cuda.h): the same per-channel
// and per-element steps as the CPU kernels (quantize_inl.h), so both give the same bits.
//   1. partial min/max: channel c is split into `splits` slices, one block each;
//   2. parameters: one thread per channel folds its slices and writes scale and zero point;
//   3. quantize, 4. dequantize-and-average: grid-stride loops over the values.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "quantize_cuda.h"
#include "quantize_inl.h"

namespace ddpx {
namespace kernels {
namespace {

constexpr int kThreads = 256;
// Values one block of the min/max pass covers at least, so that a per-tensor bucket (one
// channel of n values) spreads over many blocks and a small channel takes one.
constexpr int64_t kSliceValues = 16384;
constexpr int64_t kMaxBlocks = 8192;

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  __device__ static float load(float v) { return v; }
  __device__ static float rounded_quotient(float v, float s) {
    return detail::round_even(__fdiv_rn(v, s));
  }
  __device__ static float store(float v) { return v; }
};
template <>
struct Elem<double> {
  __device__ static float load(double v) { return static_cast<float>(v); }
  __device__ static double rounded_quotient(double v, float s) {
    return detail::round_even(__ddiv_rn(v, static_cast<double>(s)));
  }
  __device__ static double store(float v) { return v; }
};
template <>
struct Elem<__half> {
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static float rounded_quotient(__half v, float s) {
    return detail::round_even(__half2float(__float2half_rn(__fdiv_rn(__half2float(v), s))));
  }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static float rounded_quotient(__nv_bfloat16 v, float s) {
    return detail::round_even(
        __bfloat162float(__float2bfloat16_rn(__fdiv_rn(__bfloat162float(v), s))));
  }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// NaN-propagating min and max: a NaN anywhere makes the channel's parameters NaN.
__device__ __forceinline__ float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// Block (c, s) of a grid of channels * splits blocks: min and max of slice s of channel c,
// started at 0 (see quantize_cpu.cpp), into partial[2 * (c * splits + s) + {0, 1}].
template <typename T>
__global__ void partial_minmax_kernel(const T* x, int64_t n, int64_t channel, int64_t splits,
                                      float* partial) {
  const int64_t c = blockIdx.x / splits;
  const int64_t s = blockIdx.x % splits;
  const int64_t cbegin = min64(n, c * channel);
  const int64_t cend = min64(n, cbegin + channel);
  const int64_t slice = (cend - cbegin + splits - 1) / splits;
  const int64_t begin = min64(cend, cbegin + s * slice);
  const int64_t end = min64(cend, begin + slice);
  float mn = 0.0f, mx = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = Elem<T>::load(x[i]);
    mn = nan_min(v, mn);
    mx = nan_max(v, mx);
  }
  __shared__ float smin[kThreads], smax[kThreads];
  smin[threadIdx.x] = mn;
  smax[threadIdx.x] = mx;
  __syncthreads();
  for (int step = kThreads / 2; step > 0; step /= 2) {
    if (threadIdx.x < step) {
      smin[threadIdx.x] = nan_min(smin[threadIdx.x + step], smin[threadIdx.x]);
      smax[threadIdx.x] = nan_max(smax[threadIdx.x + step], smax[threadIdx.x]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = smin[0];
    partial[2 * blockIdx.x + 1] = smax[0];
  }
}

__global__ void qparams_kernel(const float* partial, int64_t channels, int64_t splits,
                               float* scales, float* zero_points) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float mn = 0.0f, mx = 0.0f;
  for (int64_t s = 0; s < splits; ++s) {
    mn = nan_min(partial[2 * (c * splits + s)], mn);
    mx = nan_max(partial[2 * (c * splits + s) + 1], mx);
  }
  // A NaN reaches minmax_qparams as a non-finite min or max either way.
  detail::minmax_qparams(mn, mx, &scales[c], &zero_points[c]);
}

template <typename T>
__global__ void quantize_kernel(const T* x, int64_t n, int64_t channel, const float* scales,
                                const float* zero_points, uint8_t* q, int64_t padded_end) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < padded_end;
       i += stride) {
    if (i >= n) {
      q[i] = 0;  // the row's padding
      continue;
    }
    const int64_t c = i / channel;
    const float scale = scales[c];
    q[i] = scale == scale ? detail::to_byte(Elem<T>::rounded_quotient(x[i], scale), zero_points[c])
                          : uint8_t(0);
  }
}

template <typename D>
__global__ void dequantize_mean_kernel(const uint8_t* peers, const uint8_t* own, int64_t own_row,
                                       int64_t rows, int64_t n, int64_t channel, int64_t channels,
                                       int64_t row_bytes, D* dst) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float divisor = static_cast<float>(rows);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t c = i / channel;
    float acc = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* base =
          r == own_row ? own : peers + (r < own_row || own_row < 0 ? r : r - 1) * row_bytes;
      const float* scales = reinterpret_cast<const float*>(base);
      const uint8_t q = base[8 * channels + i];
      acc = __fadd_rn(acc, detail::dequantize(q, scales[c], scales[channels + c]));
    }
    dst[i] = Elem<D>::store(__fdiv_rn(acc, divisor));
  }
}

int64_t splits_of(int64_t channel, int64_t channels) {
  const int64_t per_channel = std::max<int64_t>(1, (channel + kSliceValues - 1) / kSliceValues);
  // Enough blocks for a device, never more than the channel's slices.
  return std::max<int64_t>(1, std::min(per_channel, kMaxBlocks / std::max<int64_t>(1, channels)));
}

int grid_for(int64_t work) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min(kMaxBlocks, (work + kThreads - 1) / kThreads)));
}

template <typename T>
void quantize_row_typed(const void* x, int64_t n, int64_t channel, int64_t channels, uint8_t* row,
                        void* workspace, cudaStream_t stream) {
  const int64_t splits = splits_of(channel, channels);
  float* partial = static_cast<float*>(workspace);
  float* scales = reinterpret_cast<float*>(row);
  float* zero_points = scales + channels;
  uint8_t* q = row + 8 * channels;
  const T* xt = static_cast<const T*>(x);
  partial_minmax_kernel<T><<<static_cast<unsigned>(channels * splits), kThreads, 0, stream>>>(
      xt, n, channel, splits, partial);
  DDPX_CUDA_CHECK(cudaGetLastError());
  qparams_kernel<<<static_cast<unsigned>((channels + kThreads - 1) / kThreads), kThreads, 0,
                   stream>>>(partial, channels, splits, scales, zero_points);
  DDPX_CUDA_CHECK(cudaGetLastError());
  const int64_t padded_end = quantized_row_bytes(n, channels) - 8 * channels;
  quantize_kernel<T><<<grid_for(padded_end), kThreads, 0, stream>>>(xt, n, channel, scales,
                                                                    zero_points, q, padded_end);
  DDPX_CUDA_CHECK(cudaGetLastError());
}

template <typename D>
void dequantize_mean_typed(const uint8_t* peers, const uint8_t* own, int64_t own_row, int64_t rows,
                           int64_t n, int64_t channel, int64_t channels, void* dst,
                           cudaStream_t stream) {
  dequantize_mean_kernel<D><<<grid_for(n), kThreads, 0, stream>>>(
      peers, own, own_row, rows, n, channel, channels, quantized_row_bytes(n, channels),
      static_cast<D*>(dst));
  DDPX_CUDA_CHECK(cudaGetLastError());
}

[[noreturn]] void bad_dtype(DType t) {
  throw std::invalid_argument("ddpx quantize kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

}  // namespace

int64_t quantize_row_cuda_workspace_bytes(int64_t n, int64_t channel, int64_t channels) {
  (void)n;
  return 2 * static_cast<int64_t>(sizeof(float)) * channels * splits_of(channel, channels);
}

void quantize_row_cuda(const void* x, DType t, int64_t n, int64_t channel, int64_t channels,
                       uint8_t* row, void* workspace, cudaStream_t stream) {
  if (channels == 0) return;
  switch (t) {
    case DType::kFloat32:
      return quantize_row_typed<float>(x, n, channel, channels, row, workspace, stream);
    case DType::kFloat64:
      return quantize_row_typed<double>(x, n, channel, channels, row, workspace, stream);
    case DType::kFloat16:
      return quantize_row_typed<__half>(x, n, channel, channels, row, workspace, stream);
    case DType::kBFloat16:
      return quantize_row_typed<__nv_bfloat16>(x, n, channel, channels, row, workspace, stream);
  }
  bad_dtype(t);
}

void dequantize_mean_cuda(const uint8_t* peers, const uint8_t* own, int64_t own_row, int64_t rows,
                          int64_t n, int64_t channel, int64_t channels, void* dst, DType dst_t,
                          cudaStream_t stream) {
  if (n == 0) return;
  switch (dst_t) {
    case DType::kFloat32:
      return dequantize_mean_typed<float>(peers, own, own_row, rows, n, channel, channels, dst,
                                          stream);
    case DType::kFloat64:
      return dequantize_mean_typed<double>(peers, own, own_row, rows, n, channel, channels, dst,
                                           stream);
    case DType::kFloat16:
      return dequantize_mean_typed<__half>(peers, own, own_row, rows, n, channel, channels, dst,
                                           stream);
    case DType::kBFloat16:
      return dequantize_mean_typed<__nv_bfloat16>(peers, own, own_row, rows, n, channel, channels,
                                                  dst, stream);
  }
  bad_dtype(dst_t);
}

}  // namespace kernels
}  // namespace ddpx
