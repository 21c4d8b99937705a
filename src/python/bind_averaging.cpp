// Bindings of post-local SGD: PostLocalSGDState and post_localSGD_hook, average_parameters and
// the model averagers. The Python classes in ddpx/hooks/post_localSGD_hook.py and
// ddpx/model_averaging.py wrap them.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <ddpx/averaging/average.h>
#include <ddpx/averaging/averagers.h>
#include <ddpx/hooks/post_localsgd_hook.h>

#include "bind_utils.h"

namespace ddpx {
namespace python {

namespace {

using PG = c10::intrusive_ptr<c10d::ProcessGroup>;
using hooks::PostLocalSGDState;

// None -> null (no group / not a member).
PG optional_group(const py::object& obj) { return obj.is_none() ? PG() : obj.cast<PG>(); }

py::object group_or_none(const PG& pg) { return pg ? py::cast(pg) : py::none(); }

py::dict stats_dict(const AverageStats& s) {
  py::dict d;
  d["tensors"] = s.tensors;
  d["collectives"] = s.collectives;
  d["inplace_tensors"] = s.inplace_tensors;
  d["staged_tensors"] = s.staged_tensors;
  d["staging_bytes"] = s.staging_bytes;
  return d;
}

AverageOptions options_from_bytes(int64_t bucket_cap_bytes) {
  AverageOptions o;
  o.bucket_cap_bytes = bucket_cap_bytes;
  return o;
}

// Runs f with C++ warnings (TORCH_WARN) turned into Python warnings.
template <typename F>
auto with_py_warnings(F&& f) -> decltype(f()) {
  torch::PyWarningHandler handler;
  try {
    return f();
  } catch (...) {
    handler.set_in_exception();
    throw;
  }
}

}  // namespace

void bind_post_local_sgd(py::module& m) {
  py::class_<PostLocalSGDState, std::shared_ptr<PostLocalSGDState>>(
      m, "PostLocalSGDState", "Native post-local SGD state (see ddpx.hooks.PostLocalSGDState).")
      .def(py::init([](const PG& pg, const py::object& subgroup, int64_t start,
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
      .def("set_logger", &PostLocalSGDState::set_logger, py::arg("logger"))
      .def("state_dict",
           [](const PostLocalSGDState& s) {
             return torch::jit::toPyObject(c10::IValue(s.state_dict()));
           })
      .def(
          "load_state_dict",
          [](PostLocalSGDState& s, const py::object& d) {
            TORCH_CHECK_TYPE(py::isinstance<py::dict>(d),
                             "load_state_dict: state_dict must be a dict, got ",
                             py::str(py::type::of(d)).cast<std::string>());
            s.load_state_dict(state_to_ivalue(d).toGenericDict());
          },
          py::arg("state_dict"));

  m.def(
      "post_localsgd_hook",
      [](const std::shared_ptr<PostLocalSGDState>& state) -> hooks::CommHookPtr {
        return py_owned<hooks::CommHook>(new hooks::PostLocalSGDHook(state));
      },
      py::arg("state"), "Native post_localSGD_hook over `state`.");

  m.def(
      "average_parameters",
      [](const std::vector<at::Tensor>& params, const py::object& group,
         int64_t bucket_cap_bytes) {
        const PG pg = optional_group(group);
        AverageStats stats;
        {
          py::gil_scoped_release no_gil;
          stats = ddpx::average_parameters(params, pg, options_from_bytes(bucket_cap_bytes));
        }
        return stats_dict(stats);
      },
      py::arg("params"), py::arg("process_group"),
      py::arg("bucket_cap_bytes") = kDefaultAverageBucketBytes,
      "Averages `params` in place over `process_group` (None: not a member, no-op) in bounded "
      "memory; returns what it did as a dict.");

  py::class_<ModelAverager, std::shared_ptr<ModelAverager>>(
      m, "ModelAverager", "Native model averager base (see ddpx.model_averaging).")
      .def_property("step", &ModelAverager::step, &ModelAverager::set_step)
      .def_property_readonly("process_group",
                             [](const ModelAverager& a) { return group_or_none(a.process_group()); })
      .def_property(
          "bucket_cap_bytes", [](const ModelAverager& a) { return a.options().bucket_cap_bytes; },
          [](ModelAverager& a, int64_t bytes) { a.set_options(options_from_bytes(bytes)); })
      .def_property_readonly("last_stats",
                             [](const ModelAverager& a) { return stats_dict(a.last_stats()); })
      .def(
          "average_parameters",
          [](ModelAverager& a, const std::vector<at::Tensor>& params) {
            py::gil_scoped_release no_gil;
            a.average_parameters(params);
          },
          py::arg("params"),
          "Averages the tensors of `params` that have a gradient if this step calls for it, "
          "then counts the step.");

  py::class_<PeriodicModelAverager, ModelAverager, std::shared_ptr<PeriodicModelAverager>>(
      m, "PeriodicModelAverager", "Native PeriodicModelAverager.")
      .def(py::init([](int64_t period, int64_t warmup_steps, const py::object& group,
                       int64_t bucket_cap_bytes) {
             return with_py_warnings([&] {
               return py_owned(new PeriodicModelAverager(period, warmup_steps,
                                                         optional_group(group),
                                                         options_from_bytes(bucket_cap_bytes)));
             });
           }),
           py::arg("period"), py::arg("warmup_steps"), py::arg("process_group"),
           py::arg("bucket_cap_bytes") = kDefaultAverageBucketBytes)
      .def_property_readonly("period", &PeriodicModelAverager::period)
      .def_property_readonly("warmup_steps", &PeriodicModelAverager::warmup_steps);

  py::class_<HierarchicalModelAverager, ModelAverager,
             std::shared_ptr<HierarchicalModelAverager>>(m, "HierarchicalModelAverager",
                                                         "Native HierarchicalModelAverager.")
      .def(py::init([](const std::vector<std::pair<int64_t, py::object>>& levels,
                       int64_t warmup_steps, const PG& group, int64_t bucket_cap_bytes) {
             std::vector<std::pair<int64_t, PG>> period_groups;
             for (const auto& level : levels) {
               period_groups.emplace_back(level.first, optional_group(level.second));
             }
             return with_py_warnings([&] {
               return py_owned(new HierarchicalModelAverager(
                   std::move(period_groups), warmup_steps, group,
                   options_from_bytes(bucket_cap_bytes)));
             });
           }),
           py::arg("period_groups"), py::arg("warmup_steps"), py::arg("process_group"),
           py::arg("bucket_cap_bytes") = kDefaultAverageBucketBytes)
      .def_property_readonly("warmup_steps", &HierarchicalModelAverager::warmup_steps)
      .def("group_index_for_step", &HierarchicalModelAverager::group_index_for_step,
           py::arg("step"));
}

}  // namespace python
}  // namespace ddpx
