// Tensor comparisons shared by the GoogleTest suites that use ATen (test_utils.h includes it;
// test_orthogonalize.cpp, which needs no process groups, includes it alone).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>

namespace ddpx_test {

// Same dtype, same number of elements, same bits (in logical order). Use for results that must
// be reproduced exactly (NaN payloads included); on failure, says the largest difference.
inline ::testing::AssertionResult bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  if (a.scalar_type() != b.scalar_type() || a.numel() != b.numel()) {
    return ::testing::AssertionFailure()
           << "dtype/size differ: " << a.scalar_type() << "[" << a.numel() << "] vs "
           << b.scalar_type() << "[" << b.numel() << "]";
  }
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  if (std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) != 0) {
    return ::testing::AssertionFailure()
           << "max |a - b| = "
           << (ca.to(at::kDouble) - cb.to(at::kDouble)).abs().max().item<double>();
  }
  return ::testing::AssertionSuccess();
}

}  // namespace ddpx_test
