#include "bind_utils.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

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

c10::impl::GenericDict state_dict_arg(const py::object& d) {
  TORCH_CHECK_TYPE(py::isinstance<py::dict>(d), "load_state_dict: state_dict must be a dict, got ",
                   py::str(py::type::of(d)).cast<std::string>());
  return state_to_ivalue(d).toGenericDict();
}

at::ScalarType to_dtype(const py::handle& obj, const char* arg) {
  TORCH_CHECK_TYPE(THPDtype_Check(obj.ptr()), arg, " must be a torch.dtype, got ",
                   py::str(py::type::of(obj)).cast<std::string>());
  return reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type;
}

ProcessGroupPtr optional_group(const py::object& obj) {
  return obj.is_none() ? ProcessGroupPtr() : obj.cast<ProcessGroupPtr>();
}

py::object group_or_none(const ProcessGroupPtr& pg) { return pg ? py::cast(pg) : py::none(); }

}  // namespace python
}  // namespace ddpx
