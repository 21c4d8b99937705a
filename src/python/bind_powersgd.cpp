// Bindings of PowerSGD: PowerSGDOptions, PowerSGDState and the two hooks. The Python classes in
// ddpx/hooks/powerSGD_hook.py wrap them.
#include <ddpx/hooks/powersgd_hook.h>
#include <ddpx/hooks/powersgd_state.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bind_utils.h"

namespace ddpx {
namespace python {

void bind_powersgd(py::module& m) {
  using hooks::PowerSGDOptions;
  using hooks::PowerSGDState;
  py::class_<PowerSGDOptions>(m, "PowerSGDOptions", "The hyperparameters of PowerSGDState.")
      .def(py::init<>())
      .def_readwrite("matrix_approximation_rank", &PowerSGDOptions::matrix_approximation_rank)
      .def_readwrite("start_powerSGD_iter", &PowerSGDOptions::start_powerSGD_iter)
      .def_readwrite("min_compression_rate", &PowerSGDOptions::min_compression_rate)
      .def_readwrite("use_error_feedback", &PowerSGDOptions::use_error_feedback)
      .def_readwrite("warm_start", &PowerSGDOptions::warm_start)
      .def_readwrite("orthogonalization_epsilon", &PowerSGDOptions::orthogonalization_epsilon)
      .def_readwrite("random_seed", &PowerSGDOptions::random_seed)
      .def_readwrite("compression_stats_logging_frequency",
                     &PowerSGDOptions::compression_stats_logging_frequency)
      .def_readwrite("batch_tensors_with_same_shape",
                     &PowerSGDOptions::batch_tensors_with_same_shape)
      .def("validate", &PowerSGDOptions::validate, "Raises ValueError naming a bad argument.");

  py::class_<PowerSGDState, std::shared_ptr<PowerSGDState>> state(
      m, "PowerSGDState", "Native PowerSGD state (see ddpx.hooks.PowerSGDState).");
  state
      .def(py::init([](const ProcessGroupPtr& pg, const PowerSGDOptions& options,
                       std::function<void(const std::string&)> logger) {
             return py_owned(new PowerSGDState(pg, options, std::move(logger)));
           }),
           py::arg("process_group"), py::arg("options"), py::arg("logger") = nullptr)
      .def_property_readonly("options", &PowerSGDState::options)
      .def("set_options", &PowerSGDState::set_options, py::arg("options"))
      .def_property("process_group", &PowerSGDState::process_group,
                    &PowerSGDState::set_process_group)
      .def_property("iter", &PowerSGDState::iter, &PowerSGDState::set_iter)
      .def_property_readonly("total_numel_before_compression",
                             &PowerSGDState::total_numel_before_compression)
      .def_property_readonly("total_numel_after_compression",
                             &PowerSGDState::total_numel_after_compression)
      .def_property_readonly("next_stats_report", &PowerSGDState::next_stats_report)
      .def("compression_stats", &PowerSGDState::compression_stats)
      .def("maybe_increase_iter", &PowerSGDState::maybe_increase_iter, py::arg("bucket_is_last"))
      .def("set_logger", &PowerSGDState::set_logger, py::arg("logger"))
      .def("set_seed_source", &PowerSGDState::set_seed_source, py::arg("source"),
           "A callable returning each Q seed (called with the GIL held), replacing the built-in "
           "generator; None restores it.")
      .def("error_dict", &PowerSGDState::error_memories,
           "Per-parameter error-feedback residuals, keyed by parameter order of first appearance.")
      .def("clear_memories", &PowerSGDState::clear_memories,
           "Forgets the error-feedback residuals and the warm-start Q factors (the way out "
           "after a step with NaN/Inf gradients).")
      .def("p_memory_dict", &PowerSGDState::p_memories,
           "Per-parameter P factors of the last step (layer-wise hook), keyed like error_dict().")
      .def("q_memory_dict", &PowerSGDState::q_memories,
           "Per-parameter warm-start Q factors, keyed like error_dict().");
  def_state_dict(state, /*bind_load=*/false);
  state.def(
      "load_state_dict",
      [](PowerSGDState& st, const py::object& d, bool strict, bool allow_reshard) {
        st.load_state_dict(state_dict_arg(d), strict, allow_reshard);
      },
      py::arg("state_dict"), py::arg("strict") = true, py::arg("allow_reshard") = false,
      "Restores state_dict()'s content; strict: an error memory of the wrong size raises at its "
      "parameter's first step (False: it is dropped); allow_reshard: accept error memories "
      "saved by another rank or world size (refused otherwise).");

  m.def(
      "powersgd_hook",
      [](const std::shared_ptr<PowerSGDState>& st, bool batched) -> hooks::CommHookPtr {
        return py_owned<hooks::CommHook>(new hooks::PowerSGDHook(st, batched));
      },
      py::arg("state"), py::arg("batched") = false,
      "Native powerSGD_hook (batched=False) or batched_powerSGD_hook (batched=True).");
}

}  // namespace python
}  // namespace ddpx
