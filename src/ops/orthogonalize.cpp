#include "ops/orthogonalize.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/orthogonalize.h"

#ifdef DDPX_WITH_CUDA
#include "kernels/orthogonalize_cuda.h"
#include "ops/cuda_launch.h"
#endif

namespace ddpx {
namespace ops {

MatrixPack::MatrixPack(std::vector<int64_t> offsets, std::vector<int64_t> rows,
                       std::vector<int64_t> cols, const at::Device& device)
    : offsets_(std::move(offsets)), rows_(std::move(rows)), cols_(std::move(cols)) {
  TORCH_INTERNAL_ASSERT(offsets_.size() == rows_.size() && rows_.size() == cols_.size());
  for (size_t k = 0; k < rows_.size(); ++k) {
    TORCH_CHECK(cols_[k] <= rows_[k], "MatrixPack: matrix ", k, " has more columns (", cols_[k],
                ") than rows (", rows_[k], ")");
    TORCH_CHECK(offsets_[k] >= 0 && rows_[k] >= 0 && cols_[k] >= 0, "MatrixPack: matrix ", k,
                " has a negative offset or size");
    extent_ = std::max(extent_, offsets_[k] + rows_[k] * cols_[k]);
    begin_ = k == 0 ? offsets_[k] : std::min(begin_, offsets_[k]);
  }
  if (device.is_cuda() && !offsets_.empty()) {
    std::vector<int64_t> all(offsets_);
    all.insert(all.end(), rows_.begin(), rows_.end());
    all.insert(all.end(), cols_.begin(), cols_.end());
    for (int64_t o : offsets_) all.push_back(o - begin_);
    device_desc_ = at::tensor(all, at::kLong).view({4, count()}).to(device);
  }
}

MatrixPack MatrixPack::back_to_back(std::vector<int64_t> rows, std::vector<int64_t> cols,
                                    const at::Device& device, int64_t first) {
  TORCH_CHECK(rows.size() == cols.size(),
              "MatrixPack: rows and cols must have the same length, "
              "got ",
              rows.size(), " and ", cols.size());
  std::vector<int64_t> offsets;
  offsets.reserve(rows.size());
  for (size_t k = 0; k < rows.size(); ++k) {
    offsets.push_back(first);
    first += rows[k] * cols[k];
  }
  return MatrixPack(std::move(offsets), std::move(rows), std::move(cols), device);
}

namespace {

// orthogonalize_ on a float or double `flat` that holds the pack's matrices at their offsets
// minus `shift`: 0 (the buffer itself) or pack.begin() (a copy of the region alone).
void orthogonalize_wide(const at::Tensor& flat, const MatrixPack& pack, int64_t shift,
                        double epsilon, bool spread) {
  TORCH_INTERNAL_ASSERT(shift == 0 || shift == pack.begin());
  AT_DISPATCH_FLOATING_TYPES(flat.scalar_type(), "orthogonalize_", [&] {
    const auto eps = static_cast<scalar_t>(epsilon);
    if (flat.is_cuda()) {
#ifdef DDPX_WITH_CUDA
      const at::Tensor& d = pack.device_descriptors();
      TORCH_CHECK(d.defined() && d.device() == flat.device(),
                  "orthogonalize_: the MatrixPack was built for another device");
      const int64_t* base = d.data_ptr<int64_t>();
      const int64_t n = pack.count();
      const int64_t* offsets = shift == 0 ? base : base + 3 * n;
      const CudaLaunch launch(flat);
      // A few tall matrices are spread over several blocks each (kernels/orthogonalize_cuda.h);
      // their blocks combine sums through a scratch buffer from the caching allocator.
      // DDPX_GS_TALL=0 keeps one block per matrix (a way back while the multi-block kernel
      // has not run on many GPUs).
      static const bool tall_off = [] {
        const char* v = std::getenv("DDPX_GS_TALL");
        return v != nullptr && std::string(v) == "0";
      }();
      const kernels::GsPlan plan =
          tall_off || !spread
              ? kernels::GsPlan()
              : kernels::plan_orthogonalize_cuda(pack.rows().data(), pack.cols().data(), n,
                                                 std::is_same<scalar_t, double>::value);
      at::Tensor scratch;
      if (plan.tall_blocks > 0) {
        scratch = at::empty({kernels::orthogonalize_cuda_scratch(plan)},
                            flat.options().dtype(at::kDouble));
      }
      const cudaError_t refused = kernels::orthogonalize_cuda(
          flat.data_ptr<scalar_t>(), offsets, base + n, base + 2 * n, n, eps, launch.stream(), plan,
          scratch.defined() ? scratch.data_ptr<double>() : nullptr);
      if (refused != cudaSuccess) {
        TORCH_WARN_ONCE("orthogonalize_: this GPU refused the cooperative launch of the ",
                        "multi-block Gram-Schmidt kernel (", cudaGetErrorString(refused),
                        "); one block per matrix is used instead, with the same results but ",
                        "slower for tall matrices (DDPX_GS_TALL=0 skips the attempt)");
      }
#else
      TORCH_CHECK(false, "orthogonalize_: ddpx was built without CUDA support");
#endif
      return;
    }
    std::vector<int64_t> offsets = pack.offsets();
    for (int64_t& o : offsets) o -= shift;
    kernels::orthogonalize_cpu(flat.data_ptr<scalar_t>(), offsets.data(), pack.rows().data(),
                               pack.cols().data(), pack.count(), eps);
  });
}

}  // namespace

void orthogonalize_(const at::Tensor& flat, const MatrixPack& pack, double epsilon, bool spread) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(),
              "orthogonalize_: expected a contiguous 1-D buffer");
  if (pack.count() == 0) return;
  // An out-of-bounds write on the GPU would leave a sticky error in the CUDA context.
  TORCH_CHECK(pack.extent() <= flat.numel(), "orthogonalize_: the matrices extend to element ",
              pack.extent(), " but the buffer has ", flat.numel());
  if (flat.scalar_type() == at::kHalf || flat.scalar_type() == at::kBFloat16) {
    // In fp32, converting only the matrices' region, into a buffer of the region's size alone
    // (PowerSGD's P region starts after its uncompressed values, which need no fp32 copy).
    // Elements of the region between matrices round-trip exactly; those outside it are neither
    // read nor written.
    const int64_t begin = pack.begin(), length = pack.extent() - pack.begin();
    const at::Tensor wide = flat.narrow(0, begin, length).to(at::kFloat);
    orthogonalize_wide(wide, pack, begin, epsilon, spread);
    flat.narrow(0, begin, length).copy_(wide);
    return;
  }
  orthogonalize_wide(flat, pack, 0, epsilon, spread);
}

}  // namespace ops
}  // namespace ddpx
