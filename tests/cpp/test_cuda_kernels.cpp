// Tests of the CUDA kernels in src/kernels/{cast,optim,quantize,quantize_ef}_cuda.h against the
// CPU kernels, bit for bit (both round to nearest even; NaN only has to stay NaN, since GPUs
// return canonical NaNs). Torch-free. Built wherever nvcc is; every case skips when no CUDA
// device is visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_utils.h"
#include "kernels/cast.h"
#include "kernels/cast_cuda.h"
#include "kernels/optim.h"
#include "kernels/optim_cuda.h"
#include "kernels/quantize.h"
#include "kernels/quantize_cuda.h"
#include "kernels/quantize_ef.h"
#include "kernels/quantize_ef_cuda.h"
#include "kernels/quantize_ef_inl.h"

namespace {

namespace k = ddpx::kernels;
using k::DType;

// Device allocation freed on scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) : bytes(bytes) {
    if (cudaMalloc(&ptr, bytes ? bytes : 1) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr = nullptr;
  size_t bytes;
};

size_t esize(DType t) { return k::dtype_size(t); }

uint64_t element_bits(const std::vector<unsigned char>& buf, DType t, int64_t i) {
  uint64_t u = 0;
  std::memcpy(&u, buf.data() + i * esize(t), esize(t));
  return u;
}

bool element_is_nan(uint64_t u, DType t) {
  switch (t) {
    case DType::kFloat32: {
      float f;
      const uint32_t b = static_cast<uint32_t>(u);
      std::memcpy(&f, &b, 4);
      return std::isnan(f);
    }
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, &u, 8);
      return std::isnan(d);
    }
    case DType::kFloat16:
      return (u & 0x7C00u) == 0x7C00u && (u & 0x03FFu) != 0;
    case DType::kBFloat16:
      return (u & 0x7F80u) == 0x7F80u && (u & 0x007Fu) != 0;
  }
  return false;
}

// Host values: mostly sign * U[1,2) * 2^e, e in [-30, 20] (fp16 overflow, subnormals and
// underflow included), ~5% specials, -0.0 among them when `negative_zero`. Both sum_rows kernels
// start their accumulator from row 0 (not +0.0), so a column of -0.0 sums to -0.0 on each.
std::vector<unsigned char> random_host(DType t, int64_t n, uint64_t seed, bool negative_zero) {
  std::vector<unsigned char> buf(static_cast<size_t>(n) * esize(t));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-30, 20);
  std::uniform_int_distribution<int> pick(0, 99);
  const double inf = std::numeric_limits<double>::infinity();
  const double specials[] = {0.0,   -0.0,    inf,     -inf, std::nan(""), 65504.0, 65520.0,
                             1e-40, 0x1p-24, 0x1p-25, 3e38, -1e300,       1e-310};
  const int n_special = sizeof(specials) / sizeof(specials[0]);
  for (int64_t i = 0; i < n; ++i) {
    const int p = pick(gen);
    double v = p < 5 ? specials[(p * 5 + i) % n_special]
                     : (p % 2 ? -1.0 : 1.0) * std::ldexp(mant(gen), expo(gen));
    if (!negative_zero && v == 0.0) v = 0.0;  // drops the sign of -0.0
    unsigned char* dst = buf.data() + i * esize(t);
    switch (t) {
      case DType::kFloat32: {
        const float f = static_cast<float>(v);
        std::memcpy(dst, &f, 4);
        break;
      }
      case DType::kFloat64:
        std::memcpy(dst, &v, 8);
        break;
      case DType::kFloat16: {
        uint16_t h = k::float_to_half_bits(static_cast<float>(v));
        if (!negative_zero && h == 0x8000u) h = 0;
        std::memcpy(dst, &h, 2);
        break;
      }
      case DType::kBFloat16: {
        uint16_t h = k::float_to_bf16_bits(static_cast<float>(v));
        if (!negative_zero && h == 0x8000u) h = 0;
        std::memcpy(dst, &h, 2);
        break;
      }
    }
  }
  return buf;
}

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

