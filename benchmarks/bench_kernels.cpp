// Google Benchmark of ddpx's torch-free CPU kernels on preallocated, pre-touched buffers.
//
// Each benchmark reports bytes/s as the bytes one fused pass reads and writes, so it compares
// directly with BM_memcpy of the same number of bytes (read + write). Arguments: elements.
//
//   build/benchmarks/bench_kernels_cpp --benchmark_repetitions=3 \
//       --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cast.h"

namespace {

using ddpx::kernels::DType;

std::vector<float> random_floats(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  std::mt19937 gen(0);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto& x : v) x = dist(gen);
  return v;
}

// fp32 -> 16-bit with scale (the compress step): reads 4n, writes 2n bytes.
void BM_compress(benchmark::State& state, DType dst_t) {
  const int64_t n = state.range(0);
  const std::vector<float> src = random_floats(n);
  std::vector<uint16_t> dst(static_cast<size_t>(n), 1);
  for (auto _ : state) {
    ddpx::kernels::scaled_cast_cpu(src.data(), DType::kFloat32, dst.data(), dst_t, n, 0.5f);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * 6);
}

// 16-bit -> fp32 (the decompress step): reads 2n, writes 4n bytes.
void BM_decompress(benchmark::State& state, DType src_t) {
  const int64_t n = state.range(0);
  std::vector<uint16_t> src(static_cast<size_t>(n));
  {
    const std::vector<float> f = random_floats(n);
    ddpx::kernels::scaled_cast_cpu(f.data(), DType::kFloat32, src.data(), src_t, n, 1.f);
  }
  std::vector<float> dst(static_cast<size_t>(n), 1.f);
  for (auto _ : state) {
    ddpx::kernels::scaled_cast_cpu(src.data(), src_t, dst.data(), DType::kFloat32, n, 1.f);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * 6);
}

// Sum of 2 rows of 16-bit values into fp32 (the Gloo-side reduction): reads 4n, writes 4n.
void BM_sum_rows(benchmark::State& state, DType src_t) {
  const int64_t n = state.range(0);
  constexpr int64_t kRows = 2;
  std::vector<uint16_t> src(static_cast<size_t>(kRows * n));
  {
    const std::vector<float> f = random_floats(kRows * n);
    ddpx::kernels::scaled_cast_cpu(f.data(), DType::kFloat32, src.data(), src_t, kRows * n, 1.f);
  }
  std::vector<float> dst(static_cast<size_t>(n), 1.f);
  for (auto _ : state) {
    ddpx::kernels::sum_rows_cpu(src.data(), src_t, kRows, n, dst.data(), DType::kFloat32, 1.f);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * (2 * kRows + 4));
}

// memcpy of 3n bytes: 3n read + 3n written = the 6n bytes of compress/decompress.
void BM_memcpy_6n(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<char> src(static_cast<size_t>(3 * n), 1), dst(static_cast<size_t>(3 * n), 2);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), dst.size());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * 6);
}

}  // namespace

#define DDPX_SIZES ->RangeMultiplier(4)->Range(1 << 20, 16 << 20)->Unit(benchmark::kMillisecond)

BENCHMARK(BM_memcpy_6n) DDPX_SIZES;
BENCHMARK_CAPTURE(BM_compress, fp16, DType::kFloat16) DDPX_SIZES;
BENCHMARK_CAPTURE(BM_compress, bf16, DType::kBFloat16) DDPX_SIZES;
BENCHMARK_CAPTURE(BM_decompress, fp16, DType::kFloat16) DDPX_SIZES;
BENCHMARK_CAPTURE(BM_decompress, bf16, DType::kBFloat16) DDPX_SIZES;
BENCHMARK_CAPTURE(BM_sum_rows, fp16, DType::kFloat16) DDPX_SIZES;
BENCHMARK_CAPTURE(BM_sum_rows, bf16, DType::kBFloat16) DDPX_SIZES;

BENCHMARK_MAIN();
