// Bindings of the default hooks, the CommHook base and native registration on DDP's Reducer.
// The Python functions in ddpx/hooks/default_hooks.py and the machinery in ddpx/_native.py
// wrap them.
#include <ddpx/common/compat.h>
#include <ddpx/hooks/allreduce_hook.h>
#include <ddpx/hooks/comm_hook.h>
#include <ddpx/hooks/compress_hook.h>
#include <ddpx/hooks/compress_wrapper.h>
#include <ddpx/hooks/noop_hook.h>
#include <ddpx/hooks/quantization_hook.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "bind_utils.h"

namespace ddpx {
namespace python {
namespace {

using comm::ExchangeMode;
using hooks::CommHook;
using hooks::CommHookPtr;

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

void bind_hooks(py::module& m) {
  py::enum_<ExchangeMode>(m, "ExchangeMode", "How 16-bit values travel between ranks.")
      .value("AUTO", ExchangeMode::kAuto)
      .value("ALLREDUCE", ExchangeMode::kAllreduce)
      .value("ALLGATHER", ExchangeMode::kAllgather)
      .value("REDUCE_SCATTER", ExchangeMode::kReduceScatter);

  py::class_<CommHook, CommHookPtr>(m, "CommHook",
                                    "A native ddpx communication hook (c10d::CommHookInterface).")
      .def_property_readonly("name", &CommHook::name, "The hook's name, as in torch.")
      .def("run", &run_hook, py::arg("bucket"),
           "Runs the hook on a dist.GradBucket; returns a torch.futures.Future whose value is "
           "the averaged gradient tensor.")
      .def("__repr__", [](const CommHook& h) { return "<ddpx._C.CommHook " + h.name() + ">"; });

  m.def(
      "allreduce_hook",
      [](const ProcessGroupPtr& pg, ExchangeMode exchange) -> CommHookPtr {
        return py_owned<CommHook>(new hooks::AllreduceHook(pg, exchange));
      },
      py::arg("process_group"), py::arg("exchange") = ExchangeMode::kAuto,
      "Native allreduce_hook over `process_group`.");
  m.def(
      "compress_hook",
      [](const ProcessGroupPtr& pg, const py::object& dtype, ExchangeMode exchange) -> CommHookPtr {
        return py_owned<CommHook>(new hooks::CompressHook(pg, to_dtype(dtype, "dtype"), exchange));
      },
      py::arg("process_group"), py::arg("dtype"), py::arg("exchange") = ExchangeMode::kAuto,
      "Native fp16/bf16_compress_hook over `process_group` (dtype torch.float16/bfloat16).");
  m.def(
      "compress_wrapper",
      [](const CommHookPtr& hook, const py::object& dtype) -> CommHookPtr {
        return py_owned<CommHook>(new hooks::CompressWrapper(hook, to_dtype(dtype, "dtype")));
      },
      py::arg("hook"), py::arg("dtype"), "Native fp16/bf16_compress_wrapper around `hook`.");
  m.def("noop_hook", &hooks::noop_hook, "Native noop_hook.");
  m.def(
      "quantization_pertensor_hook",
      [](const ProcessGroupPtr& pg) -> CommHookPtr {
        return py_owned<CommHook>(new hooks::QuantizationHook(pg, 0));
      },
      py::arg("process_group"), "Native quantization_pertensor_hook over `process_group`.");
  m.def(
      "quantization_perchannel_hook",
      [](const ProcessGroupPtr& pg, int64_t bucket_size) -> CommHookPtr {
        TORCH_CHECK_VALUE(bucket_size >= 1,
                          "quantization_perchannel_hook: bucket_size must be >= 1, got ",
                          bucket_size);
        return py_owned<CommHook>(new hooks::QuantizationHook(pg, bucket_size));
      },
      py::arg("process_group"), py::arg("bucket_size") = 512,
      "Native quantization_perchannel_hook over `process_group`, channels of `bucket_size` "
      "values.");

  m.def(
      "register_comm_hook",
      [](const std::shared_ptr<c10d::Reducer>& reducer, const CommHookPtr& hook) {
        TORCH_CHECK(reducer, "register_comm_hook: the DDP model has no reducer");
        TORCH_CHECK(hook, "register_comm_hook: hook must not be None");
        reducer->register_comm_hook(std::make_unique<hooks::SharedCommHook>(hook));
      },
      py::arg("reducer"), py::arg("hook"),
      "Installs `hook` directly in DDP's C++ Reducer: no Python runs per bucket.");

  m.def(
      "backend_name", [](const ProcessGroupPtr& pg) { return compat::backend_name(*pg); },
      py::arg("process_group"), "The backend name of a process group.");
}

}  // namespace python
}  // namespace ddpx