void expect_bitwise(const std::vector<unsigned char>& gpu, const std::vector<unsigned char>& cpu,
                    DType t, int64_t n, const std::string& what) {
  int64_t bad = 0;
  std::string examples;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t g = element_bits(gpu, t, i), c = element_bits(cpu, t, i);
    const bool ok = element_is_nan(c, t) ? element_is_nan(g, t) : g == c;
    if (!ok && bad++ < 8) {
      examples += "  [" + std::to_string(i) + "] gpu " + hex(g) + " cpu " + hex(c) + "\n";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " mismatches, e.g.\n" << examples;
}

using CudaParam = std::tuple<DType, DType, int64_t>;

class CudaKernelTest : public ::testing::TestWithParam<CudaParam> {
 protected:
  DType src_t() const { return std::get<0>(GetParam()); }
  DType dst_t() const { return std::get<1>(GetParam()); }
  int64_t n() const { return std::get<2>(GetParam()); }
  uint64_t seed() const {
    return static_cast<uint64_t>(src_t()) * 7919 + static_cast<uint64_t>(dst_t()) * 104729 +
           static_cast<uint64_t>(n());
  }
};

using ScaledCastCuda = CudaKernelTest;
using SumRowsCuda = CudaKernelTest;

// Offsets of one element make the pointers misaligned for the vectorised path.
TEST_P(ScaledCastCuda, MatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  const int64_t count = n();
  const auto src = random_host(src_t(), count, seed(), /*negative_zero=*/true);
  cudaStream_t stream;
  DDPX_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer d_src((count + 1) * esize(src_t())), d_dst((count + 1) * esize(dst_t()));
  ASSERT_TRUE(d_src.ptr && d_dst.ptr);
  for (int src_off : {0, 1}) {
    for (int dst_off : {0, 1}) {
      char* s = static_cast<char*>(d_src.ptr) + src_off * esize(src_t());
      char* d = static_cast<char*>(d_dst.ptr) + dst_off * esize(dst_t());
      // On the kernels' stream (a pageable cudaMemcpy is not ordered before work on a
      // non-blocking stream).
      DDPX_ASSERT_CUDA(cudaMemcpyAsync(s, src.data(), src.size(), cudaMemcpyHostToDevice, stream));
      for (float scale : {1.0f, 1.0f / 3.0f, -0.25f}) {
        std::vector<unsigned char> cpu(count * esize(dst_t())), gpu(cpu.size());
        k::scaled_cast_cpu(src.data(), src_t(), cpu.data(), dst_t(), count, scale);
        DDPX_ASSERT_CUDA(cudaMemsetAsync(d, 0xA5, count * esize(dst_t()), stream));
        k::scaled_cast_cuda(s, src_t(), d, dst_t(), count, scale, stream);
        DDPX_ASSERT_CUDA(cudaStreamSynchronize(stream));
        DDPX_ASSERT_CUDA(cudaMemcpy(gpu.data(), d, gpu.size(), cudaMemcpyDeviceToHost));
        expect_bitwise(gpu, cpu, dst_t(), count,
                       std::string("scaled_cast ") + k::dtype_name(src_t()) + "->" +
                           k::dtype_name(dst_t()) + " n=" + std::to_string(count) + " offsets " +
                           std::to_string(src_off) + "/" + std::to_string(dst_off) + " scale " +
                           std::to_string(scale));
      }
    }
  }
  DDPX_ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST_P(SumRowsCuda, MatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  const int64_t count = n();
  cudaStream_t stream;
  DDPX_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // One draw of the most rows, whose first rows serve every row count: drawing the inputs is
  // most of this suite's time.
  const int64_t max_rows = 8;
  const auto all = random_host(src_t(), max_rows * count, seed() * 31, /*negative_zero=*/true);
  for (int64_t rows : {1, 2, 3, 4, 8}) {
    const unsigned char* src = all.data();
    const size_t src_bytes = static_cast<size_t>(rows * count) * esize(src_t());
    DeviceBuffer d_src((rows * count + 1) * esize(src_t())), d_dst((count + 1) * esize(dst_t()));
    ASSERT_TRUE(d_src.ptr && d_dst.ptr);
    for (int off : {0, 1}) {
      char* s = static_cast<char*>(d_src.ptr) + off * esize(src_t());
      char* d = static_cast<char*>(d_dst.ptr) + off * esize(dst_t());
      // On the kernels' stream (a pageable cudaMemcpy is not ordered before work on a
      // non-blocking stream).
      DDPX_ASSERT_CUDA(cudaMemcpyAsync(s, src, src_bytes, cudaMemcpyHostToDevice, stream));
      for (float scale : {1.0f, 1.0f / 3.0f}) {
        std::vector<unsigned char> cpu(count * esize(dst_t())), gpu(cpu.size());
        k::sum_rows_cpu(src, src_t(), rows, count, cpu.data(), dst_t(), scale);
        k::sum_rows_cuda(s, src_t(), rows, count, d, dst_t(), scale, stream);
        DDPX_ASSERT_CUDA(cudaStreamSynchronize(stream));
        DDPX_ASSERT_CUDA(cudaMemcpy(gpu.data(), d, gpu.size(), cudaMemcpyDeviceToHost));
        expect_bitwise(gpu, cpu, dst_t(), count,
                       std::string("sum_rows ") + k::dtype_name(src_t()) + "->" +
                           k::dtype_name(dst_t()) + " n=" + std::to_string(count) +
                           " rows=" + std::to_string(rows) + " offset " + std::to_string(off) +
                           " scale " + std::to_string(scale));
      }
    }
  }
  DDPX_ASSERT_CUDA(cudaStreamDestroy(stream));
}

// The exchange's peers-only form: this rank's row `own` sits apart, the other rows are packed
// without it. Must equal sum_row_ptrs_cpu over the rows in rank order, bit for bit, wherever
// the own row falls, vectorised (aligned, n a multiple of the vector length: 8 with a 16-bit
// side, else 4) or not.
TEST_P(SumRowsCuda, OwnRowApartMatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  const int64_t count = n();
  const size_t row_bytes = static_cast<size_t>(count) * esize(src_t());
  cudaStream_t stream;
  DDPX_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t max_rows = 5;  // one draw, its first rows for every row count (as above)
  const auto all = random_host(src_t(), max_rows * count, seed() * 37, /*negative_zero=*/true);
  for (int64_t rows : {1, 2, 3, 5}) {
    for (int64_t own_row : {int64_t{0}, rows / 2, rows - 1}) {
      std::vector<const void*> ptrs;
      std::vector<unsigned char> packed;
      for (int64_t r = 0; r < rows; ++r) {
        const unsigned char* row = all.data() + r * row_bytes;
        ptrs.push_back(row);
        if (r != own_row) packed.insert(packed.end(), row, row + row_bytes);
      }
      std::vector<unsigned char> cpu(count * esize(dst_t())), gpu(cpu.size());
      k::sum_row_ptrs_cpu(ptrs.data(), src_t(), rows, count, cpu.data(), dst_t(), 1.0 / 3.0);
      DeviceBuffer d_packed(packed.size() + esize(src_t())), d_own(row_bytes + esize(src_t()));
      DeviceBuffer d_dst(cpu.size() + esize(dst_t()));
      ASSERT_TRUE(d_packed.ptr && d_own.ptr && d_dst.ptr);
      for (int off : {0, 1}) {
        char* p = static_cast<char*>(d_packed.ptr) + off * esize(src_t());
        char* o = static_cast<char*>(d_own.ptr) + off * esize(src_t());
        char* d = static_cast<char*>(d_dst.ptr) + off * esize(dst_t());
        DDPX_ASSERT_CUDA(
            cudaMemcpyAsync(p, packed.data(), packed.size(), cudaMemcpyHostToDevice, stream));
        DDPX_ASSERT_CUDA(cudaMemcpyAsync(o, all.data() + own_row * row_bytes, row_bytes,
                                         cudaMemcpyHostToDevice, stream));
        k::sum_rows_cuda(p, src_t(), rows, count, d, dst_t(), 1.0 / 3.0, stream, o, own_row);
        DDPX_ASSERT_CUDA(cudaStreamSynchronize(stream));
        DDPX_ASSERT_CUDA(cudaMemcpy(gpu.data(), d, gpu.size(), cudaMemcpyDeviceToHost));
        expect_bitwise(gpu, cpu, dst_t(), count,
                       std::string("sum_rows own row ") + k::dtype_name(src_t()) + "->" +
                           k::dtype_name(dst_t()) + " n=" + std::to_string(count) +
                           " rows=" + std::to_string(rows) + " own_row=" + std::to_string(own_row) +
                           " offset " + std::to_string(off));
      }
    }
  }
  DDPX_ASSERT_CUDA(cudaStreamDestroy(stream));
}

// In place (src == dst, one dtype) takes a kernel without __restrict__ (the two alias); it
// must give what the CPU kernel gives in place, aligned or not.
TEST_P(ScaledCastCuda, InPlaceMatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  if (src_t() != dst_t()) GTEST_SKIP() << "in place needs one dtype";
  const int64_t count = n();
  const auto src = random_host(src_t(), count, seed() * 13, /*negative_zero=*/true);
  DeviceBuffer d_buf((count + 1) * esize(src_t()));
  ASSERT_TRUE(d_buf.ptr);
  cudaStream_t stream;
  DDPX_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int off : {0, 1}) {
    char* b = static_cast<char*>(d_buf.ptr) + off * esize(src_t());
    std::vector<unsigned char> cpu = src, gpu(src.size());
    k::scaled_cast_cpu(cpu.data(), src_t(), cpu.data(), src_t(), count, -0.375);
    DDPX_ASSERT_CUDA(cudaMemcpyAsync(b, src.data(), src.size(), cudaMemcpyHostToDevice, stream));
    k::scaled_cast_cuda(b, src_t(), b, src_t(), count, -0.375, stream);
    DDPX_ASSERT_CUDA(cudaStreamSynchronize(stream));
    DDPX_ASSERT_CUDA(cudaMemcpy(gpu.data(), b, gpu.size(), cudaMemcpyDeviceToHost));
    expect_bitwise(gpu, cpu, src_t(), count,
                   std::string("in-place scaled_cast ") + k::dtype_name(src_t()) +
                       " n=" + std::to_string(count) + " offset " + std::to_string(off));
  }
  DDPX_ASSERT_CUDA(cudaStreamDestroy(stream));
}

const DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};
const int64_t kSizes[] = {1, 7, 2047, 2048, 2049, 100003, (int64_t{1} << 20) + 3};

