// pybind11 bindings: the module ddpx._C. Thin by design: argument names, docstrings, GIL
// handling and type conversion only; every behaviour lives in the C++ library.
#include <pybind11/pybind11.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <ddpx/common/compat.h>
#include <ddpx/compression/cast.h>
#include <ddpx/compression/kernels.h>
#include <ddpx/compression/powersgd_ops.h>
#include <ddpx/hooks.h>

#include "bind_utils.h"

namespace py = pybind11;
using ddpx::python::py_owned;
using ddpx::python::state_to_ivalue;
using ddpx::hooks::CommHook;
using ddpx::hooks::CommHookPtr;
using ddpx::hooks::ExchangeMode;
using PG = c10::intrusive_ptr<c10d::ProcessGroup>;

namespace ddpx {
namespace python {

c10::IValue state_to_ivalue(const py::handle& obj) {
  if (py::isinstance<py::bool_>(obj)) return c10::IValue(obj.cast<bool>());
  if (py::isinstance<py::int_>(obj)) return c10::IValue(obj.cast<int64_t>());
  if (py::isinstance<py::float_>(obj)) return c10::IValue(obj.cast<double>());
  if (py::isinstance<py::str>(obj)) return c10::IValue(obj.cast<std::string>());
  if (THPVariable_Check(obj.ptr())) return c10::IValue(THPVariable_Unpack(obj.ptr()));
  if (py::isinstance<py::dict>(obj)) {
    c10::impl::GenericDict d(c10::AnyType::get(), c10::AnyType::get());
    for (const auto& kv : obj.cast<py::dict>()) {
      d.insert(state_to_ivalue(kv.first), state_to_ivalue(kv.second));
    }
    return c10::IValue(d);
  }
  TORCH_CHECK_TYPE(false, "load_state_dict: unsupported value of type ",
                   py::str(py::type::of(obj)).cast<std::string>());
}

}  // namespace python
}  // namespace ddpx

namespace {

// torch.dtype -> at::ScalarType, with an error naming the argument.
at::ScalarType to_dtype(const py::handle& obj, const char* arg) {
  TORCH_CHECK_TYPE(THPDtype_Check(obj.ptr()), arg, " must be a torch.dtype, got ",
                   py::str(py::type::of(obj)).cast<std::string>());
  return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
}

// Runs a hook on a bucket handed over by DDP's Python path and returns a torch.futures.Future.
std::shared_ptr<torch::jit::PythonFutureWrapper> run_hook(const CommHookPtr& hook,
                                                          c10d::GradBucket& bucket) {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    py::gil_scoped_release no_gil;
    fut = hook->runHook(bucket);
  }
  return std::make_shared<torch::jit::PythonFutureWrapper>(std::move(fut));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddpx native core: DDP communication hooks as C++ c10d::CommHookInterface objects.";
  m.attr("__torch_version__") = ddpx::compat::torch_version();
#ifdef DDPX_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif

  py::enum_<ExchangeMode>(m, "ExchangeMode", "How 16-bit values travel between ranks.")
      .value("AUTO", ExchangeMode::kAuto)
      .value("ALLREDUCE", ExchangeMode::kAllreduce)
      .value("ALLGATHER", ExchangeMode::kAllgather);

  py::class_<CommHook, CommHookPtr>(m, "CommHook",
                                    "A native ddpx communication hook (c10d::CommHookInterface).")
      .def_property_readonly("name", &CommHook::name, "The hook's name, as in torch.")
      .def("run", &run_hook, py::arg("bucket"),
           "Runs the hook on a dist.GradBucket; returns a torch.futures.Future whose value is "
           "the averaged gradient tensor.")
      .def("__repr__",
           [](const CommHook& h) { return "<ddpx._C.CommHook " + h.name() + ">"; });

  m.def(
      "allreduce_hook",
      [](const PG& pg, ExchangeMode exchange) -> CommHookPtr {
        return py_owned<CommHook>(new ddpx::hooks::AllreduceHook(pg, exchange));
      },
      py::arg("process_group"), py::arg("exchange") = ExchangeMode::kAuto,
      "Native allreduce_hook over `process_group`.");
  m.def(
      "compress_hook",
      [](const PG& pg, const py::object& dtype, ExchangeMode exchange) -> CommHookPtr {
        return py_owned<CommHook>(
            new ddpx::hooks::CompressHook(pg, to_dtype(dtype, "dtype"), exchange));
      },
      py::arg("process_group"), py::arg("dtype"), py::arg("exchange") = ExchangeMode::kAuto,
      "Native fp16/bf16_compress_hook over `process_group` (dtype torch.float16/bfloat16).");
  m.def(
      "compress_wrapper",
      [](const CommHookPtr& hook, const py::object& dtype) -> CommHookPtr {
        return py_owned<CommHook>(new ddpx::hooks::CompressWrapper(hook, to_dtype(dtype, "dtype")));
      },
      py::arg("hook"), py::arg("dtype"), "Native fp16/bf16_compress_wrapper around `hook`.");
  m.def("noop_hook", &ddpx::hooks::noop_hook, "Native noop_hook.");

