# Finds Torch and a Python interpreter that can import it.
#
# The first `python3` on PATH may lack torch (Debian: /usr/bin/python3 has Debian's torch 1.13,
# a pyenv or venv python may have pip's torch 2.x). We pick the first candidate that imports
# torch: -DDDPX_PYTHON=..., $DDPX_PYTHON, Python_EXECUTABLE, python3 on PATH, /usr/bin/python3. Its torch is the
# one ddpx is built against (CMake finds it through torch.utils.cmake_prefix_path).
#
# Sets: DDPX_PYTHON, DDPX_TORCH_ROOT, DDPX_TORCH_VERSION ("2.11.0"), DDPX_TORCH_CUDA_VERSION ("" for a CPU torch),
# DDPX_TORCH_ARCH_LIST (the GPU architectures torch was built for, e.g. "75;80;90"),
# DDPX_COMPAT_INCLUDE_DIR, DDPX_TORCH_HAS_CUDA, DDPX_CXX_STANDARD (17, or 20 where torch requires it).
include(DdpxTorchLibs)

set(_ddpx_py_candidates "${DDPX_PYTHON}" "$ENV{DDPX_PYTHON}" "${Python_EXECUTABLE}")
find_program(_ddpx_path_python3 python3)
list(APPEND _ddpx_py_candidates "${_ddpx_path_python3}" /usr/bin/python3)
set(DDPX_PYTHON "")
set(DDPX_TORCH_CUDA_VERSION "")
set(DDPX_TORCH_ARCH_LIST "")
set(DDPX_TORCH_VERSION "")
# One line each: cmake prefix, torch.version.cuda, the sm_XY flags torch was compiled with
# (torch.cuda.get_arch_list() is empty without a GPU; the compiled-in flags are not), the
# version without its local part ("2.11.0").
set(_ddpx_torch_probe [=[
import torch
print(torch.utils.cmake_prefix_path)
print(torch.version.cuda or "")
flags = ""
if torch.version.cuda:
    try:
        flags = torch._C._cuda_getArchFlags() or ""
    except Exception:
        flags = ""
print(" ".join(f for f in flags.split() if f.startswith("sm_")))
print(torch.__version__.split("+")[0])
]=])
foreach(_cand IN LISTS _ddpx_py_candidates)
  if(_cand AND EXISTS "${_cand}" AND NOT DDPX_PYTHON)
    execute_process(COMMAND "${_cand}" -W ignore -c "${_ddpx_torch_probe}"
      RESULT_VARIABLE _rc OUTPUT_VARIABLE _out OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_rc EQUAL 0)
      set(DDPX_PYTHON "${_cand}")
      string(REPLACE "\n" ";" _lines "${_out}")
      list(LENGTH _lines _n)
      list(GET _lines 0 DDPX_TORCH_CMAKE_PREFIX)
      if(_n GREATER 1)
        list(GET _lines 1 DDPX_TORCH_CUDA_VERSION)
      endif()
      if(_n GREATER 2)
        list(GET _lines 2 _flags)
        string(REGEX MATCHALL "[0-9]+a?" DDPX_TORCH_ARCH_LIST "${_flags}")
      endif()
      if(_n GREATER 3)
        list(GET _lines 3 DDPX_TORCH_VERSION)
      endif()
    endif()
  endif()
