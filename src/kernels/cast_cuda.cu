// CUDA implementation of the compression kernels: one fused pass per call (load, scale,
// accumulate, convert, store), grid-stride loops, on the caller's stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "cast_cuda.h"
#include "cuda_check.h"
#include "cuda_occupancy.h"

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

// Elements per thread per iteration, loaded and stored as vectors (16-byte transactions; a wider
// vector is two or four). 8 when either side is 16-bit, so that the 16-bit side moves 16 bytes
// too: at 4 (8 bytes) a full device of 256-thread blocks keeps about 16 KB of reads in flight per
// SM, short of the 25-30 KB that a device-copy rate needs (bandwidth x latency / SMs; an H200's
// datasheet: 4.8 TB/s x about 0.7 us / 132 SMs). provenance-ok: hardware constants, not a run's.
// 4 otherwise (fp32: 16 bytes, fp64: 32). Used only when every pointer is aligned to its vector
// size.
template <typename S, typename D>
constexpr int kVecElems = sizeof(S) == 2 || sizeof(D) == 2 ? 8 : 4;
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// dst[i] = store(load(src[i]) * scale). Consecutive threads touch consecutive vectors, so every
// warp access is coalesced. Inlined into the two kernels below, which differ only in whether
// src and dst may alias.
template <typename S, typename D>
__device__ __forceinline__ void scaled_cast_body(const S* src, D* dst, int64_t n, double scale,
                                                 bool vectorised) {
  using A = AccT<S, D>;
  constexpr int V = kVecElems<S, D>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vectorised) {
    const int64_t nv = n / V;
    const Vec<S, V>* sv = reinterpret_cast<const Vec<S, V>*>(src);
    Vec<D, V>* dv = reinterpret_cast<Vec<D, V>*>(dst);
    for (int64_t j = tid; j < nv; j += stride) {
      const Vec<S, V> in = sv[j];
      Vec<D, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        out.v[k] = Conv<D>::store(static_cast<A>(Conv<S>::load(in.v[k])) * A(scale));
      }
      dv[j] = out;
    }
    done = nv * V;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    dst[i] = Conv<D>::store(static_cast<A>(Conv<S>::load(src[i])) * A(scale));
  }
}

template <typename S, typename D>
__global__ void scaled_cast_kernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n,
                                   double scale, bool vectorised) {
  scaled_cast_body(src, dst, n, scale, vectorised);
}

// In place (src == dst, one dtype): without __restrict__, which would promise the compiler that
// the two never alias. Each element is read, then written, by one thread.
template <typename T>
__global__ void scale_in_place_kernel(T* data, int64_t n, double scale, bool vectorised) {
  scaled_cast_body<T, T>(data, data, n, scale, vectorised);
}

// The rows of a sum, in order: row r is packed[r] (rows of n elements back to back), except
// that, with own_row >= 0, row own_row is `own` and the packed rows skip it. This lets the
// exchange sum this rank's values where they are, with only the peers' rows received.
template <typename S>
struct RowSource {
  const S* packed;
  const S* own;
  int64_t own_row;  // -1: every row is packed
  int64_t n;
  __device__ const S* row(int64_t r) const {
    if (r == own_row) return own;
    return packed + (own_row >= 0 && r > own_row ? r - 1 : r) * n;
  }
};

