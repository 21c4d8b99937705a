// CUDA implementation of the compression kernels: one fused pass per call (load, scale,
// accumulate, convert, store), grid-stride loops, on the caller's stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "cast_cuda.h"
#include "cuda_check.h"

namespace ddpx {
namespace kernels {
namespace {

template <typename T>
struct Conv;
template <>
struct Conv<float> {
  using Acc = float;
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};
template <>
struct Conv<double> {
  using Acc = double;
  __device__ static double load(double v) { return v; }
  __device__ static double store(double v) { return v; }
};
template <>
struct Conv<__half> {
  using Acc = float;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Conv<__nv_bfloat16> {
  using Acc = float;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

// fp64 when either side is fp64, else fp32.
template <typename S, typename D>
using AccT =
    typename std::conditional<std::is_same<S, double>::value || std::is_same<D, double>::value,
                              double, float>::type;

// Vector of kVec elements loaded or stored as one transaction (16 bytes for fp32 x 4, 8 bytes
// for 16-bit x 4). Used only when both pointers are aligned to their vector size.
constexpr int kVec = 4;
template <typename T>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};

// Consecutive threads touch consecutive vectors, so every warp access is coalesced.
template <typename S, typename D>
__global__ void scaled_cast_kernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n,
                                   double scale, bool vectorised) {
  using A = AccT<S, D>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vectorised) {
    const int64_t nv = n / kVec;
    const Vec<S>* sv = reinterpret_cast<const Vec<S>*>(src);
    Vec<D>* dv = reinterpret_cast<Vec<D>*>(dst);
    for (int64_t j = tid; j < nv; j += stride) {
      const Vec<S> in = sv[j];
      Vec<D> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        out.v[k] = Conv<D>::store(static_cast<A>(Conv<S>::load(in.v[k])) * A(scale));
      }
      dv[j] = out;
    }
    done = nv * kVec;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    dst[i] = Conv<D>::store(static_cast<A>(Conv<S>::load(src[i])) * A(scale));
  }
}

template <typename S, typename D>
__global__ void sum_rows_kernel(const S* __restrict__ src, int64_t rows, int64_t n,
                                D* __restrict__ dst, double scale) {
  using A = AccT<S, D>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    // Start from row 0 (not +0.0) so that a column of -0.0 sums to -0.0, as on the CPU.
    A acc = static_cast<A>(Conv<S>::load(src[i]));
    for (int64_t r = 1; r < rows; ++r) acc += static_cast<A>(Conv<S>::load(src[r * n + i]));
    dst[i] = Conv<D>::store(acc * A(scale));
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int grid_for(int64_t work, int threads) {
  int device = 0, sms = 0;
  DDPX_CUDA_CHECK(cudaGetDevice(&device));
  DDPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t wanted = (work + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sms) * 8;  // enough blocks to fill every SM
  return static_cast<int>(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

// Calls f with a typed null pointer for `t`: the one dtype switch of this file.
template <typename F>
void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      f(static_cast<float*>(nullptr));
      return;
    case DType::kFloat64:
      f(static_cast<double*>(nullptr));
      return;
    case DType::kFloat16:
      f(static_cast<__half*>(nullptr));
      return;
    case DType::kBFloat16:
      f(static_cast<__nv_bfloat16*>(nullptr));
      return;
  }
  throw std::invalid_argument("ddpx CUDA kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

constexpr int kThreads = 256;

}  // namespace

void scaled_cast_cuda(const void* src, DType src_t, void* dst, DType dst_t, int64_t n, double scale,
                      cudaStream_t stream) {
  if (n <= 0) return;
  dispatch(src_t, [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    dispatch(dst_t, [&](auto* d_tag) {
      using D = std::remove_pointer_t<decltype(d_tag)>;
      const bool vec = aligned(src, sizeof(S) * kVec) && aligned(dst, sizeof(D) * kVec);
      const int grid = grid_for((n + kVec - 1) / kVec, kThreads);
      scaled_cast_kernel<S, D><<<grid, kThreads, 0, stream>>>(static_cast<const S*>(src),
                                                              static_cast<D*>(dst), n, scale, vec);
      DDPX_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void sum_rows_cuda(const void* src, DType src_t, int64_t rows, int64_t n, void* dst, DType dst_t,
                   double scale, cudaStream_t stream) {
  if (rows < 1) throw std::invalid_argument("ddpx sum_rows_cuda: rows must be >= 1");
  if (n <= 0) return;
  dispatch(src_t, [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    dispatch(dst_t, [&](auto* d_tag) {
      using D = std::remove_pointer_t<decltype(d_tag)>;
      const int grid = grid_for(n, kThreads);
      sum_rows_kernel<S, D><<<grid, kThreads, 0, stream>>>(static_cast<const S*>(src), rows, n,
                                                           static_cast<D*>(dst), scale);
      DDPX_CUDA_CHECK(cudaGetLastError());
    });
  });
}

}  // namespace kernels
}  // namespace ddpx
