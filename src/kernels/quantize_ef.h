// Torch-free block quantization with error feedback: the compute core of quantized_hook. The ATen
// layer (ops/quantized.h) validates tensors, splits the blocks over threads and picks the CPU or
// CUDA variant (quantize_ef_cuda.h) by device.
//
// Values are cut into blocks of `block` values (the last one may be short). A block travels as
// one fp32 scale and `block` codes of `bits` bits (8, 4, 2 or 1), packed little-end first into
// bytes. A *message* of `blocks` blocks is
//   float32 scale[blocks] | packed codes, block after block | zero padding
// of quantized_message_bytes(blocks, bits, block) bytes (a multiple of 16). `block * bits` must
// be a multiple of 8, so that every block's codes start on a byte.
//
// The codes. bits >= 2: symmetric integers q in [-qmax, qmax], qmax = 2^(bits-1) - 1 (127, 7, 1),
// stored as q + 2^(bits-1); scale = max|v| / qmax over the block, so every finite value is in
// range; q = round_half_even(v / scale), or with stochastic rounding floor(v / scale + u) for a
// uniform u in [0, 1). 1 bit: the sign (code 1 for v >= 0), dequantized to +-scale with
// scale = mean |v| over the block (the L2-optimal scale of a sign code), or, stochastic,
// scale = max|v| and code 1 with probability (1 + v / scale) / 2 (unbiased).
//
// The fitted 2-bit codes (QuantSpec::fitted_ternary; 2 bits with nearest rounding only). With
// max|v| as the scale of 3 levels, every value below max|v| / 2 is sent as 0: most of a
// bell-shaped block. The fitted mode picks, per block, the one of two codes with the smaller
// squared error:
// - ternary: levels -t, 0, t, t = the mean of the magnitudes above the block's mean magnitude
//   (mean |v| when none is above), at most max|v|: the least-squares level of the values that the
//   mean keeps. Stored scale t >= 0. It sends zeros exactly (a sparse block).
// - midrise: the four levels -3h, -h, h, 3h (all four codes; no zero), h the least-squares half
//   step for the levels that h0 = 0.6267 mean |v| (half the rms of a normal block) assigns;
//   value v gets q = floor(v / 2h) clamped to [-2, 1], code q + 2, dequantized (2 q + 1) h.
//   Stored scale -h < 0 (a scale is otherwise never negative: its sign bit marks the code). On a
//   normal block its squared error is about 0.12 of the block's energy, against 0.19 for the
//   ternary code (0.65 for max|v|).
// Both clip: a value beyond the top level is sent at it. That suits a run without error feedback;
// with it, the clipped excess goes to the residual, which can grow step after step (under max|v|
// a residual stays within scale / 2).

// Error bounds, per element of a finite block (v the value quantized, d its dequantized value):
//   bits >= 2, nearest:    |v - d| <= scale / 2  (up to fp32 rounding of scale * q)
//   bits >= 2, stochastic: |v - d| <  scale, and E[d] = v
//   2 bits, fitted:        ternary: |v - d| <= max(scale / 2, |v| - scale), mean |v| <= scale
//                          <= max|v|; midrise (scale -h): |v - d| <= max(h, |v| - 3h)
//   1 bit: d = +-scale with v's sign; stochastic: E[d] = v.
// Error feedback: the residual written back is v - d in fp32. For bits >= 2 with nearest
// rounding that subtraction is exact (d has v's sign and lies within a factor 2 of v, or is 0:
// Sterbenz), so d + residual == v bit for bit. Stochastic rounding keeps that only for |v| >= scale
// (d is then within a factor 2 of v); a smaller value may round up to +-scale, more than twice
// it, and its residual is the rounded difference (|error| <= ulp(scale) / 2). So is the residual
// for 1 bit, for a fitted 2-bit value clipped from above 2 scale, and for a midrise block.
//
// Rotated blocks (QuantSpec::rotate): the bounds above hold for the rotated values y; the
// decoded block is the inverse rotation of y's decoded values, so its squared error is y's (up to
// the butterflies' rounding) and the residual is v minus that, rounded. A finite block whose
// rotated values overflow (max|v| beyond 2^128 / 2^floor(k/2)) is sent as a non-finite one.
//
// Idle blocks: with a residual, a block whose own values (x, before the residual is added) are
// all zero sends scale 0 and the zero code, and keeps its residual as it is for a later step. DDP
// hands a hook zeros for a parameter no rank used in a step (find_unused_parameters) and then
// discards what the hook returns for it, so anything sent for it would be lost.
//
// Non-finite blocks: a block holding a NaN or an infinity gets scale NaN and codes 0, so it
// dequantizes to NaN on every rank that receives it (never to a finite value), and its residual
// is reset to 0 (a residual that kept the NaN would poison every later step; the step that saw
// it is the one a GradScaler skips). A block whose scale is 0 or underflows to 0 (all zeros, or
// denormals too small to divide) sends zeros and keeps the whole value in the residual.
#pragma once

#include <cstdint>

#include "cast.h"

// Members the CUDA kernels call too.
#if defined(__CUDACC__)
#define DDPX_QEF_HOST_DEVICE __host__ __device__
#else
#define DDPX_QEF_HOST_DEVICE
#endif