// dst[i] = store(scale * sum_r rows[r][i]), accumulating from row 0 (not +0.0) so that a column
// of -0.0 sums to -0.0, as on the CPU. Vectorised by kVecElems when every row and dst are
// aligned; the per-element arithmetic is the same either way.
template <typename S, typename D>
__global__ void sum_rows_kernel(RowSource<S> in, int64_t rows, D* __restrict__ dst, double scale,
                                bool vectorised) {
  using A = AccT<S, D>;
  constexpr int V = kVecElems<S, D>;
  const int64_t n = in.n;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vectorised) {
    const int64_t nv = n / V;
    for (int64_t j = tid; j < nv; j += stride) {
      A acc[V];
      const Vec<S, V> first = reinterpret_cast<const Vec<S, V>*>(in.row(0))[j];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = static_cast<A>(Conv<S>::load(first.v[k]));
      for (int64_t r = 1; r < rows; ++r) {
        const Vec<S, V> v = reinterpret_cast<const Vec<S, V>*>(in.row(r))[j];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += static_cast<A>(Conv<S>::load(v.v[k]));
      }
      Vec<D, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = Conv<D>::store(acc[k] * A(scale));
      reinterpret_cast<Vec<D, V>*>(dst)[j] = out;
    }
    done = nv * V;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    A acc = static_cast<A>(Conv<S>::load(in.row(0)[i]));
    for (int64_t r = 1; r < rows; ++r) acc += static_cast<A>(Conv<S>::load(in.row(r)[i]));
    dst[i] = Conv<D>::store(acc * A(scale));
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

constexpr int kThreads = 256;

// Grid for `work` items of one thread each: enough blocks to cover them, at most as many as
// stay resident.
template <auto Kernel>
unsigned grid_for(int64_t work) {
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  int64_t cap = resident_blocks<Kernel, kThreads>();
  if (cap < 1) cap = 1;
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
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

}  // namespace

void scaled_cast_cuda(const void* src, DType src_t, void* dst, DType dst_t, int64_t n, double scale,
                      cudaStream_t stream) {
  if (n <= 0) return;
  if (src == dst && src_t != dst_t) {
    throw std::invalid_argument("ddpx scaled_cast_cuda: src and dst alias with different dtypes");
  }
  dispatch(src_t, [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    dispatch(dst_t, [&](auto* d_tag) {
      using D = std::remove_pointer_t<decltype(d_tag)>;
      constexpr int V = kVecElems<S, D>;
      const bool vec = aligned(src, sizeof(S) * V) && aligned(dst, sizeof(D) * V);
      const int64_t work = (n + V - 1) / V;
      if (src == dst) {
        if constexpr (std::is_same<S, D>::value) {
          scale_in_place_kernel<S>
              <<<grid_for<scale_in_place_kernel<S>>(work), kThreads, 0, stream>>>(
                  static_cast<S*>(dst), n, scale, vec);
        }
      } else {
        scaled_cast_kernel<S, D><<<grid_for<scaled_cast_kernel<S, D>>(work), kThreads, 0, stream>>>(
            static_cast<const S*>(src), static_cast<D*>(dst), n, scale, vec);
      }
      DDPX_CUDA_CHECK(cudaGetLastError());
    });
  });
}

void sum_rows_cuda(const void* src, DType src_t, int64_t rows, int64_t n, void* dst, DType dst_t,
                   double scale, cudaStream_t stream, const void* own, int64_t own_row) {
  if (rows < 1) throw std::invalid_argument("ddpx sum_rows_cuda: rows must be >= 1");
  if ((own == nullptr) != (own_row < 0) || own_row >= rows) {
    throw std::invalid_argument(
        "ddpx sum_rows_cuda: own and own_row go together, with 0 <= own_row < rows");
  }
  if (n <= 0) return;
  dispatch(src_t, [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    dispatch(dst_t, [&](auto* d_tag) {
      using D = std::remove_pointer_t<decltype(d_tag)>;
      const RowSource<S> in{static_cast<const S*>(src), static_cast<const S*>(own), own_row, n};
      constexpr int V = kVecElems<S, D>;
      // Every row starts aligned when the packed rows' start does and n is a multiple of V.
      const bool vec = n % V == 0 && aligned(src, sizeof(S) * V) &&
                       (own == nullptr || aligned(own, sizeof(S) * V)) &&
                       aligned(dst, sizeof(D) * V);
      sum_rows_kernel<S, D>
          <<<grid_for<sum_rows_kernel<S, D>>(vec ? n / V : n), kThreads, 0, stream>>>(
              in, rows, static_cast<D*>(dst), scale, vec);
      DDPX_CUDA_CHECK(cudaGetLastError());
    });
  });
}

}  // namespace kernels
}  // namespace ddpx
