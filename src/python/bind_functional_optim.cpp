// Bindings of the functional optimizers (ddpx/optim/functional.h): the multi-tensor steps
// sgd_step / adam_step / adagrad_step / rmsprop_step and the stateful FunctionalSGD /
// FunctionalAdam / FunctionalAdagrad / FunctionalRMSprop. Tensor lists come and go as Python
// lists with None for an undefined tensor (a state not created yet, a missing gradient); the
// steps return the state lists they filled in.
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

optim::AdagradOptions adagrad_options(double lr, double lr_decay, double weight_decay,
                                      double initial_accumulator_value, double eps, bool maximize) {
  optim::AdagradOptions o;
  o.lr = lr;
  o.lr_decay = lr_decay;
  o.weight_decay = weight_decay;
  o.initial_accumulator_value = initial_accumulator_value;
  o.eps = eps;
  o.maximize = maximize;
  return o;
}

optim::RMSpropOptions rmsprop_options(double lr, double alpha, double eps, double weight_decay,
                                      double momentum, bool centered, bool maximize) {
  optim::RMSpropOptions o;
  o.lr = lr;
  o.alpha = alpha;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.momentum = momentum;
  o.centered = centered;
  o.maximize = maximize;
  return o;
}

// Per-parameter state dicts from Python: tensor values as they are, a number (torch 1.13's
// RMSprop keeps "step" as a Python int) as a 0-dim float32 tensor, as torch's own __setstate__
// turns an old number step into a tensor.
std::vector<optim::ParamState> param_states(const py::handle& seq) {
  if (!py::isinstance<py::sequence>(seq)) {
    throw py::type_error("state must be a list of dicts");
  }
  std::vector<optim::ParamState> out;
  for (const py::handle& item : py::reinterpret_borrow<py::sequence>(seq)) {
    if (!py::isinstance<py::dict>(item)) {
      throw py::type_error(std::string("state must hold dicts, got ") +
                           Py_TYPE(item.ptr())->tp_name);
    }
    optim::ParamState st;
    for (const auto& kv : py::reinterpret_borrow<py::dict>(item)) {
      const std::string key = py::cast<std::string>(kv.first);
      const py::handle value = kv.second;
      if (THPVariable_Check(value.ptr())) {
        st[key] = THPVariable_Unpack(value.ptr());
      } else if ((PyLong_Check(value.ptr()) || PyFloat_Check(value.ptr())) &&
                 !PyBool_Check(value.ptr())) {
        st[key] = at::scalar_tensor(py::cast<double>(value), at::kFloat);
      } else {
        throw py::type_error("state[\"" + key + "\"] must be a tensor or a number, got " +
                             Py_TYPE(value.ptr())->tp_name);
      }
    }
    out.push_back(std::move(st));
  }
  return out;
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

  m.def(
      "adagrad_step",
      [](const py::object& params, const py::object& grads, const py::object& state_sums,
         std::vector<int64_t> steps, double lr, double lr_decay, double weight_decay,
         double initial_accumulator_value, double eps, bool maximize) {
        const auto p = tensor_list(params, "params");
        const auto g = tensor_list(grads, "grads");
        auto sums = tensor_list(state_sums, "state_sums");
        const auto opts =
            adagrad_options(lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize);
        {
          py::gil_scoped_release no_gil;
          optim::adagrad_step(p, g, sums, steps, opts);
        }
        return py::make_tuple(to_py(sums), steps);
      },
      py::arg("params"), py::arg("grads"), py::arg("state_sums"), py::arg("steps"), py::kw_only(),
      py::arg("lr") = 1e-2, py::arg("lr_decay") = 0.0, py::arg("weight_decay") = 0.0,
      py::arg("initial_accumulator_value") = 0.0, py::arg("eps") = 1e-10,
      py::arg("maximize") = false,
      "One fused Adagrad step of every parameter (torch.optim.Adagrad's formulas, dense "
      "gradients). state_sums: one entry per parameter, None before its first step (created "
      "filled with initial_accumulator_value); steps: per-parameter step counts. Returns "
      "(state_sums, steps) after the step.");
  m.def(
      "rmsprop_step",
      [](const py::object& params, const py::object& grads, const py::object& square_avgs,
         const py::object& grad_avgs, const py::object& momentum_buffers,
         std::vector<int64_t> steps, double lr, double alpha, double eps, double weight_decay,
         double momentum, bool centered, bool maximize) {
        const auto p = tensor_list(params, "params");
        const auto g = tensor_list(grads, "grads");
        auto sq = tensor_list(square_avgs, "square_avgs");
        auto ga = tensor_list(grad_avgs, "grad_avgs");
        auto bufs = tensor_list(momentum_buffers, "momentum_buffers");
        const auto opts =
            rmsprop_options(lr, alpha, eps, weight_decay, momentum, centered, maximize);
        {
          py::gil_scoped_release no_gil;
          optim::rmsprop_step(p, g, sq, ga, bufs, steps, opts);
        }
        return py::make_tuple(to_py(sq), to_py(ga), to_py(bufs), steps);
      },
      py::arg("params"), py::arg("grads"), py::arg("square_avgs"), py::arg("grad_avgs"),
      py::arg("momentum_buffers"), py::arg("steps"), py::kw_only(), py::arg("lr") = 1e-2,
      py::arg("alpha") = 0.99, py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0,
      py::arg("momentum") = 0.0, py::arg("centered") = false, py::arg("maximize") = false,
      "One fused RMSprop step of every parameter (torch.optim.RMSprop's formulas). State lists: "
      "one entry per parameter, None before its first step (grad_avgs may be [] unless centered, "
      "momentum_buffers [] without momentum); steps: per-parameter step counts. Returns "
      "(square_avgs, grad_avgs, momentum_buffers, steps) after the step.");

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

  py::class_<optim::FunctionalAdagrad>(m, "FunctionalAdagrad")
      .def(py::init([](const py::object& params, double lr, double lr_decay, double weight_decay,
                       double initial_accumulator_value, double eps, bool maximize) {
             return optim::FunctionalAdagrad(
                 tensor_list(params, "params"),
                 adagrad_options(lr, lr_decay, weight_decay, initial_accumulator_value, eps,
                                 maximize));
           }),
           py::arg("params"), py::kw_only(), py::arg("lr") = 1e-2, py::arg("lr_decay") = 0.0,
           py::arg("weight_decay") = 0.0, py::arg("initial_accumulator_value") = 0.0,
           py::arg("eps") = 1e-10, py::arg("maximize") = false)
      .def(
          "step",
          [](optim::FunctionalAdagrad& self, const py::object& grads) {
            const auto g = tensor_list(grads, "grads");
            py::gil_scoped_release no_gil;
            self.step(g);
          },
          py::arg("grads"), "Steps the parameters whose gradient is not None.")
      .def("state", &optim::FunctionalAdagrad::state,
           "Per-parameter state in torch.optim.Adagrad's layout ({'step': t, 'sum': t} for every "
           "parameter, created in the constructor as torch does).")
      .def(
          "load_state",
          [](optim::FunctionalAdagrad& self, const py::object& state) {
            self.load_state(param_states(state));
          },
          py::arg("state"));

  py::class_<optim::FunctionalRMSprop>(m, "FunctionalRMSprop")
      .def(py::init([](const py::object& params, double lr, double alpha, double eps,
                       double weight_decay, double momentum, bool centered, bool maximize) {
             return optim::FunctionalRMSprop(
                 tensor_list(params, "params"),
                 rmsprop_options(lr, alpha, eps, weight_decay, momentum, centered, maximize));
           }),
           py::arg("params"), py::kw_only(), py::arg("lr") = 1e-2, py::arg("alpha") = 0.99,
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0, py::arg("momentum") = 0.0,
           py::arg("centered") = false, py::arg("maximize") = false)
      .def(
          "step",
          [](optim::FunctionalRMSprop& self, const py::object& grads) {
            const auto g = tensor_list(grads, "grads");
            py::gil_scoped_release no_gil;
            self.step(g);
          },
          py::arg("grads"), "Steps the parameters whose gradient is not None.")
      .def("state", &optim::FunctionalRMSprop::state,
           "Per-parameter state in torch.optim.RMSprop's layout (step, square_avg, "
           "momentum_buffer with momentum, grad_avg when centered; {} before a parameter's "
           "first step).")
      .def(
          "load_state",
          [](optim::FunctionalRMSprop& self, const py::object& state) {
            self.load_state(param_states(state));
          },
          py::arg("state"),
          "Loads state() or torch.optim.RMSprop's per-parameter state (a number step, as torch "
          "1.13 keeps it, is taken too).");
}

}  // namespace python
}  // namespace ddpx
