# Finds Torch and a Python interpreter that can import it.
#
# Debian ships two pythons on PATH-order surprises: the first `python3` may lack torch. We pick
# the first candidate that imports torch: $DDPX_PYTHON, Python_EXECUTABLE, python3 on PATH,
# /usr/bin/python3.
set(_ddpx_py_candidates "$ENV{DDPX_PYTHON}" "${Python_EXECUTABLE}")
find_program(_ddpx_path_python3 python3)
list(APPEND _ddpx_py_candidates "${_ddpx_path_python3}" /usr/bin/python3)
set(DDPX_PYTHON "")
foreach(_cand IN LISTS _ddpx_py_candidates)
  if(_cand AND EXISTS "${_cand}" AND NOT DDPX_PYTHON)
    execute_process(COMMAND "${_cand}" -c "import torch,sys;print(torch.utils.cmake_prefix_path)"
      RESULT_VARIABLE _rc OUTPUT_VARIABLE _prefix OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_rc EQUAL 0)
      set(DDPX_PYTHON "${_cand}")
      set(DDPX_TORCH_CMAKE_PREFIX "${_prefix}")
    endif()
  endif()
endforeach()
if(DDPX_PYTHON)
  message(STATUS "ddpx: Python with torch: ${DDPX_PYTHON}")
  list(APPEND CMAKE_PREFIX_PATH "${DDPX_TORCH_CMAKE_PREFIX}")
  set(Python_EXECUTABLE "${DDPX_PYTHON}" CACHE FILEPATH "Python with torch" FORCE)
  set(PYTHON_EXECUTABLE "${DDPX_PYTHON}" CACHE FILEPATH "Python with torch" FORCE)
endif()

find_package(Torch REQUIRED)
message(STATUS "ddpx: Torch ${Torch_VERSION} (${TORCH_INSTALL_PREFIX})")

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

# Gloo is needed by C++ tests that build ProcessGroupGloo directly.
set(DDPX_TORCH_HAS_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  set(DDPX_TORCH_HAS_CUDA ON)
endif()
