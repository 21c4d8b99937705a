// Bindings of the ZeRO engine (ddpx/optim/zero.h): the partition, ZeroShards (bucket views, the
// parameter exchange, the fused SGD/Adam steps, the state gather). ddpx/optim.py's
// ZeroRedundancyOptimizer is the Python class over it.
#include <ddpx/optim/zero.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <tuple>
#include <vector>

#include "bind_utils.h"

namespace ddpx {
namespace python {
namespace {

py::dict stats_dict(const optim::ZeroExchangeStats& s) {
  py::dict d;
  d["rounds"] = s.rounds;
  d["broadcasts"] = s.broadcasts;
  d["inplace_broadcasts"] = s.inplace_broadcasts;
  d["staged_bytes"] = s.staged_bytes;
  return d;
}

std::vector<int64_t> index_list(const py::handle& obj) { return obj.cast<std::vector<int64_t>>(); }

// (params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, maximize)
optim::ZeroSGDGroup sgd_group(const py::handle& obj) {
  const auto t = py::reinterpret_borrow<py::sequence>(obj);
  if (t.size() != 9) throw py::value_error("step_sgd: a group is a 9-tuple");
  optim::ZeroSGDGroup g;
  g.params = index_list(t[0]);
  g.grads = tensor_list(t[1], "grads");
  g.momentum_buffers = tensor_list(t[2], "momentum_buffers");
  g.options.lr = t[3].cast<double>();
  g.options.momentum = t[4].cast<double>();
  g.options.dampening = t[5].cast<double>();
  g.options.weight_decay = t[6].cast<double>();
  g.options.nesterov = t[7].cast<bool>();
  g.options.maximize = t[8].cast<bool>();
  return g;
}

// (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
//  weight_decay, amsgrad, maximize, decoupled_weight_decay)
optim::ZeroAdamGroup adam_group(const py::handle& obj) {
  const auto t = py::reinterpret_borrow<py::sequence>(obj);
  if (t.size() != 14) throw py::value_error("step_adam: a group is a 14-tuple");
  optim::ZeroAdamGroup g;
  g.params = index_list(t[0]);
  g.grads = tensor_list(t[1], "grads");
  g.exp_avgs = tensor_list(t[2], "exp_avgs");
  g.exp_avg_sqs = tensor_list(t[3], "exp_avg_sqs");
  g.max_exp_avg_sqs = tensor_list(t[4], "max_exp_avg_sqs");
  g.steps = tensor_list(t[5], "steps");
  g.options.lr = t[6].cast<double>();
  g.options.beta1 = t[7].cast<double>();
  g.options.beta2 = t[8].cast<double>();
  g.options.eps = t[9].cast<double>();
  g.options.weight_decay = t[10].cast<double>();
  g.options.amsgrad = t[11].cast<bool>();
  g.options.maximize = t[12].cast<bool>();
  g.decoupled_weight_decay = t[13].cast<bool>();
  return g;
}

}  // namespace

void bind_zero(py::module& m) {
  m.def("zero_partition", &optim::partition_sorted_greedy, py::arg("numels"), py::arg("world_size"),
        "torch's ZeRO partition: numels[g][i] -> the owning rank of group g's parameter i "
        "(largest first, each to the least-loaded rank; totals carried across groups).");

  m.def(
      "zero_partition_balanced",
      [](const std::vector<int64_t>& numels, const std::vector<bool>& splittable,
         int64_t world_size, int64_t align) {
        std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t>>> out;
        for (const auto& pieces :
             optim::partition_balanced(numels, splittable, world_size, align)) {
          std::vector<std::tuple<int64_t, int64_t, int64_t>> row;
          for (const auto& p : pieces) row.emplace_back(p.begin, p.end, p.owner);
          out.push_back(std::move(row));
        }
        return out;
      },
      py::arg("numels"), py::arg("splittable"), py::arg("world_size"), py::arg("align") = 32,
      "ddpx's balanced ZeRO partition: per parameter (in order), its pieces as (begin, end, "
      "owner) over its flattened elements; each rank holds an even share of the elements.");

  py::class_<optim::ZeroShards, std::shared_ptr<optim::ZeroShards>>(
      m, "ZeroShards", "ZeRO's engine: partition layout, bucket views, parameter exchange.")
      .def(py::init([](const py::object& params, std::vector<int64_t> owners,
                       std::vector<bool> trainable, const py::object& process_group,
                       bool parameters_as_bucket_view, int64_t bucket_cap_bytes) {
             optim::ZeroOptions o;
             o.parameters_as_bucket_view = parameters_as_bucket_view;
             o.bucket_cap_bytes = bucket_cap_bytes;
             auto p = tensor_list(params, "params");
             ProcessGroupPtr pg = optional_group(process_group);
             return py_owned(new optim::ZeroShards(std::move(p), std::move(owners),
                                                   std::move(trainable), std::move(pg), o));
           }),
           py::arg("params"), py::arg("owners"), py::arg("trainable"), py::arg("process_group"),
           py::kw_only(), py::arg("parameters_as_bucket_view") = false,
           py::arg("bucket_cap_bytes") = comm::kDefaultBucketBytes)
      .def_property_readonly("rank", &optim::ZeroShards::rank)
      .def_property_readonly("world_size", &optim::ZeroShards::world_size)
      .def_property_readonly("owners", &optim::ZeroShards::owners)
      .def_property_readonly("buckets", &optim::ZeroShards::buckets)
      .def("rebuild", &optim::ZeroShards::rebuild, py::arg("trainable"),
           "Re-plans the exchange (and rebuilds bucket views) for a new trainability mask.")
      .def(
          "exchange",
          [](optim::ZeroShards& self, const c10::optional<std::vector<int64_t>>& subset) {
            optim::ZeroExchangeStats s;
            {
              py::gil_scoped_release no_gil;
              s = subset ? self.exchange(nullptr, *subset) : self.exchange();
            }
            return stats_dict(s);
          },
          py::arg("subset") = py::none(),
          "Every parameter (or those of `subset`, indices) takes its owner's values (blocking; "
          "every rank calls it with the same subset).")
      .def(
          "step_sgd",
          [](optim::ZeroShards& self, const py::list& groups,
             const c10::optional<std::vector<int64_t>>& subset) {
            std::vector<optim::ZeroSGDGroup> gs;
            for (const py::handle& g : groups) gs.push_back(sgd_group(g));
            if (!optim::fused_step_supported(self, gs)) return py::object(py::none());
            optim::ZeroExchangeStats s;
            {
              py::gil_scoped_release no_gil;
              s = optim::step_sgd(self, gs, subset ? &*subset : nullptr);
            }
            py::list bufs;
            for (const auto& g : gs) bufs.append(to_py(g.momentum_buffers));
            return py::object(py::make_tuple(bufs, stats_dict(s)));
          },
          py::arg("groups"), py::arg("subset") = py::none(),
          "Fused SGD step of this rank's shard and exchange. groups: (param indices, grads, "
          "momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, maximize) tuples. "
          "Returns (momentum buffers per group, stats), or None, having done nothing, where the "
          "kernels "
          "do not take these tensors (then: the optimizer's own step and exchange()).")
      .def(
          "step_adam",
          [](optim::ZeroShards& self, const py::list& groups,
             const c10::optional<std::vector<int64_t>>& subset) {
            std::vector<optim::ZeroAdamGroup> gs;
            for (const py::handle& g : groups) gs.push_back(adam_group(g));
            if (!optim::fused_step_supported(self, gs)) return py::object(py::none());
            optim::ZeroExchangeStats s;
            {
              py::gil_scoped_release no_gil;
              s = optim::step_adam(self, gs, subset ? &*subset : nullptr);
            }
            return py::object(stats_dict(s));
          },
          py::arg("groups"), py::arg("subset") = py::none(),
          "Fused Adam/AdamW step of this rank's shard and exchange; state tensors (created "
          "beforehand) are updated in place. groups: (param indices, grads, exp_avgs, "
          "exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, amsgrad, "
          "maximize, decoupled_weight_decay) tuples. Returns the stats, or None as step_sgd.")
      .def(
          "gather",
          [](const optim::ZeroShards& self, int64_t to, const py::object& tensors,
             const c10::Device& device) {
            const auto t = tensor_list(tensors, "tensors");
            std::vector<std::vector<at::Tensor>> out;
            {
              py::gil_scoped_release no_gil;
              out = self.gather(to, t, device);
            }
            return out;
          },
          py::arg("to"), py::arg("tensors"), py::arg("device"),
          "Gathers every rank's tensors to group rank `to` in bulk (one buffer per sending "
          "rank). On `to`: a list per rank; elsewhere [].");
}

}  // namespace python
}  // namespace ddpx
