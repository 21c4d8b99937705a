// The owner side of ddpx.optim.DistributedOptimizer (ddpx/optim/rpc_local_optimizer.h): the
// registry calls the Python class makes once per worker (under the GIL: construction only), and
// the operator its steps run as, with no Python on the owner:
//
//   aten::_ddpx_rpc_optimizer_step(int optimizer_id, int context_id) -> bool
//
// (it returns true: torch's RPC sends back exactly one value for a builtin, so an operator
// returning nothing fails on the callee),
// registered in the JIT's operator table under aten:: because torch's RPC runs a call to a
// builtin operator on the owner's agent thread without Python, and takes only aten:: names as
// builtins (the caller matches `aten::` symbols; the callee resolves "torch.ops.aten.<name>"),
// on torch 1.13, 2.11 and 2.15 alike. The trainer sends it by rpc_async (ddpx/_compat.py
// registers the Python stub it is called through). It fetches the context's gradients through
// the operator aten::get_gradients (dist_autograd.get_gradients), found in the same table,
// since Debian's torch ships no distributed-autograd headers. TorchScript, the path before (a
// scripted function calling the operator), is deprecated from torch 2.14.
#include <ATen/core/stack.h>
#include <ddpx/optim/rpc_local_optimizer.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/runtime/custom_operator.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <vector>

#include "bind_utils.h"

namespace ddpx {
namespace python {
namespace {

// The gradients distributed autograd accumulated in context `context_id`, keyed by parameter.
c10::Dict<at::Tensor, at::Tensor> context_gradients(int64_t context_id) {
  static const std::shared_ptr<torch::jit::Operator> get_gradients =
      torch::jit::findOperatorFor(c10::OperatorName("aten::get_gradients", ""));
  TORCH_CHECK(get_gradients,
              "ddpx: torch has no operator aten::get_gradients (a torch built "
              "without distributed autograd)");
  torch::jit::Stack stack{c10::IValue(context_id)};
  try {
    get_gradients->getOperation()(stack);
  } catch (const c10::Error& e) {
    // An owner that no forward of this context reached has no such context: a builtin call
    // carries no autograd metadata (torch sends it without forcing it, unlike a TorchScript
    // call, which created the context on the owner), and no gradient of its parameters exists
    // in it. The trainer checked that the context is valid before sending; the step then skips
    // every parameter, as with an empty context. torch's message is its only signal of this.
    if (std::string(e.what()).find("Could not find autograd context with id") ==
        std::string::npos) {
      throw;
    }
    return c10::Dict<at::Tensor, at::Tensor>();
  }
  return c10::impl::toTypedDict<at::Tensor, at::Tensor>(torch::jit::pop(stack).toGenericDict());
}

void step_with_context(int64_t optimizer_id, int64_t context_id) {
  // An unknown optimizer is the clearer error (an owner shut down, an optimizer deleted): it is
  // looked up before the context, which such an owner does not have either.
  (void)optim::rpc_local_optimizer(optimizer_id);
  optim::step_rpc_local_optimizer(optimizer_id, context_gradients(context_id));
}

torch::jit::RegisterOperators register_rpc_optimizer_step(
    {torch::jit::Operator(
         "aten::_ddpx_rpc_optimizer_step(int optimizer_id, int context_id) -> bool",
         [](torch::jit::Stack& stack) {
           const int64_t context_id = torch::jit::pop(stack).toInt();
           const int64_t optimizer_id = torch::jit::pop(stack).toInt();
           step_with_context(optimizer_id, context_id);
           torch::jit::push(stack, true);
         },
         c10::AliasAnalysisKind::CONSERVATIVE),
     // The same shape doing nothing: the baseline of benchmarks/bench_dist_optim.py (what the RPC
     // of a step costs without the step).
     torch::jit::Operator(
         "aten::_ddpx_rpc_noop(int optimizer_id, int context_id) -> bool",
         [](torch::jit::Stack& stack) {
           torch::jit::drop(stack, 2);
           torch::jit::push(stack, true);
         },
         c10::AliasAnalysisKind::CONSERVATIVE)});

}  // namespace

void bind_rpc_optim(py::module& m) {
  m.def(
      "_rpc_optimizer_new",
      [](const py::object& params, const optim::OptimizerOptions& options) {
        auto optimizer = optim::make_rpc_local_optimizer(tensor_list(params, "params"), options);
        return optim::register_rpc_local_optimizer(std::move(optimizer));
      },
      py::arg("params"), py::arg("options"),
      "Builds this worker's C++ optimizer over `params`, of the kind `options` stand for "
      "(SGDOptions, AdamOptions, AdagradOptions, RMSpropOptions), registers it and returns its "
      "id.");
  m.def("_rpc_optimizer_delete", &optim::unregister_rpc_local_optimizer, py::arg("optimizer_id"));
  m.def(
      "_rpc_optimizer_step",
      [](int64_t id, const py::dict& grads) {
        c10::Dict<at::Tensor, at::Tensor> typed;
        for (const auto& item : grads) {
          typed.insert(py::cast<at::Tensor>(item.first), py::cast<at::Tensor>(item.second));
        }
        py::gil_scoped_release no_gil;
        optim::step_rpc_local_optimizer(id, typed);
      },
      py::arg("optimizer_id"), py::arg("grads"),
      "Steps optimizer `optimizer_id` with `grads` (a dict parameter -> gradient; tests).");
  m.def(
      "_rpc_optimizer_step_context",
      [](int64_t optimizer_id, int64_t context_id) {
        py::gil_scoped_release no_gil;
        step_with_context(optimizer_id, context_id);
      },
      py::arg("optimizer_id"), py::arg("context_id"),
      "What the operator aten::_ddpx_rpc_optimizer_step runs: steps optimizer `optimizer_id` "
      "with the gradients of distributed autograd context `context_id`, without the GIL (the "
      "Python fallback path when the builtin cannot be registered).");
  m.def(
      "_rpc_optimizer_state", [](int64_t id) { return optim::rpc_local_optimizer(id)->state(); },
      py::arg("optimizer_id"),
      "The local optimizer's state, one dict per parameter in torch.optim's layout.");
}

}  // namespace python
}  // namespace ddpx