std::string cuda_param_name(const ::testing::TestParamInfo<CudaParam>& info) {
  return std::string(k::dtype_name(std::get<0>(info.param))) + "_to_" +
         k::dtype_name(std::get<1>(info.param)) + "_n" + std::to_string(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllPairs, ScaledCastCuda,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kSizes)),
                         cuda_param_name);
INSTANTIATE_TEST_SUITE_P(AllPairs, SumRowsCuda,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kSizes)),
                         cuda_param_name);

// The uint8 quantization: rows (scales, zero points, codes) and the dequantized means of three
// rows, on the device and on the host, bit for bit; a NaN in one channel stays NaN there.
class QuantizeCuda : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(QuantizeCuda, MatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  const auto [t, n, channel] = GetParam();
  const int64_t channels = channel == 0 ? 1 : n / channel + 1;
  const int64_t ch = channel == 0 ? std::max<int64_t>(n, 1) : channel;
  const int64_t row_bytes = k::quantized_row_bytes(n, channels);
  const int64_t rows = 3;
  std::vector<unsigned char> cpu_rows(static_cast<size_t>(rows * row_bytes));
  std::vector<unsigned char> gpu_rows(cpu_rows.size());
  DeviceBuffer x_dev(static_cast<size_t>(n) * esize(t)), rows_dev(cpu_rows.size());
  DeviceBuffer work(static_cast<size_t>(k::quantize_row_cuda_workspace_bytes(n, ch, channels)));
  for (int64_t r = 0; r < rows; ++r) {
    // Finite values over a few binades; one NaN in rank 1's second channel.
    std::vector<unsigned char> x(static_cast<size_t>(n) * esize(t));
    std::mt19937_64 gen(static_cast<uint64_t>(n * 131 + channel * 7 + r));
    std::uniform_real_distribution<float> val(-4.0f, 4.0f);
    for (int64_t i = 0; i < n; ++i) {
      float f = val(gen);
      if (r == 1 && channel != 0 && i == channel + 1) f = std::nanf("");
      unsigned char* dst = x.data() + i * esize(t);
      if (t == DType::kFloat32) std::memcpy(dst, &f, 4);
      if (t == DType::kFloat64) {
        const double d = f;
        std::memcpy(dst, &d, 8);
      }
      if (t == DType::kFloat16) {
        const uint16_t h = k::float_to_half_bits(f);
        std::memcpy(dst, &h, 2);
      }
      if (t == DType::kBFloat16) {
        const uint16_t h = k::float_to_bf16_bits(f);
        std::memcpy(dst, &h, 2);
      }
    }
    k::quantize_row_cpu(x.data(), t, n, ch, channels, cpu_rows.data() + r * row_bytes);
    DDPX_ASSERT_CUDA(cudaMemcpy(x_dev.ptr, x.data(), x.size(), cudaMemcpyHostToDevice));
    k::quantize_row_cuda(x_dev.ptr, t, n, ch, channels,
                         static_cast<uint8_t*>(rows_dev.ptr) + r * row_bytes, work.ptr, nullptr);
    DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  }
  DDPX_ASSERT_CUDA(
      cudaMemcpy(gpu_rows.data(), rows_dev.ptr, gpu_rows.size(), cudaMemcpyDeviceToHost));
  for (int64_t r = 0; r < rows; ++r) {
    const unsigned char* c = cpu_rows.data() + r * row_bytes;
    const unsigned char* g = gpu_rows.data() + r * row_bytes;
    std::vector<unsigned char> cs(c, c + 8 * channels), gs(g, g + 8 * channels);
    expect_bitwise(gs, cs, DType::kFloat32, 2 * channels, "scales and zero points");
    EXPECT_EQ(std::memcmp(c + 8 * channels, g + 8 * channels,
                          static_cast<size_t>(row_bytes - 8 * channels)),
              0)
        << "codes of row " << r;
  }
  // Mean of the three rows, the device's own rows taken as the "own" row 1.
  std::vector<unsigned char> cpu_out(static_cast<size_t>(n) * esize(t)), gpu_out(cpu_out.size());
  std::vector<unsigned char> peers_host(cpu_rows.begin(), cpu_rows.begin() + row_bytes);
  peers_host.insert(peers_host.end(), cpu_rows.begin() + 2 * row_bytes, cpu_rows.end());
  k::dequantize_mean_cpu(peers_host.data(), cpu_rows.data() + row_bytes, 1, rows, n, ch, channels,
                         cpu_out.data(), t);
  DeviceBuffer peers_dev(peers_host.size()), out_dev(gpu_out.size());
  DDPX_ASSERT_CUDA(
      cudaMemcpy(peers_dev.ptr, peers_host.data(), peers_host.size(), cudaMemcpyHostToDevice));
  k::dequantize_mean_cuda(static_cast<const uint8_t*>(peers_dev.ptr),
                          static_cast<const uint8_t*>(rows_dev.ptr) + row_bytes, 1, rows, n, ch,
                          channels, out_dev.ptr, t, nullptr);
  DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  DDPX_ASSERT_CUDA(cudaMemcpy(gpu_out.data(), out_dev.ptr, gpu_out.size(), cudaMemcpyDeviceToHost));
  expect_bitwise(gpu_out, cpu_out, t, n, "dequantized mean");
}

