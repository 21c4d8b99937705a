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

#include <variant>

#include "adadelta.h"
#include "adamax.h"
#include "radam.h"
#include "rprop.h"

// X(Name) for every elementwise optimizer, whose traits are ddpx::optim::elementwise::Name.
#define DDPX_ELEMENTWISE_OPTIMIZERS(X) X(Adadelta) X(Adamax) X(RAdam) X(Rprop)

namespace ddpx {
namespace optim {
namespace elementwise {
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
