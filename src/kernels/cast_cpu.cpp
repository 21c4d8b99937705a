// CPU implementation of the compression kernels.
//
// Everything funnels through two block primitives: load a block of any dtype into fp32, and
// store an fp32 block into any dtype. The fp16 primitives use F16C (8 lanes per instruction)
// when the CPU has it, chosen once at run time; the portable fallbacks are branch-free bit
// manipulations that GCC auto-vectorises. bf16 is a 16-bit shift either way.
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cast.h"
#include "convert_inl.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define DDPX_X86 1
#endif

namespace ddpx {
namespace kernels {
namespace {

[[noreturn]] void bad_dtype(DType t) {
  throw std::invalid_argument("ddpx kernels: unsupported dtype tag " +
                              std::to_string(static_cast<int>(t)));
}

// Elements per block: 8 KiB of fp32 scratch on the stack, small enough to stay in L1.
constexpr int64_t kBlock = 2048;

// ---- portable conversions ------------------------------------------------------------------

void load_half_portable(const uint16_t* src, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = detail::half_to_float(src[i]);
}
void store_half_portable(const float* in, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = detail::float_to_half(in[i]);
}

#ifdef DDPX_X86
__attribute__((target("avx,f16c"))) void load_half_f16c(const uint16_t* src, float* out,
                                                        int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = detail::half_to_float(src[i]);
}
__attribute__((target("avx,f16c"))) void store_half_f16c(const float* in, uint16_t* dst,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = detail::float_to_half(in[i]);
}
// F16C from CPUID leaf 1 (clang 15 rejects "f16c" in __builtin_cpu_supports; GCC takes it);
// "avx" also says that the OS saves the YMM registers, which F16C's 256-bit forms need.
bool detect_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_F16C)) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx");
}
#else
bool detect_f16c() { return false; }
#endif

using LoadHalfFn = void (*)(const uint16_t*, float*, int64_t);
using StoreHalfFn = void (*)(const float*, uint16_t*, int64_t);

struct HalfOps {
  LoadHalfFn load = load_half_portable;
  StoreHalfFn store = store_half_portable;
  bool fast = false;
  HalfOps() {
#ifdef DDPX_X86
    if (detect_f16c()) {
      load = load_half_f16c;
      store = store_half_f16c;
      fast = true;
    }
#endif
  }
};
const HalfOps& half_ops() {
  static const HalfOps ops;
  return ops;
}

// ---- block primitives ---------------------------------------------------------------------

// out[0:n] = float(src[off : off+n]); src_t must not be fp64.
void load_f32(const void* src, DType t, int64_t off, int64_t n, float* out) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(out, static_cast<const float*>(src) + off, n * sizeof(float));
      return;
    case DType::kFloat16:
      half_ops().load(static_cast<const uint16_t*>(src) + off, out, n);
      return;
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + off;
      for (int64_t i = 0; i < n; ++i) out[i] = detail::bf16_to_float(s[i]);
      return;
    }
    default:
      bad_dtype(t);
  }
}

// dst[off : off+n] = cast(in[0:n]); dst_t must not be fp64.
void store_f32(const float* in, void* dst, DType t, int64_t off, int64_t n) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(static_cast<float*>(dst) + off, in, n * sizeof(float));
      return;
    case DType::kFloat16:
      half_ops().store(in, static_cast<uint16_t*>(dst) + off, n);
      return;
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + off;
      for (int64_t i = 0; i < n; ++i) d[i] = detail::float_to_bf16(in[i]);
      return;
    }
    default:
      bad_dtype(t);
  }
}

// fp64 paths: element-wise through double; rare (fp64 buckets), kept simple.
double load_one_f64(const void* src, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat64:
      return static_cast<const double*>(src)[i];
    case DType::kFloat32:
      return static_cast<const float*>(src)[i];
    case DType::kFloat16:
      return detail::half_to_float(static_cast<const uint16_t*>(src)[i]);
    case DType::kBFloat16:
      return detail::bf16_to_float(static_cast<const uint16_t*>(src)[i]);
  }
  bad_dtype(t);
}
void store_one_f64(double v, void* dst, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat64:
      static_cast<double*>(dst)[i] = v;
      return;
    case DType::kFloat32:
      static_cast<float*>(dst)[i] = static_cast<float>(v);
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(dst)[i] = detail::float_to_half(static_cast<float>(v));
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(dst)[i] = detail::float_to_bf16(static_cast<float>(v));
      return;
  }
  bad_dtype(t);
}

