// pybind11 bindings: the module ddpx._C. Thin by design: argument names, docstrings, GIL
// handling and type conversion only; every behaviour lives in the C++ library. One binding unit
// per area (bind_*.cpp); shared helpers in bind_utils.
#include <ddpx/common/compat.h>
#include <pybind11/pybind11.h>

#include "bind_utils.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddpx native core: DDP communication hooks as C++ c10d::CommHookInterface objects.";
  m.attr("__torch_version__") = ddpx::compat::torch_version();
#ifdef DDPX_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  ddpx::python::bind_hooks(m);
  ddpx::python::bind_powersgd(m);
  ddpx::python::bind_post_localsgd(m);
  ddpx::python::bind_quantized(m);
  ddpx::python::bind_averaging(m);
  ddpx::python::bind_kernels(m);
  ddpx::python::bind_functional_optim(m);
  ddpx::python::bind_zero(m);
  ddpx::python::bind_rpc_optim(m);
  ddpx::python::bind_diloco(m);
}