endforeach()
if(DDPX_PYTHON)
  message(STATUS "ddpx: Python with torch: ${DDPX_PYTHON}")
  set(Python_EXECUTABLE "${DDPX_PYTHON}" CACHE FILEPATH "Python with torch" FORCE)
  set(PYTHON_EXECUTABLE "${DDPX_PYTHON}" CACHE FILEPATH "Python with torch" FORCE)
  # <torch>/share/cmake -> <torch>
  get_filename_component(DDPX_TORCH_ROOT "${DDPX_TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
  # What an installed ddpx's package config names: the torch itself, not the link below.
  set(DDPX_TORCH_CONFIG_DIR "${DDPX_TORCH_ROOT}/share/cmake/Torch")
  # ccache reuses an object only for the same command line, and a pip torch's include path
  # names its venv and Python (.venv/lib/python3.11/..., .venv-py3.13/lib/python3.13/...), so
  # each Python's build of one torch compiled the library again. Through a link in the build
  # tree to torch's site-packages, every build tree of the checkout passes the same path
  # (relative under CCACHE_BASEDIR: torch-site/torch/include). The link is to site-packages,
  # not to torch, so that torch/../nvidia (the CUDA wheels) resolves through it as well.
  if(EXISTS "${DDPX_TORCH_CONFIG_DIR}/TorchConfig.cmake" AND NOT DDPX_NO_TORCH_LINK)
    get_filename_component(_ddpx_site "${DDPX_TORCH_ROOT}" DIRECTORY)
    get_filename_component(_ddpx_torch_name "${DDPX_TORCH_ROOT}" NAME)
    set(_ddpx_link "${CMAKE_BINARY_DIR}/torch-site")
    file(REMOVE "${_ddpx_link}")
    file(CREATE_LINK "${_ddpx_site}" "${_ddpx_link}" SYMBOLIC)
    set(DDPX_TORCH_ROOT "${_ddpx_link}/${_ddpx_torch_name}")
    set(DDPX_TORCH_CMAKE_PREFIX "${DDPX_TORCH_ROOT}/share/cmake")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${DDPX_TORCH_CMAKE_PREFIX}")
  ddpx_pin_torch_libraries("${DDPX_TORCH_ROOT}")
endif()

# The GPU architectures: chosen here (DdpxCuda.cmake) and handed to torch's CMake too, which
# would otherwise try to detect a GPU and, finding none, add flags for a dozen architectures
# of its own to every .cu file. DdpxCuda.cmake strips torch's flags and sets ours per target.
include(DdpxCudaArchs)
ddpx_select_cuda_archs()

# nvcc compiles the kernels' host code with the C++ compiler chosen for everything else. A CUDA
# torch's CMake enables CUDA itself, below, and names a host compiler only when that is clang:
# otherwise nvcc takes the first g++ on PATH, and a build asked for with another compiler
# (g++-11) compiled its .cu files with a different one. Set before CUDA is enabled, or it has no
# effect; the user's choice (CMAKE_CUDA_HOST_COMPILER, CUDAHOSTCXX) wins.
if(NOT CMAKE_CUDA_HOST_COMPILER AND NOT DEFINED ENV{CUDAHOSTCXX} AND NOT DDPX_CUDA STREQUAL "OFF")
  set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}")
endif()

find_package(Torch REQUIRED)
if(NOT DDPX_TORCH_ROOT)
  set(DDPX_TORCH_ROOT "${TORCH_INSTALL_PREFIX}")
endif()
if(NOT DDPX_TORCH_CONFIG_DIR)
  set(DDPX_TORCH_CONFIG_DIR "${Torch_DIR}")
endif()
ddpx_fix_torch_link("${DDPX_TORCH_ROOT}")
ddpx_torch_cxx_standard(DDPX_CXX_STANDARD)
message(STATUS "ddpx: Torch ${Torch_VERSION} (${TORCH_INSTALL_PREFIX}; libtorch ${TORCH_LIBRARY}); "
  "C++${DDPX_CXX_STANDARD} for code that includes torch")
if(NOT DDPX_TORCH_VERSION)
  set(DDPX_TORCH_VERSION "${Torch_VERSION}")
endif()

# Debian's libtorch-dev lacks torch/csrc/distributed/autograd/**, which c10d/reducer.hpp needs.
set(DDPX_COMPAT_INCLUDE_DIR "")
set(_ddpx_ctx_found OFF)
foreach(_inc IN LISTS TORCH_INCLUDE_DIRS)
  if(EXISTS "${_inc}/torch/csrc/distributed/autograd/context/context.h")
    set(_ddpx_ctx_found ON)
  endif()
endforeach()
if(NOT _ddpx_ctx_found)
  set(DDPX_COMPAT_INCLUDE_DIR "${CMAKE_CURRENT_SOURCE_DIR}/cmake/compat")
  message(STATUS "ddpx: torch lacks dist_autograd headers; using ${DDPX_COMPAT_INCLUDE_DIR}")
endif()

set(DDPX_TORCH_HAS_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  set(DDPX_TORCH_HAS_CUDA ON)
endif()
