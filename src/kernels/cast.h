// Torch-free compression kernels: raw pointers, element counts and a dtype tag.
//
// The compute core of the fp16/bf16 hooks and of the 16-bit exchange. The ATen layer (ops/cast.h)
// validates tensors and picks the CPU or CUDA variant (cast_cuda.h) by device.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddpx {
namespace kernels {

// Floating-point element types the kernels understand.
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Size of one element of `t` in bytes.
size_t dtype_size(DType t);
// Short name of `t` ("float32", ...), for error messages.
const char* dtype_name(DType t);

// dst[i] = cast<dst_t>(scale * src[i]) for i < n.
// Arithmetic is fp32 (fp64 when either side is fp64); fp16/bf16 results round to nearest even.
// `src` and `dst` may alias only when src_t == dst_t. Thread-safe; runs on the calling thread.
void scaled_cast_cpu(const void* src, DType src_t, void* dst, DType dst_t, int64_t n, double scale);

// dst[i] = cast<dst_t>(scale * sum_{r < rows} src[r * n + i]) for i < n.
// Accumulates in fp32 (fp64 when either side is fp64), so 16-bit inputs are summed without
// intermediate 16-bit rounding. `dst` must not overlap `src`. Runs on the calling thread.
void sum_rows_cpu(const void* src, DType src_t, int64_t rows, int64_t n, void* dst, DType dst_t,
                  double scale);

// Same, with the rows anywhere: dst[i] = cast<dst_t>(scale * sum_r rows[r][i]), summed in the
// order of `rows`. Lets a caller sum its own values in place with received ones, uncopied.
void sum_row_ptrs_cpu(const void* const* rows, DType src_t, int64_t nrows, int64_t n, void* dst,
                      DType dst_t, double scale);

// Scalar reference conversions (IEEE binary16 and bfloat16, round to nearest even, NaN kept).
// Exposed for tests and for code that converts single values.
float half_bits_to_float(uint16_t h);
uint16_t float_to_half_bits(float f);
float bf16_bits_to_float(uint16_t h);
uint16_t float_to_bf16_bits(float f);

// True when the CPU kernels use the F16C/AVX2 fast path on this machine.
bool cpu_has_fast_half();

}  // namespace kernels
}  // namespace ddpx
