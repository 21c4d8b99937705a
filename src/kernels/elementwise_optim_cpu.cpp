// CPU loop of the elementwise optimizers: one pass over each tensor's memory with the traits'
// element update. Built twice, as optim_cpu.cpp's loops: for AVX2+FMA (chosen once at run time
// when the CPU has them) and portably, with the same results. Compiled with -fno-math-errno
// -fno-trapping-math so the loops vectorise (CMakeLists.txt).
#include <stdexcept>
#include <string>

#include "elementwise_optim.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define DDPX_ELEMENTWISE_X86 1
#endif

namespace ddpx {
namespace kernels {
namespace {

// The loop over [begin, end) for the states in the bit mask Kept (the others: zero in, not
// stored).
template <typename Traits, unsigned Kept, typename T>
DDPX_OPTIM_INLINE void loop_kept(const ElementwiseTensor<Traits, T>& t,
                                 const ElementwiseCoeffs<Traits, T>& coeffs, int64_t begin,
                                 int64_t end) {
  constexpr int K = Traits::kStates;
  const ElementwiseCoeffs<Traits, T> c = coeffs;  // a local copy: stores cannot alias it
  T* __restrict p = t.param;
  const T* __restrict g = t.grad;
  T* st[K];
  for (int k = 0; k < K; ++k) st[k] = t.state[k];
    // Values go through locals, loaded and stored unconditionally, so the element function's
    // selects stay selects and the loop vectorises. ivdep, not `omp simd`: under -fopenmp-simd
    // GCC 12 makes the per-iteration array s[] an "omp simd array" and then vectorises nothing
    // (no vector type for its loads), while ivdep only asserts what holds (the tensors do not
    // overlap) and leaves s[] to scalar replacement.
#pragma GCC ivdep
  for (int64_t i = begin; i < end; ++i) {
    T pi = p[i];
    T s[K];
    for (int k = 0; k < K; ++k) s[k] = (Kept >> k) & 1u ? st[k][i] : T(0);
    Traits::element(pi, g[i], s, c);
    p[i] = pi;
    for (int k = 0; k < K; ++k) {
      if ((Kept >> k) & 1u) st[k][i] = s[k];
    }
  }
}

// Runs loop_kept for the mask `kept` (the states whose pointer is set), trying every mask from
// Kept up: only the masks that hold every state the traits always keep are built.
template <typename Traits, unsigned Kept, typename T>
DDPX_OPTIM_INLINE void loop_from(unsigned kept, const ElementwiseTensor<Traits, T>& t,
                                 const ElementwiseCoeffs<Traits, T>& c, int64_t begin,
                                 int64_t end) {
  constexpr unsigned kAll = (1u << Traits::kStates) - 1;
  constexpr unsigned kAlways = kAll & ~optim::elementwise::OptionalStates<Traits>::value;
  if constexpr (Kept <= kAll) {
    if constexpr ((Kept & kAlways) == kAlways) {
      if (kept == Kept) return loop_kept<Traits, Kept>(t, c, begin, end);
    }
    loop_from<Traits, Kept + 1>(kept, t, c, begin, end);
  }
}

template <typename Traits, typename T>
DDPX_OPTIM_INLINE void loop(const ElementwiseTensor<Traits, T>& t,
                            const ElementwiseCoeffs<Traits, T>& c, int64_t begin, int64_t end) {
  unsigned kept = 0;
  for (int k = 0; k < Traits::kStates; ++k) kept |= t.state[k] != nullptr ? 1u << k : 0u;
  loop_from<Traits, 0>(kept, t, c, begin, end);
}

template <typename Traits, typename T>
void loop_portable(const ElementwiseTensor<Traits, T>& t, const ElementwiseCoeffs<Traits, T>& c,
                   int64_t begin, int64_t end) {
  loop(t, c, begin, end);
}

#ifdef DDPX_ELEMENTWISE_X86
template <typename Traits, typename T>
__attribute__((target("avx2,fma"))) void loop_avx2(const ElementwiseTensor<Traits, T>& t,
                                                   const ElementwiseCoeffs<Traits, T>& c,
                                                   int64_t begin, int64_t end) {
  loop(t, c, begin, end);
}

bool has_avx2_fma() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}
#endif

}  // namespace

template <typename Traits, typename T>
void elementwise_cpu(const ElementwiseTensor<Traits, T>& t, const ElementwiseCoeffs<Traits, T>& c,
                     int64_t begin, int64_t end) {
  constexpr unsigned kOptional = optim::elementwise::OptionalStates<Traits>::value;
  for (int k = 0; k < Traits::kStates; ++k) {
    if (t.state[k] == nullptr && !((kOptional >> k) & 1u)) {
      throw std::invalid_argument(std::string("ddpx ") + Traits::kKind + ": state " +
                                  Traits::kStateNames[k] + " is missing");
    }
  }
  if (begin < 0 || begin > end || end > t.n) {
    throw std::invalid_argument(std::string("ddpx ") + Traits::kKind + ": range [" +
                                std::to_string(begin) + ", " + std::to_string(end) +
                                ") outside [0, " + std::to_string(t.n) + ")");
  }
#ifdef DDPX_ELEMENTWISE_X86
  if (has_avx2_fma()) return loop_avx2(t, c, begin, end);
#endif
  loop_portable(t, c, begin, end);
}

#define DDPX_INSTANTIATE(Name)                                                      \
  template void elementwise_cpu<optim::elementwise::Name, float>(                   \
      const ElementwiseTensor<optim::elementwise::Name, float>&,                    \
      const ElementwiseCoeffs<optim::elementwise::Name, float>&, int64_t, int64_t); \
  template void elementwise_cpu<optim::elementwise::Name, double>(                  \
      const ElementwiseTensor<optim::elementwise::Name, double>&,                   \
      const ElementwiseCoeffs<optim::elementwise::Name, double>&, int64_t, int64_t);
DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_INSTANTIATE)
#undef DDPX_INSTANTIATE

}  // namespace kernels
}  // namespace ddpx
