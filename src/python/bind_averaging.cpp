// Bindings of parameter averaging and the model averagers. The Python classes in
// ddpx/model_averaging.py wrap them.
#include <ddpx/comm/average.h>
#include <ddpx/optim/averagers.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bind_utils.h"
#include "comm/digest.h"

namespace ddpx {
namespace python {

namespace {

using comm::AverageOptions;
using comm::AverageStats;
using optim::HierarchicalModelAverager;
using optim::ModelAverager;
using optim::PeriodicModelAverager;

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

}  // namespace

void bind_averaging(py::module& m) {
  m.def(
      "average_parameters",
      [](const std::vector<at::Tensor>& params, const py::object& group, int64_t bucket_cap_bytes) {
        const ProcessGroupPtr pg = optional_group(group);
        AverageStats stats;
        {
          py::gil_scoped_release no_gil;
          stats = ddpx::comm::average_parameters(params, pg, options_from_bytes(bucket_cap_bytes));
        }
        return stats_dict(stats);
      },
      py::arg("params"), py::arg("process_group"),
      py::arg("bucket_cap_bytes") = comm::kDefaultBucketBytes,
      "Averages `params` in place over `process_group` (None: not a member, no-op) in bounded "
      "memory; returns what it did as a dict.");

  m.def(
      "_all_ranks_agree",
      [](const std::vector<int64_t>& digests, const py::object& group, const at::Device& device,
         const std::string& where) {
        const ProcessGroupPtr pg = optional_group(group);
        TORCH_CHECK_VALUE(pg, "_all_ranks_agree: this rank is not in the group");
        TORCH_CHECK_VALUE(where == "auto" || where == "host" || where == "device",
                          "_all_ranks_agree: where must be 'auto', 'host' or 'device', got '",
                          where, "'");
        const comm::AgreeOn on = where == "host"     ? comm::AgreeOn::kHost
                                 : where == "device" ? comm::AgreeOn::kDevice
                                                     : comm::AgreeOn::kAuto;
        py::gil_scoped_release no_gil;
        return comm::all_ranks_agree(digests, pg, device, on);
      },
      py::arg("digests"), py::arg("process_group"), py::arg("device"), py::arg("where") = "auto",
      "For tests: whether every rank passed the same digests (the agreement averaging and the "
      "C++ DDP run before their collectives), the all-reduce on the host or on `device`.");

  py::class_<ModelAverager, std::shared_ptr<ModelAverager>>(
      m, "ModelAverager", "Native model averager base (see ddpx.model_averaging).")
      .def_property("step", &ModelAverager::step, &ModelAverager::set_step)
      .def_property_readonly(
          "process_group", [](const ModelAverager& a) { return group_or_none(a.process_group()); })
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
      .def(
          py::init([](int64_t period, int64_t warmup_steps, const py::object& group,
                      int64_t bucket_cap_bytes) {
            return with_py_warnings([&] {
              return py_owned(new PeriodicModelAverager(period, warmup_steps, optional_group(group),
                                                        options_from_bytes(bucket_cap_bytes)));
            });
          }),
          py::arg("period"), py::arg("warmup_steps"), py::arg("process_group"),
          py::arg("bucket_cap_bytes") = comm::kDefaultBucketBytes)
      .def_property("period", &PeriodicModelAverager::period, &PeriodicModelAverager::set_period)
      .def_property("warmup_steps", &PeriodicModelAverager::warmup_steps,
                    &PeriodicModelAverager::set_warmup_steps);

  py::class_<HierarchicalModelAverager, ModelAverager, std::shared_ptr<HierarchicalModelAverager>>(
      m, "HierarchicalModelAverager", "Native HierarchicalModelAverager.")
      .def(py::init([](const std::vector<std::pair<int64_t, py::object>>& levels,
                       int64_t warmup_steps, const ProcessGroupPtr& group,
                       int64_t bucket_cap_bytes) {
             std::vector<std::pair<int64_t, ProcessGroupPtr>> period_groups;
             for (const auto& level : levels) {
               period_groups.emplace_back(level.first, optional_group(level.second));
             }
             return with_py_warnings([&] {
               return py_owned(new HierarchicalModelAverager(std::move(period_groups), warmup_steps,
                                                             group,
                                                             options_from_bytes(bucket_cap_bytes)));
             });
           }),
           py::arg("period_groups"), py::arg("warmup_steps"), py::arg("process_group"),
           py::arg("bucket_cap_bytes") = comm::kDefaultBucketBytes)
      .def_property("warmup_steps", &HierarchicalModelAverager::warmup_steps,
                    &HierarchicalModelAverager::set_warmup_steps)
      .def("group_index_for_step", &HierarchicalModelAverager::group_index_for_step,
           py::arg("step"));
}

}  // namespace python
}  // namespace ddpx
