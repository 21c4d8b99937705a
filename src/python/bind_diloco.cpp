// Bindings of DiLoCo's synchronization (ddpx::optim::DiLoCoSync). ddpx.optim.DiLoCo wraps it
// with the torch optimizers a Python caller passes.
#include <ddpx/optim/diloco.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bind_utils.h"

namespace ddpx {
namespace python {

void bind_diloco(py::module& m) {
  using optim::DiLoCoOptions;
  using optim::DiLoCoSync;
  py::class_<DiLoCoSync, std::shared_ptr<DiLoCoSync>> sync(
      m, "DiLoCoSync", "Native DiLoCo synchronization (see ddpx.optim.DiLoCo).");
  sync.def(py::init([](const py::object& params, const ProcessGroupPtr& pg, int64_t sync_every,
                       int64_t fragments, int64_t fragment_sync_delay, double fragment_update_alpha,
                       int64_t bits, int64_t block_size, bool use_error_feedback,
                       int64_t bucket_cap_bytes) {
             DiLoCoOptions o;
             o.sync_every = sync_every;
             o.fragments = fragments;
             o.fragment_sync_delay = fragment_sync_delay;
             o.fragment_update_alpha = fragment_update_alpha;
             o.bits = bits;
             o.block_size = block_size;
             o.use_error_feedback = use_error_feedback;
             o.bucket_cap_bytes = bucket_cap_bytes;
             return py_owned(new DiLoCoSync(tensor_list(params, "params"), pg, o));
           }),
           py::arg("params"), py::arg("process_group"), py::arg("sync_every"), py::arg("fragments"),
           py::arg("fragment_sync_delay"), py::arg("fragment_update_alpha"), py::arg("bits"),
           py::arg("block_size"), py::arg("use_error_feedback"), py::arg("bucket_cap_bytes"))
      .def("after_inner_step", &DiLoCoSync::after_inner_step,
           py::call_guard<py::gil_scoped_release>(),
           "Counts an inner step, starts the exchanges due; returns the fragments to step now.")
      .def("begin_outer", &DiLoCoSync::begin_outer, py::arg("fragment"),
           py::call_guard<py::gil_scoped_release>())
      .def("end_outer", &DiLoCoSync::end_outer, py::arg("fragment"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "outer_sgd_step",
          [](DiLoCoSync& s, int64_t fragment, const optim::SGDOptions& options,
             const py::object& buffers) {
            std::vector<at::Tensor> bufs = tensor_list(buffers, "momentum_buffers");
            {
              py::gil_scoped_release no_gil;
              s.outer_sgd_step(fragment, options, bufs);
            }
            return to_py(bufs);
          },
          py::arg("fragment"), py::arg("options"), py::arg("momentum_buffers"),
          "The fragment's outer step with SGD (an SGDOptions) in C++; returns the momentum "
          "buffers.")
      .def_property_readonly("step", &DiLoCoSync::step)
      .def_property_readonly("fragment_ranges", &DiLoCoSync::fragment_ranges)
      .def("first_sync_step", &DiLoCoSync::first_sync_step, py::arg("fragment"))
      .def_property_readonly("pending", &DiLoCoSync::pending)
      .def_property_readonly("message_bytes", &DiLoCoSync::message_bytes)
      .def_property_readonly("global_params",
                             [](const DiLoCoSync& s) { return to_py(s.global_params()); })
      .def(
          "state_dict",
          [](DiLoCoSync& s) {
            c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
            {
              py::gil_scoped_release no_gil;
              d = s.state_dict();
            }
            return torch::jit::toPyObject(c10::IValue(d));
          },
          "The state to checkpoint, as a dict (exchanges in flight waited for).")
      .def(
          "load_state_dict",
          [](DiLoCoSync& s, const py::object& d, bool allow_reshard) {
            const c10::impl::GenericDict state = state_dict_arg(d);
            with_py_warnings([&] { s.load_state_dict(state, allow_reshard); });
          },
          py::arg("state_dict"), py::arg("allow_reshard") = false);
}

}  // namespace python
}  // namespace ddpx
