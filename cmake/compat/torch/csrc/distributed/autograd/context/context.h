// Compatibility stand-in for torch/csrc/distributed/autograd/context/context.h.
//
// Debian's libtorch-dev (torch 1.13) ships c10d/reducer.hpp, which includes this header, but
// omits the whole torch/csrc/distributed/autograd/ tree. reducer.hpp only needs the two names
// below, and only as types of members that ddpx never touches. CMake adds this directory to the
// include path only when the real header is missing, so a complete torch install always wins.
#pragma once

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  // Same alias as the real class: the gradient callback of distributed autograd.
  using GradCallback = std::function<bool(at::Tensor&)>;
};

// Same alias as the real header.
using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
