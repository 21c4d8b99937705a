# CUDA: the kernels compile whenever nvcc is present (a compile check even on CPU-only
# machines); the ATen layer uses them only when torch itself has CUDA of the same major version.
# Expects DdpxTorch.cmake to have run (DDPX_NVCC, DDPX_CUDA_ARCHS, DDPX_TORCH_CUDA_VERSION).
include(CheckLanguage)
set(DDPX_HAVE_NVCC OFF)
set(DDPX_WITH_CUDA OFF)
if(NOT DDPX_CUDA STREQUAL "OFF")
  # A hint, not a choice: check_language does nothing once CMAKE_CUDA_COMPILER is set, so an
  # nvcc that cannot drive this host compiler would fail enable_language() even in AUTO mode.
  # Through CUDACXX, check_language tries it and leaves CMAKE_CUDA_COMPILER NOTFOUND if it fails.
  # (With a CUDA torch, torch's CMake has enabled CUDA already.)
  if(NOT CMAKE_CUDA_COMPILER AND DDPX_NVCC AND NOT DEFINED ENV{CUDACXX})
    set(ENV{CUDACXX} "${DDPX_NVCC}")
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT CMAKE_CUDA_HOST_COMPILER)
      set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    find_package(CUDAToolkit REQUIRED)
    set(DDPX_HAVE_NVCC ON)
    # torch's CMake sets CMAKE_CUDA_FLAGS (a normal variable over the cache entry) to its own
    # -gencode choice and the flags its own .cu files need (-DONNX_NAMESPACE, --expt-*,
    # -Xcudafe suppressions). ddpx's .cu files include no torch header: unsetting the variable
    # leaves the user's cache entry only, so the kernels compile with the same flags against
    # every torch (ccache then shares their objects between torch lines), and the architectures
    # come from DDPX_CUDA_ARCHS per target (DdpxCudaArchs.cmake).
    unset(CMAKE_CUDA_FLAGS)
    if(NOT DDPX_CUDA_ARCHS)  # an nvcc found only now: choose for it, by the same rules
      ddpx_select_cuda_archs()
    endif()
  endif()
endif()
if(DDPX_CUDA STREQUAL "ON" AND NOT DDPX_HAVE_NVCC)
  message(FATAL_ERROR "DDPX_CUDA=ON but no nvcc was found")
endif()

if(DDPX_HAVE_NVCC AND DDPX_TORCH_HAS_CUDA)
  # One process cannot hold two CUDA runtimes of different major versions: ddpx's kernels link
  # nvcc's libcudart.so.<major>, torch loads its own. Same major (13.0 vs 13.2) is fine (CUDA's
  # minor-version compatibility); a different major is not.
  string(REGEX MATCH "^[0-9]+" _nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
  string(REGEX MATCH "^[0-9]+" _torch_major "${DDPX_TORCH_CUDA_VERSION}")
  if(_torch_major AND NOT _nvcc_major STREQUAL _torch_major)
    set(_msg "nvcc is CUDA ${CMAKE_CUDA_COMPILER_VERSION} but torch was built with CUDA "
      "${DDPX_TORCH_CUDA_VERSION}: ddpx's CUDA kernels cannot be used with this torch. Install "
      "the CUDA ${_torch_major}.x toolkit (or point CMAKE_CUDA_COMPILER / CUDACXX at its nvcc), "
      "or install a torch built for CUDA ${_nvcc_major}.x")
    string(REPLACE ";" "" _msg "${_msg}")
    if(DDPX_CUDA STREQUAL "ON")
      message(FATAL_ERROR "ddpx: DDPX_CUDA=ON, but ${_msg}.")
    endif()
    message(WARNING "ddpx: ${_msg}. Building without ddpx's CUDA path (DDPX_CUDA=AUTO); "
      "CUDA tensors then raise a clear error in ddpx.")
  else()
    set(DDPX_WITH_CUDA ON)
  endif()
elseif(DDPX_CUDA STREQUAL "ON")
  message(FATAL_ERROR "DDPX_CUDA=ON but torch was built without CUDA")
endif()
message(STATUS "ddpx: nvcc ${DDPX_HAVE_NVCC} (${CMAKE_CUDA_COMPILER_VERSION}), torch CUDA "
  "${DDPX_TORCH_HAS_CUDA} (${DDPX_TORCH_CUDA_VERSION}), CUDA path ${DDPX_WITH_CUDA}")
