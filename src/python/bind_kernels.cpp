// Bindings of the compression kernels' ATen layer, for the kernel tests and benchmarks
// (tests/python/test_kernels.py, benchmarks/bench_kernels.py): not part of the hooks' API.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>

#include "bind_utils.h"
#include "kernels/cast.h"
#include "ops/cast.h"
#include "ops/lowrank.h"
#include "ops/orthogonalize.h"

#ifdef DDPX_WITH_CUDA
#include "kernels/orthogonalize_cuda.h"
#endif

namespace ddpx {
namespace python {

void bind_kernels(py::module& m) {
  m.def(
      "scaled_cast",
      [](const at::Tensor& src, const py::object& dtype, double scale) {
        const at::ScalarType st = to_dtype(dtype, "dtype");
        py::gil_scoped_release no_gil;
        return ops::scaled_cast(src, st, scale);
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
        ops::sum_rows_into(src.contiguous(), out, scale);
        return out;
      },
      py::arg("src"), py::arg("dtype"), py::arg("scale") = 1.0,
      "Returns scale * src.sum(0) in dtype, accumulated in fp32 (the decompression kernel).");
  m.def(
      "orthogonalize_",
      [](const at::Tensor& flat, const std::vector<int64_t>& rows, const std::vector<int64_t>& cols,
         double epsilon, int64_t first, bool spread) {
        py::gil_scoped_release no_gil;
        ops::orthogonalize_(flat, ops::MatrixPack::back_to_back(rows, cols, flat.device(), first),
                            epsilon, spread);
      },
      py::arg("flat"), py::arg("rows"), py::arg("cols"), py::arg("epsilon") = 0.0,
      py::arg("first") = 0, py::arg("spread") = true,
      "Orthonormalises in place the columns of the row-major rows[k] x cols[k] matrices stored "
      "back to back in `flat` from element `first` (PowerSGD's batched Gram-Schmidt kernel; CPU "
      "or CUDA; spread=False keeps one CUDA block per matrix).");
  m.def(
      "prepare_orthogonalize_",
      [](const at::Tensor& flat, const std::vector<int64_t>& rows, const std::vector<int64_t>& cols,
         double epsilon, int64_t first, bool spread) {
        // The descriptors are uploaded here, once (a synchronous copy), as the PowerSGD hook
        // does once per bucket layout: a timed call of the result launches the kernel alone.
        auto pack = std::make_shared<ops::MatrixPack>(
            ops::MatrixPack::back_to_back(rows, cols, flat.device(), first));
        return py::cpp_function(
            [pack, epsilon, spread](const at::Tensor& t) {
              py::gil_scoped_release no_gil;
              ops::orthogonalize_(t, *pack, epsilon, spread);
            },
            py::arg("flat"));
      },
      py::arg("flat"), py::arg("rows"), py::arg("cols"), py::arg("epsilon") = 0.0,
      py::arg("first") = 0, py::arg("spread") = true,
      "orthogonalize_ with the matrices' descriptors prepared once: returns f(flat) that "
      "orthogonalises, in place, a buffer on flat's device laid out as `flat` (for benchmarks).");
  m.def(
      "lowrank_",
      [](const std::string& op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
         const std::optional<at::Tensor>& err) {
        py::gil_scoped_release no_gil;
        const at::Tensor e = err.has_value() ? *err : at::Tensor();
        if (op == "project") {
          ops::lowrank_project_(a, b, out, e);
        } else if (op == "project_t") {
          TORCH_CHECK_VALUE(!e.defined(), "lowrank_: err applies to 'project' and 'reconstruct'");
          ops::lowrank_project_t_(a, b, out);
        } else {
          TORCH_CHECK_VALUE(op == "reconstruct", "lowrank_: op must be 'project', 'project_t' or ",
                            "'reconstruct', got '", op, "'");
          ops::lowrank_reconstruct_(a, b, out, e);
        }
      },
      py::arg("op"), py::arg("a"), py::arg("b"), py::arg("out"), py::arg("err") = py::none(),
      "PowerSGD's products on 3-D batches, into `out`: project P = M Q (a=M, b=Q), project_t "
      "Q = M^T P (a=M, b=P), reconstruct M = P Q^T (a=P, b=Q). With `err` (shaped as M), "
      "project first compensates (M += err; err = M) and reconstruct then takes the residual "
      "(err -= M), each in the product's pass.");
  m.def("cpu_has_fast_half", &kernels::cpu_has_fast_half, "True when the CPU kernels use F16C.");
  m.def(
      "_refuse_cooperative_launches_for_testing",
      [](bool refuse) {
#ifdef DDPX_WITH_CUDA
        kernels::refuse_cooperative_launches_for_testing(refuse);
#else
        (void)refuse;
#endif
      },
      py::arg("refuse"),
      "For tests: while True, the multi-block Gram-Schmidt's cooperative launches are refused "
      "by the CUDA runtime (a grid of no blocks), so that orthogonalize_ takes its fallback.");
}

}  // namespace python
}  // namespace ddpx
