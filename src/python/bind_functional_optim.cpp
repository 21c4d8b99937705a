// Bindings of the functional optimizers (ddpx/optim/functional.h): the multi-tensor steps
// sgd_step / adam_step and the stateful FunctionalSGD / FunctionalAdam. Tensor lists come and
// go as Python lists with None for an undefined tensor (a state not created yet, a missing
// gradient); the steps return the state lists they filled in.
#include <ddpx/optim/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "bind_utils.h"

namespace ddpx {
namespace python {
namespace {

optim::SGDOptions sgd_options(double lr, double momentum, double dampening, double weight_decay,
                              bool nesterov, bool maximize) {
  optim::SGDOptions o;
  o.lr = lr;
  o.momentum = momentum;
  o.dampening = dampening;
  o.weight_decay = weight_decay;
  o.nesterov = nesterov;
  o.maximize = maximize;
  return o;
}

optim::AdamOptions adam_options(double lr, const std::pair<double, double>& betas, double eps,
                                double weight_decay, bool amsgrad, bool maximize) {
  optim::AdamOptions o;
  o.lr = lr;
  o.beta1 = betas.first;
  o.beta2 = betas.second;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.amsgrad = amsgrad;
  o.maximize = maximize;
  return o;
}

}  // namespace

void bind_functional_optim(py::module& m) {
  m.def(
      "sgd_step",
      [](const py::object& params, const py::object& grads, const py::object& momentum_buffers,
         double lr, double momentum, double dampening, double weight_decay, bool nesterov,
         bool maximize) {
        const auto p = tensor_list(params, "params");
        const auto g = tensor_list(grads, "grads");
        auto bufs = tensor_list(momentum_buffers, "momentum_buffers");
        const auto opts = sgd_options(lr, momentum, dampening, weight_decay, nesterov, maximize);
        {
          py::gil_scoped_release no_gil;
          optim::sgd_step(p, g, bufs, opts);
        }
        return to_py(bufs);
      },
      py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::kw_only(),
      py::arg("lr") = 1e-3, py::arg("momentum") = 0.0, py::arg("dampening") = 0.0,
      py::arg("weight_decay") = 0.0, py::arg("nesterov") = false, py::arg("maximize") = false,
      "One fused SGD step of every parameter (torch.optim.SGD's formulas). momentum_buffers: "
      "one entry per parameter, None before its first step. Returns the momentum buffers.");
  m.def(
      "adam_step",
      [](const py::object& params, const py::object& grads, const py::object& exp_avgs,
         const py::object& exp_avg_sqs, const py::object& max_exp_avg_sqs,
         std::vector<int64_t> steps, double lr, std::pair<double, double> betas, double eps,
         double weight_decay, bool amsgrad, bool maximize, bool decoupled_weight_decay) {
        const auto p = tensor_list(params, "params");
        const auto g = tensor_list(grads, "grads");
        auto m1 = tensor_list(exp_avgs, "exp_avgs");
        auto m2 = tensor_list(exp_avg_sqs, "exp_avg_sqs");
        auto mx = tensor_list(max_exp_avg_sqs, "max_exp_avg_sqs");
        const auto opts = adam_options(lr, betas, eps, weight_decay, amsgrad, maximize);
        {
          py::gil_scoped_release no_gil;
          optim::adam_step(p, g, m1, m2, mx, steps, opts, decoupled_weight_decay);
        }
        return py::make_tuple(to_py(m1), to_py(m2), to_py(mx), steps);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("max_exp_avg_sqs"), py::arg("steps"), py::kw_only(), py::arg("lr") = 1e-3,
      py::arg("betas") = std::make_pair(0.9, 0.999), py::arg("eps") = 1e-8,
      py::arg("weight_decay") = 0.0, py::arg("amsgrad") = false, py::arg("maximize") = false,
      py::arg("decoupled_weight_decay") = false,
      "One fused Adam step (AdamW's with decoupled_weight_decay=True) of every parameter "
      "(torch.optim.Adam's formulas). State lists: one entry per parameter, None before its "
      "first step (max_exp_avg_sqs may be [] without amsgrad); steps: per-parameter step counts. "
      "Returns (exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) after the step.");

  py::class_<optim::FunctionalSGD>(m, "FunctionalSGD")
      .def(py::init([](const py::object& params, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov, bool maximize) {
             return optim::FunctionalSGD(
                 tensor_list(params, "params"),
                 sgd_options(lr, momentum, dampening, weight_decay, nesterov, maximize));
           }),
           py::arg("params"), py::kw_only(), py::arg("lr") = 1e-3, py::arg("momentum") = 0.0,
           py::arg("dampening") = 0.0, py::arg("weight_decay") = 0.0, py::arg("nesterov") = false,
           py::arg("maximize") = false)
      .def(
          "step",
          [](optim::FunctionalSGD& self, const py::object& grads) {
            const auto g = tensor_list(grads, "grads");
            py::gil_scoped_release no_gil;
            self.step(g);
          },
          py::arg("grads"), "Steps the parameters whose gradient is not None.")
      .def("state", &optim::FunctionalSGD::state,
           "Per-parameter state in torch.optim.SGD's layout ({'momentum_buffer': t} or {}).")
      .def("load_state", &optim::FunctionalSGD::load_state, py::arg("state"));

  py::class_<optim::FunctionalAdam>(m, "FunctionalAdam")
      .def(py::init([](const py::object& params, double lr, std::pair<double, double> betas,
                       double eps, double weight_decay, bool amsgrad, bool maximize,
                       bool decoupled_weight_decay) {
             return optim::FunctionalAdam(
                 tensor_list(params, "params"),
                 adam_options(lr, betas, eps, weight_decay, amsgrad, maximize),
                 decoupled_weight_decay);
           }),
           py::arg("params"), py::kw_only(), py::arg("lr") = 1e-3,
           py::arg("betas") = std::make_pair(0.9, 0.999), py::arg("eps") = 1e-8,
           py::arg("weight_decay") = 0.0, py::arg("amsgrad") = false, py::arg("maximize") = false,
           py::arg("decoupled_weight_decay") = false)
      .def(
          "step",
          [](optim::FunctionalAdam& self, const py::object& grads) {
            const auto g = tensor_list(grads, "grads");
            py::gil_scoped_release no_gil;
            self.step(g);
          },
          py::arg("grads"), "Steps the parameters whose gradient is not None.")
      .def("state", &optim::FunctionalAdam::state,
           "Per-parameter state in torch.optim.Adam's layout (step, exp_avg, exp_avg_sq, "
           "max_exp_avg_sq with amsgrad; {} before a parameter's first step).")
      .def("load_state", &optim::FunctionalAdam::load_state, py::arg("state"));
}

}  // namespace python
}  // namespace ddpx
