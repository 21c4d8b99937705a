// Bindings of the quantized hook: QuantizedState, quantized_hook, and its kernels (for tests and
// benchmarks). The Python class ddpx.hooks.QuantizedState wraps the state.
#include <ATen/ATen.h>
#include <ddpx/hooks/quantized_hook.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>
#include <tuple>

#include "bind_utils.h"
#include "ops/quantized.h"

namespace ddpx {
namespace python {
namespace {

// The contiguous table of n values in blocks of `block` on `device`, made once: built per call,
// its upload to a device was a synchronous copy from pageable memory, timed into the kernels'
// figures. A few recent tables are kept (benchmarks and tests use a handful of shapes); the
// caller holds the GIL, which serialises access.
const ops::BlockTable& contiguous_table(int64_t n, int64_t block, uint64_t draw_base,
                                        const c10::Device& device) {
  using Key = std::tuple<int64_t, int64_t, uint64_t, std::string>;
  // Never destroyed: device tables must not be freed after the CUDA runtime at exit.
  static auto& tables = *new std::map<Key, ops::BlockTable>();
  const Key key{n, block, draw_base, device.str()};
  auto it = tables.find(key);
  if (it == tables.end()) {
    if (tables.size() >= 16) tables.clear();
    ops::BlockTable table = ops::BlockTable::contiguous(n, block, draw_base);
    table.to(device);
    it = tables.emplace(key, std::move(table)).first;
  }
  return it->second;
}

}  // namespace

void bind_quantized(py::module& m) {
  using hooks::QuantizedOptions;
  using hooks::QuantizedState;
  py::class_<QuantizedOptions>(m, "QuantizedOptions", "The hyperparameters of QuantizedState.")
      .def(py::init<>())
      .def_readwrite("bits", &QuantizedOptions::bits)
      .def_readwrite("block_size", &QuantizedOptions::block_size)
      .def_readwrite("use_error_feedback", &QuantizedOptions::use_error_feedback)
      .def_readwrite("start_iter", &QuantizedOptions::start_iter)
      .def_readwrite("random_seed", &QuantizedOptions::random_seed)
      .def_readwrite("stochastic_rounding", &QuantizedOptions::stochastic_rounding)
      .def_property(
          "exchange",
          [](const QuantizedOptions& o) {
            return std::string(comm::exchange_mode_name(o.exchange));
          },
          [](QuantizedOptions& o, const std::string& name) {
            o.exchange = hooks::parse_quantized_exchange(name);
          },
          "'auto' (all-gather on 2 ranks, reduce-scatter on more), 'allgather' or "
          "'reduce_scatter'.")
      .def_property(
          "rotation",
          [](const QuantizedOptions& o) {
            return std::string(hooks::quantized_rotation_name(o.rotation));
          },
          [](QuantizedOptions& o, const std::string& name) {
            o.rotation = hooks::parse_quantized_rotation(name);
          },
          "'auto' (Hadamard without error feedback), 'hadamard' or 'none'.")
      .def(
          "validate", [](const QuantizedOptions& o) { hooks::validate(o); },
          "Raises ValueError naming a bad option.");

  py::class_<QuantizedState, std::shared_ptr<QuantizedState>> state(
      m, "QuantizedState", "Native quantized-hook state (see ddpx.hooks.QuantizedState).");
  state
      .def(py::init([](const ProcessGroupPtr& pg, const QuantizedOptions& options) {
             return py_owned(new QuantizedState(pg, options));
           }),
           py::arg("process_group"), py::arg("options"))
      .def_property_readonly("options", &QuantizedState::options)
      .def("set_options", &QuantizedState::set_options, py::arg("options"))
      .def_property("process_group", &QuantizedState::process_group,
                    &QuantizedState::set_process_group)
      .def_property("iter", &QuantizedState::iter, &QuantizedState::set_iter)
      .def("maybe_increase_iter", &QuantizedState::maybe_increase_iter, py::arg("bucket_is_last"))
      .def("worker_residuals", &QuantizedState::worker_residuals,
           "Per-parameter rank-level residuals (copies), keyed by order of first appearance.")
      .def("server_residuals", &QuantizedState::server_residuals,
           "Per-parameter owner-level residuals (copies; zero outside the owned values).")
      .def("clear_memories", &QuantizedState::clear_memories, "Forgets every residual.")
      .def("compression_stats", &QuantizedState::compression_stats,
           "(bytes before / bytes after, bytes before, bytes after) of the buckets compressed "
           "so far.")
      .def_property_readonly("epoch", &QuantizedState::epoch,
                             "Changes every rank must make alike (the hook checks agreement "
                             "again after one).");
  def_state_dict(state, /*bind_load=*/false);
  state.def(
      "load_state_dict",
      [](QuantizedState& st, const py::object& d, bool allow_reshard) {
        st.load_state_dict(state_dict_arg(d), allow_reshard);
      },
      py::arg("state_dict"), py::arg("allow_reshard") = false,
      "Restores state_dict()'s content; allow_reshard: accept residuals saved by another rank "
      "or world size (refused otherwise).");

  m.def(
      "quantized_hook",
      [](const std::shared_ptr<QuantizedState>& st) -> hooks::CommHookPtr {
        return py_owned<hooks::CommHook>(new hooks::QuantizedHook(st));
      },
      py::arg("state"), "Native quantized_hook over `state`.");

  // The kernels, one message at a time (tests and benchmarks).
  // Messages of n contiguous values, cut into blocks of `block` (the hook's tables come from its
  // layouts; here the simplest one).
  m.def(
      "quantized_message_bytes",
      [](int64_t n, int bits, int64_t block) {
        return ops::quantized_message_bytes((n + block - 1) / block, bits, block);
      },
      py::arg("n"), py::arg("bits"), py::arg("block"));
  m.def(
      "quantize_ef_",
      [](const at::Tensor& x, const c10::optional<at::Tensor>& residual, int bits, int64_t block,
         bool stochastic, int64_t seed, int64_t stream, int64_t draw_base,
         const c10::optional<at::Tensor>& out, bool fitted_ternary, bool rotate,
         bool unbiased_sign) {
        kernels::QuantSpec spec;
        spec.fitted_ternary = fitted_ternary;
        spec.rotate = rotate;
        spec.unbiased_sign = unbiased_sign;
        spec.bits = bits;
        spec.block = block;
        spec.stochastic = stochastic;
        spec.seed = static_cast<uint64_t>(seed);
        spec.stream = static_cast<uint64_t>(stream);
        const ops::BlockTable& table =
            contiguous_table(x.numel(), block, static_cast<uint64_t>(draw_base), x.device());
        // `out`: a message to reuse (quantize_ef_into checks its size), so that a benchmark
        // times the kernel and not an allocation.
        at::Tensor message =
            out.has_value() ? *out
                            : at::zeros({ops::quantized_message_bytes(table.size(), bits, block)},
                                        x.options().dtype(at::kByte));
        ops::quantize_ef_into(x, residual.value_or(at::Tensor()), table, spec, message);
        return message;
      },
      py::arg("x"), py::arg("residual"), py::arg("bits"), py::arg("block"),
      py::arg("stochastic") = false, py::arg("seed") = 0, py::arg("stream") = 0,
      py::arg("draw_base") = 0, py::arg("out") = py::none(), py::arg("fitted_ternary") = false,
      py::arg("rotate") = false, py::arg("unbiased_sign") = false,
      "The message of x (plus residual, which receives the new residual when given).");
  // A message quantized with rotate=True, (seed, stream): how to rotate it back.
  const auto unrotate_of = [](bool rotate, int64_t seed, int64_t stream, int64_t stream_step) {
    kernels::Unrotate u;
    u.on = rotate;
    u.seed = static_cast<uint64_t>(seed);
    u.stream0 = static_cast<uint64_t>(stream);
    u.stream_step = static_cast<uint64_t>(stream_step);
    return u;
  };
  m.def(
      "dequantize_",
      [unrotate_of](const at::Tensor& message, int bits, int64_t block, const at::Tensor& out,
                    bool rotate, int64_t seed, int64_t stream) {
        const ops::BlockTable& table = contiguous_table(out.numel(), block, 0, out.device());
        ops::dequantize_into(message, table, bits, block, out,
                             unrotate_of(rotate, seed, stream, 0));
        return out;
      },
      py::arg("message"), py::arg("bits"), py::arg("block"), py::arg("out"),
      py::arg("rotate") = false, py::arg("seed") = 0, py::arg("stream") = 0);
  m.def(
      "dequantize_sum_",
      [unrotate_of](const at::Tensor& messages, int bits, int64_t block, double post_scale,
                    const at::Tensor& out, bool rotate, int64_t seed, int64_t stream,
                    int64_t stream_step) {
        const ops::BlockTable& table = contiguous_table(out.numel(), block, 0, out.device());
        ops::dequantize_sum_into(messages, table, bits, block, static_cast<float>(post_scale), out,
                                 ops::ExactValues(),
                                 unrotate_of(rotate, seed, stream, stream_step));
        return out;
      },
      py::arg("messages"), py::arg("bits"), py::arg("block"), py::arg("post_scale"), py::arg("out"),
      py::arg("rotate") = false, py::arg("seed") = 0, py::arg("stream") = 0,
      py::arg("stream_step") = 1);
}

}  // namespace python
}  // namespace ddpx