  using ddpx::hooks::PowerSGDOptions;
  using ddpx::hooks::PowerSGDState;
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

  py::class_<PowerSGDState, std::shared_ptr<PowerSGDState>>(
      m, "PowerSGDState", "Native PowerSGD state (see ddpx.hooks.PowerSGDState).")
      .def(py::init([](const PG& pg, const PowerSGDOptions& options,
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
      .def("state_dict",
           [](const PowerSGDState& st) { return torch::jit::toPyObject(c10::IValue(st.state_dict())); })
      .def(
          "load_state_dict",
          [](PowerSGDState& st, const py::object& d) {
            TORCH_CHECK_TYPE(py::isinstance<py::dict>(d),
                             "load_state_dict: state_dict must be a dict, got ",
                             py::str(py::type::of(d)).cast<std::string>());
            c10::IValue v = state_to_ivalue(d);
            st.load_state_dict(v.toGenericDict());
          },
          py::arg("state_dict"))
      .def("error_dict",
           [](const PowerSGDState& st) {
             std::map<int64_t, at::Tensor> out(st.error_memory.begin(), st.error_memory.end());
             for (const auto& kv : st.restored_error) out.emplace(kv.first, kv.second);
             return out;
           },
           "Per-parameter error-feedback residuals, keyed by parameter order of first appearance.")
      .def("q_memory_dict",
           [](const PowerSGDState& st) {
             std::map<int64_t, at::Tensor> out(st.q_memory.begin(), st.q_memory.end());
             for (const auto& kv : st.restored_q) out.emplace(kv.first, kv.second);
             return out;
           },
           "Per-parameter warm-start Q factors, keyed like error_dict().");

  m.def(
      "powersgd_hook",
      [](const std::shared_ptr<PowerSGDState>& state, bool batched) -> CommHookPtr {
        return py_owned<CommHook>(new ddpx::hooks::PowerSGDHook(state, batched));
      },
      py::arg("state"), py::arg("batched") = false,
      "Native powerSGD_hook (batched=False) or batched_powerSGD_hook (batched=True).");

  m.def(
      "register_comm_hook",
      [](const std::shared_ptr<c10d::Reducer>& reducer, const CommHookPtr& hook) {
        TORCH_CHECK(reducer, "register_comm_hook: the DDP model has no reducer");
        TORCH_CHECK(hook, "register_comm_hook: hook must not be None");
        reducer->register_comm_hook(std::make_unique<ddpx::hooks::SharedCommHook>(hook));
      },
      py::arg("reducer"), py::arg("hook"),
      "Installs `hook` directly in DDP's C++ Reducer: no Python runs per bucket.");

  m.def(
      "backend_name", [](const PG& pg) { return ddpx::compat::backend_name(*pg); },
      py::arg("process_group"), "The backend name of a process group.");

  m.def(
      "scaled_cast",
      [](const at::Tensor& src, const py::object& dtype, double scale) {
        const at::ScalarType st = to_dtype(dtype, "dtype");
        py::gil_scoped_release no_gil;
        return ddpx::scaled_cast(src, st, scale);
      },
      py::arg("src"), py::arg("dtype"), py::arg("scale") = 1.0,
      "Returns (src * scale) cast to dtype, flattened (the compression kernel).");
  m.def(
      "sum_rows",
      [](const at::Tensor& src, const py::object& dtype, double scale) {
        const at::ScalarType st = to_dtype(dtype, "dtype");
        py::gil_scoped_release no_gil;
        TORCH_CHECK(src.dim() == 2, "sum_rows: src must be 2-D, got ", src.dim(), " dims");
        at::Tensor out = at::empty({src.size(1)}, src.options().dtype(st));
        ddpx::sum_rows_into(src.contiguous(), out, scale);
        return out;
      },
      py::arg("src"), py::arg("dtype"), py::arg("scale") = 1.0,
      "Returns scale * src.sum(0) in dtype, accumulated in fp32 (the decompression kernel).");
  m.def(
      "orthogonalize_",
      [](const at::Tensor& flat, const std::vector<int64_t>& rows, const std::vector<int64_t>& cols,
         double epsilon) {
        py::gil_scoped_release no_gil;
        ddpx::orthogonalize_(flat, ddpx::MatrixPack::back_to_back(rows, cols, flat.device()),
                             epsilon);
      },
      py::arg("flat"), py::arg("rows"), py::arg("cols"), py::arg("epsilon") = 0.0,
      "Orthonormalises in place the columns of the row-major rows[k] x cols[k] matrices stored back "
      "to back in `flat` (PowerSGD's batched Gram-Schmidt kernel; CPU or CUDA).");
  ddpx::python::bind_post_local_sgd(m);

  m.def("cpu_has_fast_half", &ddpx::kernels::cpu_has_fast_half,
        "True when the CPU kernels use F16C.");
}
