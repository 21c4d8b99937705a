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

std::vector<at::Tensor> tensor_list(const py::handle& seq, const char* arg) {
  if (!py::isinstance<py::sequence>(seq)) {
    throw py::type_error(std::string(arg) + " must be a list of tensors");
  }
  std::vector<at::Tensor> out;
  for (const py::handle& item : py::reinterpret_borrow<py::sequence>(seq)) {
    if (item.is_none()) {
      out.emplace_back();
    } else if (THPVariable_Check(item.ptr())) {
      out.push_back(THPVariable_Unpack(item.ptr()));
    } else {
      throw py::type_error(std::string(arg) + " must hold tensors or None, got " +
                           Py_TYPE(item.ptr())->tp_name);
    }
  }
  return out;
}

py::list to_py(const std::vector<at::Tensor>& tensors) {
  py::list out;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) {
      out.append(py::cast(t));
    } else {
      out.append(py::none());
    }
  }
  return out;
}

}  // namespace python
}  // namespace ddpx