void check_dtype(DType t) {
  if (static_cast<int>(t) < 0 || static_cast<int>(t) > 3) bad_dtype(t);
}

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  bad_dtype(t);
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  bad_dtype(t);
}

float half_bits_to_float(uint16_t h) { return detail::half_to_float(h); }
uint16_t float_to_half_bits(float f) { return detail::float_to_half(f); }
float bf16_bits_to_float(uint16_t h) { return detail::bf16_to_float(h); }
uint16_t float_to_bf16_bits(float f) { return detail::float_to_bf16(f); }

bool cpu_has_fast_half() { return half_ops().fast; }

void scaled_cast_cpu(const void* src, DType src_t, void* dst, DType dst_t, int64_t n,
                     double scale) {
  check_dtype(src_t);
  check_dtype(dst_t);
  if (n <= 0) return;
  if (src_t == DType::kFloat64 || dst_t == DType::kFloat64) {
    const double s = scale;
    for (int64_t i = 0; i < n; ++i) store_one_f64(s * load_one_f64(src, src_t, i), dst, dst_t, i);
    return;
  }
  const float fscale = static_cast<float>(scale);  // fp32 arithmetic from here on
  if (src_t == DType::kFloat32 && dst_t == DType::kFloat32) {
    const float* s = static_cast<const float*>(src);
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] * fscale;
    return;
  }
  alignas(64) float buf[kBlock];
  for (int64_t off = 0; off < n; off += kBlock) {
    const int64_t m = n - off < kBlock ? n - off : kBlock;
    load_f32(src, src_t, off, m, buf);
    if (fscale != 1.0f) {
      for (int64_t i = 0; i < m; ++i) buf[i] *= fscale;
    }
    store_f32(buf, dst, dst_t, off, m);
  }
}

void sum_row_ptrs_cpu(const void* const* rows, DType src_t, int64_t nrows, int64_t n, void* dst,
                      DType dst_t, double scale) {
  check_dtype(src_t);
  check_dtype(dst_t);
  if (nrows < 1) throw std::invalid_argument("ddpx sum_rows_cpu: rows must be >= 1");
  if (n <= 0) return;
  if (src_t == DType::kFloat64 || dst_t == DType::kFloat64) {
    for (int64_t i = 0; i < n; ++i) {
      double acc = load_one_f64(rows[0], src_t, i);  // from row 0, so -0.0 sums stay -0.0
      for (int64_t r = 1; r < nrows; ++r) acc += load_one_f64(rows[r], src_t, i);
      store_one_f64(acc * scale, dst, dst_t, i);
    }
    return;
  }
  const float fscale = static_cast<float>(scale);
  alignas(64) float acc[kBlock];
  alignas(64) float tmp[kBlock];
  for (int64_t off = 0; off < n; off += kBlock) {
    const int64_t m = n - off < kBlock ? n - off : kBlock;
    load_f32(rows[0], src_t, off, m, acc);
    for (int64_t r = 1; r < nrows; ++r) {
      load_f32(rows[r], src_t, off, m, tmp);
      for (int64_t i = 0; i < m; ++i) acc[i] += tmp[i];
    }
    if (fscale != 1.0f) {
      for (int64_t i = 0; i < m; ++i) acc[i] *= fscale;
    }
    store_f32(acc, dst, dst_t, off, m);
  }
}

void sum_rows_cpu(const void* src, DType src_t, int64_t rows, int64_t n, void* dst, DType dst_t,
                  double scale) {
  check_dtype(src_t);
  if (rows < 1) throw std::invalid_argument("ddpx sum_rows_cpu: rows must be >= 1");
  std::vector<const void*> ptrs(static_cast<size_t>(rows));
  const size_t row_bytes = static_cast<size_t>(n > 0 ? n : 0) * dtype_size(src_t);
  for (int64_t r = 0; r < rows; ++r) {
    ptrs[static_cast<size_t>(r)] =
        static_cast<const char*>(src) + static_cast<size_t>(r) * row_bytes;
  }
  sum_row_ptrs_cpu(ptrs.data(), src_t, rows, n, dst, dst_t, scale);
}

}  // namespace kernels
}  // namespace ddpx
