// The owner side of ddpx.optim.DistributedOptimizer (ddpx/optim/rpc_local_optimizer.h): the
// registry calls the Python class makes once per worker (under the GIL: construction only), and
// the TorchScript operator its steps run through, with no Python on the owner:
//
//   ddpx::rpc_optimizer_step(int optimizer_id, Dict(Tensor, Tensor) grads) -> ()
//
// registered in the JIT's operator table (as torch's own distributed-autograd operators are:
// aten::get_gradients returns the Dict this takes), so that the TorchScript function an RPC
// runs, `torch.ops.ddpx.rpc_optimizer_step(id, dist_autograd.get_gradients(ctx))`, calls C++
// directly on the RPC agent's thread.
#include <ATen/core/stack.h>
#include <ddpx/optim/rpc_local_optimizer.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/runtime/custom_operator.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "bind_utils.h"

namespace ddpx {
namespace python {
namespace {

torch::jit::RegisterOperators register_rpc_optimizer_step({torch::jit::Operator(
    "ddpx::rpc_optimizer_step(int optimizer_id, Dict(Tensor, Tensor) grads) -> ()",
    [](torch::jit::Stack& stack) {
      c10::impl::GenericDict grads = torch::jit::pop(stack).toGenericDict();
      const int64_t id = torch::jit::pop(stack).toInt();
      optim::step_rpc_local_optimizer(id, c10::impl::toTypedDict<at::Tensor, at::Tensor>(grads));
    },
    c10::AliasAnalysisKind::CONSERVATIVE)});

}  // namespace

void bind_rpc_optim(py::module& m) {
  m.def(
      "_rpc_optimizer_new",
      [](const std::string& kind, const py::object& params, const optim::OptimizerArgs& args) {
        auto optimizer = optim::make_rpc_local_optimizer(kind, tensor_list(params, "params"), args);
        return optim::register_rpc_local_optimizer(std::move(optimizer));
      },
      py::arg("kind"), py::arg("params"), py::arg("args"),
      "Builds this worker's C++ optimizer `kind` ('sgd', 'adam', 'adamw', 'adagrad', "
      "'rmsprop') over `params` with "
      "torch's constructor arguments `args` (a dict of floats; betas as beta1/beta2) and "
      "registers it; returns its id.");
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
      "What the operator ddpx::rpc_optimizer_step runs, callable from Python (tests).");
  m.def(
      "_rpc_optimizer_state", [](int64_t id) { return optim::rpc_local_optimizer(id)->state(); },
      py::arg("optimizer_id"),
      "The local optimizer's state, one dict per parameter in torch.optim's layout.");
}

}  // namespace python
}  // namespace ddpx
