// Bindings of post-local SGD: PostLocalSGDState and post_localSGD_hook. The Python classes in
// ddpx/hooks/post_localSGD_hook.py wrap them.
#include <ddpx/hooks/post_localsgd_hook.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bind_utils.h"

namespace ddpx {
namespace python {

void bind_post_localsgd(py::module& m) {
  using hooks::PostLocalSGDState;
  py::class_<PostLocalSGDState, std::shared_ptr<PostLocalSGDState>> state(
      m, "PostLocalSGDState", "Native post-local SGD state (see ddpx.hooks.PostLocalSGDState).");
  state
      .def(py::init([](const ProcessGroupPtr& pg, const py::object& subgroup, int64_t start,
                       bool post_local_gradient_allreduce,
                       std::function<void(const std::string&)> logger) {
             return py_owned(new PostLocalSGDState(pg, optional_group(subgroup), start,
                                                   post_local_gradient_allreduce,
                                                   std::move(logger)));
           }),
           py::arg("process_group"), py::arg("subgroup"), py::arg("start_localSGD_iter"),
           py::arg("post_local_gradient_allreduce") = true, py::arg("logger") = nullptr)
      .def_property("process_group", &PostLocalSGDState::process_group,
                    &PostLocalSGDState::set_process_group)
      .def_property(
          "subgroup", [](const PostLocalSGDState& s) { return group_or_none(s.subgroup()); },
          [](PostLocalSGDState& s, const py::object& g) { s.set_subgroup(optional_group(g)); })
      .def_property("start_localSGD_iter", &PostLocalSGDState::start_localSGD_iter,
                    &PostLocalSGDState::set_start_localSGD_iter)
      .def_property("post_local_gradient_allreduce",
                    &PostLocalSGDState::post_local_gradient_allreduce,
                    &PostLocalSGDState::set_post_local_gradient_allreduce)
      .def_property("iter", &PostLocalSGDState::iter, &PostLocalSGDState::set_iter)
      .def("maybe_increase_iter", &PostLocalSGDState::maybe_increase_iter,
           py::arg("bucket_is_last"))
      .def("set_logger", &PostLocalSGDState::set_logger, py::arg("logger"));
  def_state_dict(state);

  m.def(
      "post_localsgd_hook",
      [](const std::shared_ptr<PostLocalSGDState>& st) -> hooks::CommHookPtr {
        return py_owned<hooks::CommHook>(new hooks::PostLocalSGDHook(st));
      },
      py::arg("state"), "Native post_localSGD_hook over `state`.");
}

}  // namespace python
}  // namespace ddpx
