// Helpers shared by the binding units of ddpx._C (bind_*.cpp): ownership, argument conversion,
// warnings, and the checkpoint methods every native state binds the same way.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <ddpx/common/process_group.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <memory>
#include <string>
#include <vector>

namespace ddpx {
namespace python {

namespace py = pybind11;

// Objects handed to Python may hold the last reference to a ProcessGroup. Python drops them with
// the GIL held; ProcessGroupGloo's destructor then joins worker threads that may be waiting for
// the GIL to finish a future's Python callback: a deadlock. Deleting without the GIL avoids it.
template <typename T>
std::shared_ptr<T> py_owned(T* raw) {
  return std::shared_ptr<T>(raw, [](T* p) {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete p;
    } else {
      delete p;
    }
  });
}

// A checkpoint dict (str keys; int, float, bool, str, Tensor or nested dict values) as an IValue.
c10::IValue state_to_ivalue(const py::handle& obj);

// torch.dtype -> at::ScalarType, with a TypeError naming the argument.
at::ScalarType to_dtype(const py::handle& obj, const char* arg);

// None -> null (no group / not a member); a ProcessGroup otherwise.
ProcessGroupPtr optional_group(const py::object& obj);
py::object group_or_none(const ProcessGroupPtr& pg);

// A sequence of tensors or None (None: an undefined tensor), with a TypeError naming `arg`.
std::vector<at::Tensor> tensor_list(const py::handle& seq, const char* arg);
// The reverse: undefined tensors become None.
py::list to_py(const std::vector<at::Tensor>& tensors);

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

// A checkpoint dict from Python as the GenericDict the C++ states load (TypeError otherwise).
c10::impl::GenericDict state_dict_arg(const py::object& d);

// Binds state_dict() -> dict and load_state_dict(dict) for a native state whose C++ class has
// `c10::impl::GenericDict state_dict() const` and `void load_state_dict(const GenericDict&)`.
// A state whose load_state_dict takes a `strict` flag binds its own load_state_dict instead
// (with state_dict_arg).
template <typename State, typename... Options>
void def_state_dict(py::class_<State, Options...>& cls, bool bind_load = true) {
  cls.def(
      "state_dict",
      [](const State& s) { return torch::jit::toPyObject(c10::IValue(s.state_dict())); },
      "The state to checkpoint, as a dict (no process groups).");
  if (!bind_load) return;
  cls.def(
      "load_state_dict",
      [](State& s, const py::object& d) { s.load_state_dict(state_dict_arg(d)); },
      py::arg("state_dict"), "Restores state_dict()'s content.");
}

// The binding units, one per area; module.cpp calls them in this order.
void bind_hooks(py::module& m);
void bind_powersgd(py::module& m);
void bind_post_localsgd(py::module& m);
void bind_quantized(py::module& m);
void bind_averaging(py::module& m);
void bind_kernels(py::module& m);
void bind_functional_optim(py::module& m);
void bind_zero(py::module& m);
void bind_rpc_optim(py::module& m);
void bind_diloco(py::module& m);

}  // namespace python
}  // namespace ddpx