INSTANTIATE_TEST_SUITE_P(DtypesAndChannels, QuantizeCuda,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat64,
                                                              DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values<int64_t>(1, 1000, 1024, 300000),
                                            ::testing::Values<int64_t>(0, 16, 512)));

// The block quantization with error feedback (quantized_hook): messages, residuals, sums of
// messages and dequantized values on the device and on the host, from a table whose blocks come
// in another order than the values' (as an owner's blocks do) and end with short ones. Bit for
// bit, except the 1-bit mean scale (its sum is reduced in another order on the device): there
// the codes are equal and the scales and residuals within a few ulps. With rotation
// (QuantSpec::rotate; 1 bit: the unbiased scale) the whole blocks go through the same butterflies
// on both, and the sums rotate every term back.
class QuantizeEfCuda : public ::testing::TestWithParam<std::tuple<int, bool, int64_t, bool>> {};

TEST_P(QuantizeEfCuda, MatchesCpu) {
  DDPX_SKIP_WITHOUT_GPU();
  const auto [bits, stochastic, n, rotate] = GetParam();
  const int64_t block = 256;
  k::QuantSpec spec;
  spec.bits = bits;
  spec.block = block;
  spec.stochastic = stochastic;
  spec.seed = 7;
  spec.stream = 3;
  spec.rotate = rotate;
  spec.unbiased_sign = rotate;
  k::Unrotate unrotate;
  unrotate.on = rotate;
  unrotate.seed = 7;
  unrotate.stream0 = 3;  // every term: the message was quantized with stream 3
  // Blocks of the values [0, n) in reverse order, the last (short) one first.
  std::vector<k::BlockRef> refs;
  for (int64_t begin = 0; begin < n; begin += block) {
    refs.insert(refs.begin(), {begin, std::min(block, n - begin), 1000 + uint64_t(begin)});
  }
  const int64_t blocks = static_cast<int64_t>(refs.size());
  const int64_t msg_bytes = k::quantized_message_bytes(blocks, bits, block);
  std::mt19937_64 gen(static_cast<uint64_t>(n * 17 + bits));
  std::uniform_real_distribution<float> val(-4.0f, 4.0f);
  std::vector<float> x(static_cast<size_t>(n)), res(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    x[i] = val(gen);
    res[i] = val(gen) * 0.01f;
  }
  DeviceBuffer x_dev(x.size() * 4), res_dev(res.size() * 4), refs_dev(refs.size() * 24),
      msg_dev(static_cast<size_t>(msg_bytes));
  DDPX_ASSERT_CUDA(cudaMemcpy(x_dev.ptr, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  DDPX_ASSERT_CUDA(cudaMemcpy(res_dev.ptr, res.data(), res.size() * 4, cudaMemcpyHostToDevice));
  DDPX_ASSERT_CUDA(cudaMemcpy(refs_dev.ptr, refs.data(), refs.size() * 24, cudaMemcpyHostToDevice));
  std::vector<unsigned char> cpu_msg(static_cast<size_t>(msg_bytes)), gpu_msg(cpu_msg.size());
  std::vector<float> cpu_res = res, gpu_res(res.size());
  auto* cpu_scales = reinterpret_cast<float*>(cpu_msg.data());
  k::quantize_ef_blocks_cpu(x.data(), DType::kFloat32, cpu_res.data(), refs.data(), 0, blocks, spec,
                            cpu_scales, cpu_msg.data() + 4 * blocks);
  auto* msg = static_cast<uint8_t*>(msg_dev.ptr);
  DDPX_ASSERT_CUDA(cudaMemset(msg, 0, static_cast<size_t>(msg_bytes)));
  k::quantize_ef_blocks_cuda(x_dev.ptr, DType::kFloat32, static_cast<float*>(res_dev.ptr),
                             static_cast<const k::BlockRef*>(refs_dev.ptr), blocks, spec,
                             reinterpret_cast<float*>(msg), msg + 4 * blocks, nullptr);
  DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  DDPX_ASSERT_CUDA(cudaMemcpy(gpu_msg.data(), msg, gpu_msg.size(), cudaMemcpyDeviceToHost));
  DDPX_ASSERT_CUDA(
      cudaMemcpy(gpu_res.data(), res_dev.ptr, gpu_res.size() * 4, cudaMemcpyDeviceToHost));
  const size_t code_bytes = static_cast<size_t>(blocks * block * bits / 8);
  EXPECT_EQ(std::memcmp(cpu_msg.data() + 4 * blocks, gpu_msg.data() + 4 * blocks, code_bytes), 0)
      << "codes";
  const bool mean_scale = bits == 1 && !stochastic;
  const auto* gpu_scales = reinterpret_cast<const float*>(gpu_msg.data());
  for (int64_t b = 0; b < blocks; ++b) {
    if (mean_scale) {
      EXPECT_NEAR(gpu_scales[b], cpu_scales[b], 1e-5f * cpu_scales[b]) << "block " << b;
    } else {
      EXPECT_EQ(gpu_scales[b], cpu_scales[b]) << "block " << b;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (mean_scale) {
      ASSERT_NEAR(gpu_res[i], cpu_res[i], 1e-4f) << "residual " << i;
    } else {
      ASSERT_EQ(gpu_res[i], cpu_res[i]) << "residual " << i;
    }
  }
  // Sum of three messages (the host's, three times, with post_scale 1/3) and one decode into
  // bf16, from the host's message on both sides.
  std::vector<unsigned char> three;
  for (int r = 0; r < 3; ++r) three.insert(three.end(), cpu_msg.begin(), cpu_msg.end());
  DeviceBuffer three_dev(three.size()), sum_dev(x.size() * 4), bf_dev(x.size() * 2);
  DDPX_ASSERT_CUDA(cudaMemcpy(three_dev.ptr, three.data(), three.size(), cudaMemcpyHostToDevice));
  std::vector<float> cpu_sum(x.size()), gpu_sum(x.size());
  k::dequantize_sum_blocks_cpu(three.data(), 3, msg_bytes, blocks, refs.data(), 0, blocks, bits,
                               block, 1.0f / 3.0f, cpu_sum.data(), k::ExactTerm(), unrotate);
  k::dequantize_sum_blocks_cuda(static_cast<const uint8_t*>(three_dev.ptr), 3, msg_bytes, blocks,
                                static_cast<const k::BlockRef*>(refs_dev.ptr), bits, block,
                                1.0f / 3.0f, static_cast<float*>(sum_dev.ptr), k::ExactTerm(),
                                unrotate, nullptr);
  // Two messages and x itself as the middle term (quantized_hook's owner: its own values exact).
  DeviceBuffer exact_sum_dev(x.size() * 4);
  std::vector<float> cpu_exact_sum(x.size()), gpu_exact_sum(x.size());
  k::ExactTerm host_term{x.data(), DType::kFloat32, refs.data(), 1};
  k::ExactTerm dev_term{x_dev.ptr, DType::kFloat32, static_cast<const k::BlockRef*>(refs_dev.ptr),
                        1};
  k::dequantize_sum_blocks_cpu(three.data(), 2, msg_bytes, blocks, refs.data(), 0, blocks, bits,
                               block, 1.0f / 3.0f, cpu_exact_sum.data(), host_term, unrotate);
  k::dequantize_sum_blocks_cuda(static_cast<const uint8_t*>(three_dev.ptr), 2, msg_bytes, blocks,
                                static_cast<const k::BlockRef*>(refs_dev.ptr), bits, block,
                                1.0f / 3.0f, static_cast<float*>(exact_sum_dev.ptr), dev_term,
                                unrotate, nullptr);
  std::vector<uint16_t> cpu_bf(x.size()), gpu_bf(x.size());
  k::dequantize_blocks_cpu(cpu_msg.data(), blocks, refs.data(), 0, blocks, bits, block,
                           cpu_bf.data(), DType::kBFloat16, unrotate);
  k::dequantize_blocks_cuda(static_cast<const uint8_t*>(three_dev.ptr), blocks,
                            static_cast<const k::BlockRef*>(refs_dev.ptr), bits, block, bf_dev.ptr,
                            DType::kBFloat16, unrotate, nullptr);
  DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  DDPX_ASSERT_CUDA(
      cudaMemcpy(gpu_sum.data(), sum_dev.ptr, gpu_sum.size() * 4, cudaMemcpyDeviceToHost));
  DDPX_ASSERT_CUDA(
      cudaMemcpy(gpu_bf.data(), bf_dev.ptr, gpu_bf.size() * 2, cudaMemcpyDeviceToHost));
  DDPX_ASSERT_CUDA(cudaMemcpy(gpu_exact_sum.data(), exact_sum_dev.ptr, gpu_exact_sum.size() * 4,
                              cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(cpu_sum.data(), gpu_sum.data(), cpu_sum.size() * 4), 0) << "sum";
  EXPECT_EQ(std::memcmp(cpu_exact_sum.data(), gpu_exact_sum.data(), cpu_exact_sum.size() * 4), 0)
      << "sum with an exact term";
  EXPECT_EQ(std::memcmp(cpu_bf.data(), gpu_bf.data(), cpu_bf.size() * 2), 0) << "decode";
}

INSTANTIATE_TEST_SUITE_P(BitsAndSizes, QuantizeEfCuda,
                         ::testing::Combine(::testing::Values(8, 4, 2, 1),
                                            ::testing::Values(false, true),
                                            ::testing::Values<int64_t>(1000, 300001),
                                            ::testing::Values(false, true)));

// The fitted 2-bit codes (QuantSpec::fitted_ternary, quantized_hook without error feedback): the
// device reduces the mean, the magnitudes above it and the choice's sums in another order, so a
// scale may differ in its last bits, and a value at a rounding boundary (|v| / scale = 1/2 for
// the ternary code, |v| / 2h = 1 for the midrise one) may get the other code. Everything else is
// the host's.
TEST(QuantizeEfCudaFitted, MatchesCpuUpToTies) {
  DDPX_SKIP_WITHOUT_GPU();
  const int64_t block = 256, n = 300001;
  k::QuantSpec spec;
  spec.bits = 2;
  spec.block = block;
  spec.fitted_ternary = true;
  std::vector<k::BlockRef> refs;
  for (int64_t begin = 0; begin < n; begin += block) {
    refs.push_back({begin, std::min(block, n - begin), uint64_t(begin)});
  }
  const int64_t blocks = static_cast<int64_t>(refs.size());
  const int64_t msg_bytes = k::quantized_message_bytes(blocks, 2, block);
  std::mt19937_64 gen(99);
  std::normal_distribution<float> val(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = val(gen);
  DeviceBuffer x_dev(x.size() * 4), refs_dev(refs.size() * 24),
      msg_dev(static_cast<size_t>(msg_bytes));
  DDPX_ASSERT_CUDA(cudaMemcpy(x_dev.ptr, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  DDPX_ASSERT_CUDA(cudaMemcpy(refs_dev.ptr, refs.data(), refs.size() * 24, cudaMemcpyHostToDevice));
  std::vector<unsigned char> cpu_msg(static_cast<size_t>(msg_bytes)), gpu_msg(cpu_msg.size());
  auto* cpu_scales = reinterpret_cast<float*>(cpu_msg.data());
  k::quantize_ef_blocks_cpu(x.data(), DType::kFloat32, nullptr, refs.data(), 0, blocks, spec,
                            cpu_scales, cpu_msg.data() + 4 * blocks);
  auto* msg = static_cast<uint8_t*>(msg_dev.ptr);
  DDPX_ASSERT_CUDA(cudaMemset(msg, 0, static_cast<size_t>(msg_bytes)));
  k::quantize_ef_blocks_cuda(x_dev.ptr, DType::kFloat32, nullptr,
                             static_cast<const k::BlockRef*>(refs_dev.ptr), blocks, spec,
                             reinterpret_cast<float*>(msg), msg + 4 * blocks, nullptr);
  DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  DDPX_ASSERT_CUDA(cudaMemcpy(gpu_msg.data(), msg, gpu_msg.size(), cudaMemcpyDeviceToHost));
  const auto* gpu_scales = reinterpret_cast<const float*>(gpu_msg.data());
  const uint8_t* cpu_codes = cpu_msg.data() + 4 * blocks;
  const uint8_t* gpu_codes = gpu_msg.data() + 4 * blocks;
  int64_t differing = 0;
  int64_t midrise = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const float scale = cpu_scales[b];
    // Both chose the same code (normal blocks are far from the choice's tie: the midrise code's
    // squared error is about 0.12 of the energy, the ternary one's 0.19), at the same scale up
    // to the last bits; a midrise block stores -h.
    ASSERT_EQ(gpu_scales[b] < 0, scale < 0) << "block " << b;
    ASSERT_NEAR(gpu_scales[b], scale, 1e-5f * std::fabs(scale)) << "block " << b;
    midrise += scale < 0 ? 1 : 0;
    for (int64_t i = 0; i < refs[b].len; ++i) {
      const int64_t at = b * block + i;
      const uint32_t c = k::detail::unpack_code(cpu_codes + b * block / 4, i, 2);
      const uint32_t g = k::detail::unpack_code(gpu_codes + b * block / 4, i, 2);
      if (c == g) continue;
      ++differing;
      if (scale < 0) {
        // Midrise: a value at a level boundary, |v| / 2h = 1 (or v = 0).
        const float steps = std::fabs(x[at]) / (-2.0f * scale);
        EXPECT_NEAR(steps, std::round(steps), 1e-4f) << "value " << at;
      } else {
        EXPECT_NEAR(std::fabs(x[at]) / scale, 0.5f, 1e-4f) << "value " << at;
      }
    }
  }
  EXPECT_GT(midrise, blocks / 2);
  EXPECT_LE(differing, n / 10000) << "codes that differ";
}

// n == 0 launches nothing and writes nothing; bad arguments raise before any launch.
TEST(CudaKernelApi, EmptyAndBadArguments) {
  DDPX_SKIP_WITHOUT_GPU();
  DeviceBuffer d(64);
  ASSERT_TRUE(d.ptr);
  DDPX_ASSERT_CUDA(cudaMemset(d.ptr, 0x5A, 64));
  k::scaled_cast_cuda(d.ptr, DType::kFloat32, d.ptr, DType::kFloat32, 0, 2.0f, nullptr);
  k::sum_rows_cuda(d.ptr, DType::kFloat32, 1, 0, d.ptr, DType::kFloat32, 2.0f, nullptr);
  DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> host(64);
  DDPX_ASSERT_CUDA(cudaMemcpy(host.data(), d.ptr, 64, cudaMemcpyDeviceToHost));
  for (unsigned char b : host) ASSERT_EQ(b, 0x5A);
  EXPECT_THROW(
      k::sum_rows_cuda(d.ptr, DType::kFloat32, 0, 4, d.ptr, DType::kFloat32, 1.0f, nullptr),
      std::invalid_argument);
  EXPECT_THROW(
      k::scaled_cast_cuda(d.ptr, static_cast<DType>(9), d.ptr, DType::kFloat32, 4, 1.0f, nullptr),
      std::invalid_argument);
  // In place with two dtypes, and an own row without its index (or out of range).
  EXPECT_THROW(
      k::scaled_cast_cuda(d.ptr, DType::kFloat32, d.ptr, DType::kFloat16, 4, 1.0f, nullptr),
      std::invalid_argument);
  EXPECT_THROW(k::sum_rows_cuda(d.ptr, DType::kFloat32, 2, 4, d.ptr, DType::kFloat32, 1.0f, nullptr,
                                d.ptr, -1),
               std::invalid_argument);
  EXPECT_THROW(k::sum_rows_cuda(d.ptr, DType::kFloat32, 2, 4, d.ptr, DType::kFloat32, 1.0f, nullptr,
                                d.ptr, 2),
               std::invalid_argument);
}

// ---- functional optimizers: the CUDA kernels run optim_inl.h's element functions, as the CPU
// kernels do, so three steps on the GPU equal three on the CPU bit for bit ----------------------

template <typename T>
std::vector<T> random_values(int64_t n, uint32_t seed, bool positive) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(positive ? std::fabs(dist(gen)) : dist(gen));
  return v;
}

template <typename T>
void expect_same_buffer(const std::vector<T>& cpu, const DeviceBuffer& dev, const char* what) {
  std::vector<T> got(cpu.size());
  DDPX_ASSERT_CUDA(cudaMemcpy(got.data(), dev.ptr, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &cpu[i], sizeof(T)), 0)
        << what << "[" << i << "]: " << got[i] << " vs " << cpu[i];
  }
}

template <typename T>
void upload(const std::vector<T>& v, const DeviceBuffer& d) {
  if (d.ptr) cudaMemcpy(d.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
}

template <typename T>
void check_optim_cuda(DType dt, bool adam, bool flags) {
  const int64_t n = 100003;
  auto p = random_values<T>(n, 1, false), g = random_values<T>(n, 2, false);
  auto m = random_values<T>(n, 3, false), v = random_values<T>(n, 4, true);
  auto vmax = random_values<T>(n, 5, true);
  const size_t bytes = n * sizeof(T);
  DeviceBuffer dp(bytes), dg(bytes), dm(bytes), dv(bytes), dvmax(bytes);
  for (auto [h, d] : {std::make_pair(&p, &dp), std::make_pair(&g, &dg), std::make_pair(&m, &dm),
                      std::make_pair(&v, &dv), std::make_pair(&vmax, &dvmax)}) {
    upload(*h, *d);
  }
  ASSERT_TRUE(dp.ptr && dg.ptr && dm.ptr && dv.ptr && dvmax.ptr);
  for (int step = 1; step <= 3; ++step) {
    if (adam) {
      k::AdamScalars s;
      s.lr = 0.01;
      s.beta1 = flags ? 0.3 : 0.9;
      s.beta2 = 0.999;
      s.eps = 1e-8;
      s.weight_decay = 0.1;
      s.amsgrad = flags;
      s.maximize = flags;
      s.decoupled_weight_decay = !flags;
      s.formula = flags ? k::AdamFormula::kTorch1 : k::AdamFormula::kTorch2;
      s.step_size = s.lr / (1 - std::pow(s.beta1, step));
      s.bias_correction2_sqrt = std::sqrt(1 - std::pow(s.beta2, step));
      k::AdamTensor h{p.data(), g.data(), m.data(), v.data(), vmax.data(), n};
      k::AdamTensor d{dp.ptr, dg.ptr, dm.ptr, dv.ptr, dvmax.ptr, n};
      k::adam_cpu(h, dt, s, 0, n);
      k::adam_cuda(d, dt, s, nullptr);
    } else {
      k::SgdScalars s;
      s.lr = 0.1;
      s.momentum = 0.9;
      s.dampening = flags ? 0.0 : 0.2;
      s.weight_decay = 0.01;
      s.nesterov = flags;
      s.maximize = flags;
      s.init_buffer = step == 1;
      k::SgdTensor h{p.data(), g.data(), m.data(), n};
      k::SgdTensor d{dp.ptr, dg.ptr, dm.ptr, n};
      k::sgd_cpu(h, dt, s, 0, n);
      k::sgd_cuda(d, dt, s, nullptr);
    }
  }
  DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  expect_same_buffer(p, dp, "param");
  expect_same_buffer(m, dm, adam ? "exp_avg" : "momentum_buffer");
  if (adam) expect_same_buffer(v, dv, "exp_avg_sq");
  if (adam && flags) expect_same_buffer(vmax, dvmax, "max_exp_avg_sq");
}

TEST(OptimCuda, SgdMatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  for (bool flags : {false, true}) {
    check_optim_cuda<float>(DType::kFloat32, false, flags);
    check_optim_cuda<double>(DType::kFloat64, false, flags);
  }
}

TEST(OptimCuda, AdamMatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  for (bool flags : {false, true}) {
    check_optim_cuda<float>(DType::kFloat32, true, flags);
    check_optim_cuda<double>(DType::kFloat64, true, flags);
  }
}

// Multi-tensor launches: many tensors of awkward sizes (empty, one element, block boundaries,
// more than one launch's worth), each with its own scalars, equal the CPU kernels bit for bit.
template <typename T>
void check_optim_cuda_multi(DType dt, bool adam) {
  const std::vector<int64_t> sizes{
      0, 1, 255,  256, 257, 100003, 7,    0,    3000, 33,
      1, 2, 4096, 9,   65,  513,    1024, 1025, 5,    300001};  // 20: two launches
  const size_t count = sizes.size();
  std::vector<std::vector<T>> hp, hg, hm, hv, hx;
  std::deque<DeviceBuffer> dp, dg, dm, dv, dx;  // DeviceBuffer does not move
  for (size_t i = 0; i < count; ++i) {
    const int64_t n = sizes[i];
    hp.push_back(random_values<T>(n, 10 + i, false));
    hg.push_back(random_values<T>(n, 100 + i, false));
    hm.push_back(random_values<T>(n, 200 + i, false));
    hv.push_back(random_values<T>(n, 300 + i, true));
    hx.push_back(random_values<T>(n, 400 + i, true));
    for (auto [h, d] :
         {std::make_pair(&hp, &dp), std::make_pair(&hg, &dg), std::make_pair(&hm, &dm),
          std::make_pair(&hv, &dv), std::make_pair(&hx, &dx)}) {
      d->emplace_back(n * sizeof(T));
      upload(h->back(), d->back());
    }
  }
  for (int step = 1; step <= 3; ++step) {
    std::vector<k::AdamScalars> as(count);
    std::vector<k::SgdScalars> ss(count);
    std::vector<k::AdamTensor> ah(count), ad(count);
    std::vector<k::SgdTensor> sh(count), sd(count);
    for (size_t i = 0; i < count; ++i) {
      const int64_t n = sizes[i];
      const int s_i = step + static_cast<int>(i % 3);  // per-tensor steps differ
      as[i].lr = 0.01;
      as[i].beta1 = 0.9;
      as[i].beta2 = 0.999;
      as[i].eps = 1e-8;
      as[i].weight_decay = i % 2 ? 0.1 : 0.0;
      as[i].amsgrad = i % 4 == 1;
      as[i].decoupled_weight_decay = i % 3 == 0;
      as[i].step_size = as[i].lr / (1 - std::pow(as[i].beta1, s_i));
      as[i].bias_correction2_sqrt = std::sqrt(1 - std::pow(as[i].beta2, s_i));
      ss[i].lr = 0.1;
      ss[i].momentum = i % 5 == 2 ? 0.0 : 0.9;
      ss[i].dampening = 0.1;
      ss[i].weight_decay = 0.01;
      ss[i].nesterov = i % 2 == 0;
      ss[i].init_buffer = step == 1;
      ah[i] = {hp[i].data(), hg[i].data(), hm[i].data(), hv[i].data(), hx[i].data(), n};
      ad[i] = {dp[i].ptr, dg[i].ptr, dm[i].ptr, dv[i].ptr, dx[i].ptr, n};
      sh[i] = {hp[i].data(), hg[i].data(), hm[i].data(), n};
      sd[i] = {dp[i].ptr, dg[i].ptr, dm[i].ptr, n};
      if (adam) {
        k::adam_cpu(ah[i], dt, as[i], 0, n);
      } else {
        k::sgd_cpu(sh[i], dt, ss[i], 0, n);
      }
    }
    if (adam) {
      k::adam_cuda_multi(ad.data(), as.data(), static_cast<int64_t>(count), dt, nullptr);
    } else {
      k::sgd_cuda_multi(sd.data(), ss.data(), static_cast<int64_t>(count), dt, nullptr);
    }
  }
  DDPX_ASSERT_CUDA(cudaDeviceSynchronize());
  for (size_t i = 0; i < count; ++i) {
    if (sizes[i] == 0) continue;
    expect_same_buffer(hp[i], dp[i], "param");
    expect_same_buffer(hm[i], dm[i], adam ? "exp_avg" : "momentum_buffer");
    if (adam) expect_same_buffer(hv[i], dv[i], "exp_avg_sq");
  }
}

TEST(OptimCuda, MultiTensorMatchesCpuBitForBit) {
  DDPX_SKIP_WITHOUT_GPU();
  for (bool adam : {false, true}) {
    check_optim_cuda_multi<float>(DType::kFloat32, adam);
    check_optim_cuda_multi<double>(DType::kFloat64, adam);
  }
  k::SgdTensor t{nullptr, nullptr, nullptr, 5};
  k::SgdScalars s;
  s.momentum = 0.9;
  EXPECT_THROW(k::sgd_cuda_multi(&t, &s, 1, DType::kFloat32, nullptr), std::invalid_argument);
}

}  // namespace
