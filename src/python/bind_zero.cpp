// Bindings of the ZeRO engine (ddpx/optim/zero.h): the partition, ZeroShards (bucket views, the
// parameter exchange, the fused SGD/Adam steps over ZeroSGDGroup / ZeroAdamGroup, the state
// gather). ddpx/optim/zero_redundancy_optimizer.py's ZeroRedundancyOptimizer is the Python class
// over it.
#include <ddpx/hooks/zero_reduce_scatter_hook.h>
#include <ddpx/optim/zero.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <tuple>
#include <utility>
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

// The groups of a fused step: step_sgd / step_adam update the state lists of the Python objects
// in place (a state created on this step appears there).
template <typename G>
std::vector<G> groups_arg(const py::list& groups) {
  std::vector<G> out;
  for (const py::handle& g : groups) out.push_back(g.cast<G>());
  return out;
}

// A tensor-list field bound as a property: None for an undefined tensor, both ways.
template <typename G>
void def_tensors(py::class_<G>& cls, const char* name, std::vector<at::Tensor> G::*field) {
  cls.def_property(
      name, [field](const G& g) { return to_py(g.*field); },
      [field, name](G& g, const py::object& v) { g.*field = tensor_list(v, name); });
}

}  // namespace

void bind_zero(py::module& m) {
  py::class_<optim::ZeroSGDGroup> sgd_group(
      m, "ZeroSGDGroup",
      "One parameter group of a fused ZeRO SGD step: the indices of the stepped parameters "
      "(into ZeroShards' params), their gradients, their momentum buffers (None before a "
      "parameter's first step) and the group's SGDOptions.");
  sgd_group
      .def(py::init([](std::vector<int64_t> params, const py::object& grads,
                       const py::object& momentum_buffers, optim::SGDOptions options) {
             optim::ZeroSGDGroup g;
             g.params = std::move(params);
             g.grads = tensor_list(grads, "grads");
             g.momentum_buffers = tensor_list(momentum_buffers, "momentum_buffers");
             g.options = options;
             return g;
           }),
           py::kw_only(), py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
           py::arg("options"))
      .def_readwrite("params", &optim::ZeroSGDGroup::params)
      .def_readwrite("options", &optim::ZeroSGDGroup::options);
  def_tensors(sgd_group, "grads", &optim::ZeroSGDGroup::grads);
  def_tensors(sgd_group, "momentum_buffers", &optim::ZeroSGDGroup::momentum_buffers);

  py::class_<optim::ZeroAdamGroup> adam_group(
      m, "ZeroAdamGroup",
      "One parameter group of a fused ZeRO Adam/AdamW step: the indices of the stepped "
      "parameters, their gradients, their state in torch's layout (created beforehand; "
      "max_exp_avg_sqs [] without amsgrad; steps 0-dim tensors) and the group's AdamOptions.");
  adam_group
      .def(py::init([](std::vector<int64_t> params, const py::object& grads,
                       const py::object& exp_avgs, const py::object& exp_avg_sqs,
                       const py::object& max_exp_avg_sqs, const py::object& steps,
                       optim::AdamOptions options) {
             optim::ZeroAdamGroup g;
             g.params = std::move(params);
             g.grads = tensor_list(grads, "grads");
             g.exp_avgs = tensor_list(exp_avgs, "exp_avgs");
             g.exp_avg_sqs = tensor_list(exp_avg_sqs, "exp_avg_sqs");
             g.max_exp_avg_sqs = tensor_list(max_exp_avg_sqs, "max_exp_avg_sqs");
             g.steps = tensor_list(steps, "steps");
             g.options = options;
             return g;
           }),
           py::kw_only(), py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
           py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("steps"), py::arg("options"))
      .def_readwrite("params", &optim::ZeroAdamGroup::params)
      .def_readwrite("options", &optim::ZeroAdamGroup::options);
  def_tensors(adam_group, "grads", &optim::ZeroAdamGroup::grads);
  def_tensors(adam_group, "exp_avgs", &optim::ZeroAdamGroup::exp_avgs);
  def_tensors(adam_group, "exp_avg_sqs", &optim::ZeroAdamGroup::exp_avg_sqs);
  def_tensors(adam_group, "max_exp_avg_sqs", &optim::ZeroAdamGroup::max_exp_avg_sqs);
  def_tensors(adam_group, "steps", &optim::ZeroAdamGroup::steps);

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

  py::class_<optim::ZeroLayout, std::shared_ptr<optim::ZeroLayout>>(
      m, "ZeroLayout",
      "ZeRO's partition (shared with the C++ ZeroRedundancyOptimizer): which rank steps which "
      "parameter or piece, the units each local optimizer holds, the gradient binding of split "
      "parameters.")
      .def(py::init([](int64_t world_size, int64_t rank, const std::string& partition, bool flatten,
                       int64_t align) {
             TORCH_CHECK_VALUE(partition == "sorted_greedy" || partition == "balanced",
                               "ZeroLayout: partition must be 'sorted_greedy' or 'balanced', "
                               "got '",
                               partition, "'");
             const auto kind = partition == "balanced" ? optim::ZeroPartition::kBalanced
                                                       : optim::ZeroPartition::kSortedGreedy;
             return py_owned(new optim::ZeroLayout(world_size, rank, kind, flatten, align));
           }),
           py::arg("world_size"), py::arg("rank"), py::arg("partition"), py::kw_only(),
           py::arg("flatten") = false, py::arg("align") = optim::kZeroBalancedAlign)
      .def(
          "add_group",
          [](optim::ZeroLayout& self, const py::object& params) {
            return self.add_group(tensor_list(params, "params"));
          },
          py::arg("params"), "Partitions a new parameter group; returns its index.")
      .def("assign", &optim::ZeroLayout::assign, py::arg("per_rank"),
           "torch's params_per_rank: rank r steps the (single) group's parameters per_rank[r].")
      .def_property_readonly("num_groups", &optim::ZeroLayout::num_groups)
      .def(
          "pieces",
          [](const optim::ZeroLayout& self, size_t index) {
            std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
            for (const auto& p : self.pieces(index)) out.emplace_back(p.begin, p.end, p.owner);
            return out;
          },
          py::arg("index"), "Parameter `index`'s pieces as (begin, end, owner).")
      .def_property_readonly("units", [](const optim::ZeroLayout& s) { return to_py(s.units()); })
      .def_property_readonly("unit_owners", &optim::ZeroLayout::unit_owners)
      .def_property_readonly("unit_params", &optim::ZeroLayout::unit_params)
      .def("local_units", &optim::ZeroLayout::local_units, py::arg("rank"),
           "Per group, the indices of the units `rank` steps, in its local optimizer's order.")
      .def_property_readonly("flat_buffers",
                             [](const optim::ZeroLayout& s) { return to_py(s.flat_buffers()); })
      .def("bind_piece_grads", &optim::ZeroLayout::bind_piece_grads,
           "This rank's pieces of split parameters take their gradients' slices; returns their "
           "unit indices.")
      .def("unbind_piece_grads", &optim::ZeroLayout::unbind_piece_grads);

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
            auto gs = groups_arg<optim::ZeroSGDGroup>(groups);
            if (!optim::fused_step_supported(self, gs)) return py::object(py::none());
            optim::ZeroExchangeStats s;
            {
              py::gil_scoped_release no_gil;
              s = optim::step_sgd(self, gs, subset ? &*subset : nullptr);
            }
            for (size_t i = 0; i < gs.size(); ++i) {
              groups[i].cast<optim::ZeroSGDGroup&>().momentum_buffers = gs[i].momentum_buffers;
            }
            return py::object(stats_dict(s));
          },
          py::arg("groups"), py::arg("subset") = py::none(),
          "Fused SGD step of this rank's shard and exchange. groups: ZeroSGDGroup, whose "
          "momentum_buffers take the buffers created on this step. Returns the stats, or None, "
          "having done nothing, where the kernels do not take these tensors (then: the "
          "optimizer's own step and exchange()).")
      .def(
          "step_adam",
          [](optim::ZeroShards& self, const py::list& groups,
             const c10::optional<std::vector<int64_t>>& subset) {
            auto gs = groups_arg<optim::ZeroAdamGroup>(groups);
            if (!optim::fused_step_supported(self, gs)) return py::object(py::none());
            optim::ZeroExchangeStats s;
            {
              py::gil_scoped_release no_gil;
              s = optim::step_adam(self, gs, subset ? &*subset : nullptr);
            }
            return py::object(stats_dict(s));
          },
          py::arg("groups"), py::arg("subset") = py::none(),
          "Fused Adam/AdamW step of this rank's shard and exchange. groups: ZeroAdamGroup, "
          "their state tensors (created beforehand) updated in place. Returns the stats, or None "
          "as step_sgd.")
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

  // ZeRO-2's gradient sharding hook (ddpx.hooks.reduce_scatter_hook wraps it).
  using hooks::ReduceScatterOptions;
  using hooks::ReduceScatterState;
  auto make_options = [](int64_t bits, int64_t block_size, bool use_error_feedback) {
    ReduceScatterOptions o;
    o.bits = bits;
    o.block_size = block_size;
    o.use_error_feedback = use_error_feedback;
    o.validate();
    return o;
  };
  py::class_<ReduceScatterState, std::shared_ptr<ReduceScatterState>>(
      m, "ReduceScatterState",
      "Native state of reduce_scatter_hook: ZeRO's partition, the options, the residuals.")
      .def(py::init([make_options](const ProcessGroupPtr& pg,
                                   const std::shared_ptr<optim::ZeroLayout>& layout, int64_t bits,
                                   int64_t block_size, bool use_error_feedback) {
             return py_owned(new ReduceScatterState(
                 pg, layout, make_options(bits, block_size, use_error_feedback)));
           }),
           py::arg("process_group"), py::arg("layout"), py::arg("bits"), py::arg("block_size"),
           py::arg("use_error_feedback"))
      .def_property_readonly("options",
                             [](const ReduceScatterState& s) {
                               const auto& o = s.options();
                               return std::make_tuple(o.bits, o.block_size, o.use_error_feedback);
                             })
      .def(
          "set_options",
          [make_options](ReduceScatterState& s, int64_t bits, int64_t block_size,
                         bool use_error_feedback) {
            s.set_options(make_options(bits, block_size, use_error_feedback));
          },
          py::arg("bits"), py::arg("block_size"), py::arg("use_error_feedback"))
      .def_property_readonly("sent_elements", &ReduceScatterState::sent_elements,
                             "Elements this rank sent to other ranks so far.")
      .def_property_readonly("sent_bytes", &ReduceScatterState::sent_bytes,
                             "Bytes of those messages.")
      .def_property_readonly("layouts_built", &ReduceScatterState::layouts_built,
                             "Bucket layouts built so far (one per bucket and bucketing).")
      .def("residuals", &ReduceScatterState::residuals,
           "The error-feedback residuals per parameter index (copies).")
      .def(
          "state_dict",
          [](const ReduceScatterState& s) {
            return torch::jit::toPyObject(c10::IValue(s.state_dict()));
          },
          "The options and this rank's residuals, as a dict.")
      .def(
          "load_state_dict",
          [](ReduceScatterState& s, const py::object& d, bool allow_reshard) {
            s.load_state_dict(state_dict_arg(d), allow_reshard);
          },
          py::arg("state_dict"), py::arg("allow_reshard") = false,
          "Restores state_dict()'s content (this rank's own residuals unless allow_reshard).");
  m.def(
      "reduce_scatter_hook",
      [](const std::shared_ptr<ReduceScatterState>& st) -> hooks::CommHookPtr {
        return py_owned<hooks::CommHook>(new hooks::ReduceScatterHook(st));
      },
      py::arg("state"), "Native reduce_scatter_hook over `state`.");
}

}  // namespace python
}  // namespace ddpx
