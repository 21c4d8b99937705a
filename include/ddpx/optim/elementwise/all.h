// The elementwise optimizers: each is one header in this folder holding its options (fields
// under torch's names, torch's checks) and its traits (torch's state names, the coefficients of
// a step, the element update), and one line here. The rest is generic: the CPU loop and the
// CUDA kernel (src/kernels/elementwise_optim*), the ATen layer (src/ops/elementwise_optim.cpp),
// elementwise_step and FunctionalElementwise (optim/functional.h), OptimizerOptions and the RPC
// optimizer, and the Python bindings (FunctionalAdamax, adamax_step, AdamaxOptions).
//
// Adding one: its header, its line in DDPX_ELEMENTWISE_OPTIMIZERS, its row in
// python/ddpx/optim/_options.py, and its test against torch
// (tests/python/test_elementwise_optim.py).
#pragma once

#include <type_traits>
#include <variant>

#include "adadelta.h"
#include "adagrad.h"
#include "adamax.h"
#include "radam.h"
#include "rmsprop.h"
#include "rprop.h"

// X(Name) for every elementwise optimizer, whose traits are ddpx::optim::elementwise::Name.
#define DDPX_ELEMENTWISE_OPTIMIZERS(X) X(Adadelta) X(Adagrad) X(Adamax) X(RAdam) X(RMSprop) X(Rprop)

namespace ddpx {
namespace optim {
namespace elementwise {

// The optional members of a traits struct, read with their defaults:
// - `kOptionalStates`, a bit mask: state k (never state 0) is kept only where `has_state(k,
//   options)` says so, as torch keeps RMSprop's momentum_buffer only with momentum. The kernels
//   are built for each subset of these states (no load or store of a state not kept). Default 0.
// - `kStateFromConstructor`: torch's constructor makes every parameter's state (Adagrad), so a
//   parameter has its state, at step 0, before its first step. Default false.
// OptionalStates<Traits>::value: Traits::kOptionalStates, 0 where absent.
template <typename Traits, typename = void>
struct OptionalStates : std::integral_constant<unsigned, 0> {};
// The traits that declare kOptionalStates.
template <typename Traits>
struct OptionalStates<Traits, std::void_t<decltype(Traits::kOptionalStates)>>
    : std::integral_constant<unsigned, Traits::kOptionalStates> {
  static_assert((Traits::kOptionalStates & 1u) == 0, "state 0 is always kept");
};

// StateFromConstructor<Traits>::value: Traits::kStateFromConstructor, false where absent.
template <typename Traits, typename = void>
struct StateFromConstructor : std::false_type {};
// The traits that declare kStateFromConstructor.
template <typename Traits>
struct StateFromConstructor<Traits, std::void_t<decltype(Traits::kStateFromConstructor)>>
    : std::bool_constant<Traits::kStateFromConstructor> {};

// Whether a parameter stepped with options `o` keeps state k.
template <typename Traits>
bool keeps_state(int k, const typename Traits::Options& o) {
  if constexpr (OptionalStates<Traits>::value != 0) {
    if ((OptionalStates<Traits>::value >> k) & 1u) return Traits::has_state(k, o);
  }
  (void)k, (void)o;
  return true;
}

namespace detail {

// std::variant<Fixed..., every elementwise optimizer's options>.
#define DDPX_ELEMENTWISE_OPTIONS_ALTERNATIVE(Name) , Name::Options
template <typename... Fixed>
using VariantWithOptions =
    std::variant<Fixed... DDPX_ELEMENTWISE_OPTIMIZERS(DDPX_ELEMENTWISE_OPTIONS_ALTERNATIVE)>;
#undef DDPX_ELEMENTWISE_OPTIONS_ALTERNATIVE

}  // namespace detail
}  // namespace elementwise
}  // namespace optim
}  // namespace ddpx
