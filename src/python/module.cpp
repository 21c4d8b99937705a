// pybind11 bindings: the module ddpx._C. Thin by design: argument names, docstrings, GIL
// handling and type conversion only; every behaviour lives in the C++ library.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <ddpx/common/compat.h>
#include <ddpx/compression/cast.h>
#include <ddpx/compression/kernels.h>
#include <ddpx/hooks.h>

namespace py = pybind11;
using ddpx::hooks::CommHook;
using ddpx::hooks::CommHookPtr;
using ddpx::hooks::ExchangeMode;
using PG = c10::intrusive_ptr<c10d::ProcessGroup>;

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
        return std::make_shared<ddpx::hooks::AllreduceHook>(pg, exchange);
      },
      py::arg("process_group"), py::arg("exchange") = ExchangeMode::kAuto,
      "Native allreduce_hook over `process_group`.");
  m.def(
      "compress_hook",
      [](const PG& pg, const py::object& dtype, ExchangeMode exchange) -> CommHookPtr {
        return std::make_shared<ddpx::hooks::CompressHook>(pg, to_dtype(dtype, "dtype"), exchange);
      },
      py::arg("process_group"), py::arg("dtype"), py::arg("exchange") = ExchangeMode::kAuto,
      "Native fp16/bf16_compress_hook over `process_group` (dtype torch.float16/bfloat16).");
  m.def(
      "compress_wrapper",
      [](const CommHookPtr& hook, const py::object& dtype) -> CommHookPtr {
        return std::make_shared<ddpx::hooks::CompressWrapper>(hook, to_dtype(dtype, "dtype"));
      },
      py::arg("hook"), py::arg("dtype"), "Native fp16/bf16_compress_wrapper around `hook`.");
  m.def("noop_hook", &ddpx::hooks::noop_hook, "Native noop_hook.");

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
        return ddpx::scaled_cast(src.contiguous(), st, scale);
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
  m.def("cpu_has_fast_half", &ddpx::kernels::cpu_has_fast_half,
        "True when the CPU kernels use F16C.");
}
