// Helpers shared by the binding units of ddpx._C.
#pragma once

#include <memory>

#include <pybind11/pybind11.h>

#include <ATen/core/ivalue.h>

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

// Binds post-local SGD: PostLocalSGDState and its hook, parameter averaging, the model averagers
// (bind_averaging.cpp).
void bind_post_local_sgd(py::module& m);

}  // namespace python
}  // namespace ddpx