namespace ddpx {
namespace kernels {

// The bit widths quantized_hook supports.
bool valid_quant_bits(int bits);
// Whether blocks of `block` values can be rotated (QuantSpec::rotate): a power of two in [8,
// 8192] (the CUDA kernels hold a block in 32 KiB of shared memory).
bool rotation_block_ok(int64_t block);
// Bytes of the packed codes of one block.
int64_t packed_block_bytes(int bits, int64_t block);
// Bytes of a message of `blocks` blocks (see above).
int64_t quantized_message_bytes(int64_t blocks, int bits, int64_t block);

// Where a message's block lives among the values: [begin, begin + len) with 1 <= len <= block,
// and `draw`, the stochastic generator's index of its first value (value i of the block draws
// at draw + i). A message's blocks may come from anywhere (quantized_hook cuts every parameter
// into blocks of its own and sends each owner the blocks it owns); they must not overlap.
struct BlockRef {
  int64_t begin;
  int64_t len;
  uint64_t draw;
};

struct QuantSpec {
  int bits = 8;
  int64_t block = 256;
  bool stochastic = false;
  // Stochastic rounding draws u from a counter-based generator: u depends only on (seed, stream,
  // the value's draw index), so a run is reproducible and a resumed one draws what the original
  // drew.
  uint64_t seed = 0;
  uint64_t stream = 0;
  // 2 bits with nearest rounding: the fitted codes (ternary or midrise, per block) instead of
  // max|v| (see above); no effect on other widths or with stochastic rounding, which is unbiased
  // only while every value is within the scale.
  bool fitted_ternary = false;
  // Rotate every whole block (len == block; block a power of two) before it is quantized, with
  // the random signs of (seed, stream) (quantize_ef_inl.h): the codes and scale are those of the
  // rotated values, which are spread evenly however the block's own values were (one large
  // value, a sparse block), and the receiver rotates back (Unrotate). A short block goes as it
  // is. With stochastic rounding, the rounding draws use the same (seed, stream).
  bool rotate = false;
  // 1 bit, rotated, nearest rounding: the unbiased scale sum y^2 / sum |y| instead of mean |y|
  // (unbiased_sign_scale): more squared error per step, none of it a bias. A block that is not
  // rotated (short, or of a spec that does not rotate) takes the stochastic sign code instead,
  // unbiased too: every value's error has mean zero whatever block it is in.
  bool unbiased_sign = false;
};

// What the receiver of rotated messages needs to rotate them back: term t of a sum (its index in
// the summation order, ExactTerm included) was rotated with stream stream0 + t * stream_step and
// the seed; on == false: no message was rotated.
struct Unrotate {
  bool on = false;
  uint64_t seed = 0;
  uint64_t stream0 = 0;
  uint64_t stream_step = 0;
  DDPX_QEF_HOST_DEVICE uint64_t stream_of(int64_t term) const {
    return stream0 + static_cast<uint64_t>(term) * stream_step;
  }
};

// Quantizes the message blocks [first, last) of `refs` into the message (`scales`: its scale
// array, `codes`: its packed codes; block m's codes at codes + m * packed_block_bytes). Value i
// is cast<float>(x[i]), plus residual[i] when `residual` is not null, which then receives the new
// residual. `x` is of dtype t. Blocks are independent: threads may run disjoint ranges of one
// message. Runs on the calling thread.
void quantize_ef_blocks_cpu(const void* x, DType t, float* residual, const BlockRef* refs,
                            int64_t first, int64_t last, const QuantSpec& spec, float* scales,
                            uint8_t* codes);

// A term of a dequantized sum that is not quantized: the owner's own values, which need not
// cross a wire. Block m of the sum reads its values at x + refs[m].begin (refs[m].len of them,
// the same as the sum's block m), cast to float; the term comes `row`-th in the summation order
// (0: before every message, count: after all of them). x == nullptr: no such term.
struct ExactTerm {
  const void* x = nullptr;
  DType t = DType::kFloat32;
  const BlockRef* refs = nullptr;
  int64_t row = 0;
};

// For the message blocks [first, last) of `refs`: dst[i] = the sum over the messages, in order,
// of post_scale * their dequantized value i (with post_scale * the exact term's value i at its
// row), in fp32. Each term is scaled before it is added (a mean of values near the largest float
// does not overflow, as allreduce_hook's divide-then-sum does not). Message r starts at messages +
// r * message_bytes; every message holds the same blocks
// (`blocks` of them). dst is fp32, indexed like the refs.
void dequantize_sum_blocks_cpu(const uint8_t* messages, int64_t count, int64_t message_bytes,
                               int64_t blocks, const BlockRef* refs, int64_t first, int64_t last,
                               int bits, int64_t block, float post_scale, float* dst,
                               const ExactTerm& exact = ExactTerm(),
                               const Unrotate& unrotate = Unrotate());

// dst[i] = cast<dst_t>(dequantized value i) for the message blocks [first, last) of `refs`
// (the message holds `blocks` blocks).
void dequantize_blocks_cpu(const uint8_t* message, int64_t blocks, const BlockRef* refs,
                           int64_t first, int64_t last, int bits, int64_t block, void* dst,
                           DType dst_t, const Unrotate& unrotate = Unrotate());

}  // namespace kernels
}  // namespace ddpx
