# Builds the Python extension ddpx._C against the interpreter that has torch, and lays out an
# importable package in ${CMAKE_BINARY_DIR}/python (PYTHONPATH=build/python works for tests).
find_package(Python COMPONENTS Interpreter Development.Module REQUIRED)
# The module must share pybind11's internals with torch's own module (that is how a Python
# ProcessGroup, GradBucket or Reducer reaches C++ here), so it must use the pybind11 torch was
# built with: pip's torch ships those headers in its include directory; Debian's torch uses the
# system pybind11 (pybind11-dev).
set(_ddpx_torch_pybind11 "")
foreach(_inc IN LISTS TORCH_INCLUDE_DIRS)
  if(NOT _ddpx_torch_pybind11 AND EXISTS "${_inc}/pybind11/pybind11.h"
     AND NOT _inc STREQUAL "/usr/include")
    set(_ddpx_torch_pybind11 "${_inc}")
  endif()
endforeach()
if(_ddpx_torch_pybind11)
  message(STATUS "ddpx: using torch's bundled pybind11 headers in ${_ddpx_torch_pybind11}")
  set(pybind11_FOUND OFF)
else()
  find_package(pybind11 CONFIG QUIET)
endif()
if(NOT pybind11_FOUND AND NOT _ddpx_torch_pybind11)
  # pip torch ships pybind11's headers in its include directory.
  execute_process(COMMAND "${Python_EXECUTABLE}" -c "import pybind11;print(pybind11.get_cmake_dir())"
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _pyb_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_rc EQUAL 0)
    find_package(pybind11 CONFIG REQUIRED PATHS "${_pyb_dir}")
  endif()
endif()

find_library(TORCH_PYTHON_LIBRARY torch_python
  PATHS "${TORCH_INSTALL_PREFIX}/lib" "${TORCH_INSTALL_PREFIX}/lib/x86_64-linux-gnu"
  /usr/lib/x86_64-linux-gnu NO_DEFAULT_PATH)
if(NOT TORCH_PYTHON_LIBRARY)
  find_library(TORCH_PYTHON_LIBRARY torch_python REQUIRED)
endif()

set(_ddpx_py_sources src/python/module.cpp src/python/bind_utils.cpp src/python/bind_hooks.cpp
  src/python/bind_powersgd.cpp src/python/bind_post_localsgd.cpp src/python/bind_averaging.cpp
  src/python/bind_kernels.cpp src/python/bind_functional_optim.cpp
  src/python/bind_zero.cpp src/python/bind_rpc_optim.cpp src/python/bind_quantized.cpp
  src/python/bind_diloco.cpp)
if(pybind11_FOUND)
  pybind11_add_module(_C MODULE ${_ddpx_py_sources})
else()
  Python_add_library(_C MODULE WITH_SOABI ${_ddpx_py_sources})
  target_compile_options(_C PRIVATE -fvisibility=hidden)
  set_target_properties(_C PROPERTIES PREFIX "")
endif()
ddpx_unity_build(_C)
target_link_libraries(_C PRIVATE ddpx ddpx_private ${TORCH_PYTHON_LIBRARY})
# The linked module itself needs libstdc++.so (DdpxLibstdcxx.cmake): whatever flags reached its
# link, a module with a static copy inside is removed and the build fails with the reason.
ddpx_check_module_libstdcxx(_C)
target_compile_definitions(_C PRIVATE TORCH_EXTENSION_NAME=_C)
if(DDPX_COMPAT_INCLUDE_DIR)
  target_include_directories(_C PRIVATE ${DDPX_COMPAT_INCLUDE_DIR})
endif()
set(DDPX_PY_PACKAGE_DIR "${CMAKE_BINARY_DIR}/python/ddpx" CACHE INTERNAL "")
set_target_properties(_C PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${DDPX_PY_PACKAGE_DIR}")

# What ddpx._C was built against, read by ddpx/_loader.py before it loads the module (a ddpx built
# for another torch then fails with both versions named instead of an undefined symbol).
if(DDPX_WITH_CUDA)
  set(_ddpx_with_cuda_py True)
else()
  set(_ddpx_with_cuda_py False)
endif()
configure_file("${CMAKE_CURRENT_SOURCE_DIR}/cmake/build_info.py.in"
  "${DDPX_PY_PACKAGE_DIR}/_build_info.py" @ONLY)

# Mirror the pure-Python sources, subpackages included, next to the module so the build tree is
# importable.
set(_ddpx_py_src "${CMAKE_CURRENT_SOURCE_DIR}/python/ddpx")
file(GLOB_RECURSE _ddpx_py_files CONFIGURE_DEPENDS RELATIVE "${_ddpx_py_src}" "${_ddpx_py_src}/*.py")
set(_ddpx_py_outputs "")
foreach(_rel IN LISTS _ddpx_py_files)
  set(_out "${DDPX_PY_PACKAGE_DIR}/${_rel}")
  get_filename_component(_out_dir "${_out}" DIRECTORY)
  add_custom_command(OUTPUT "${_out}"
    COMMAND ${CMAKE_COMMAND} -E make_directory "${_out_dir}"
    COMMAND ${CMAKE_COMMAND} -E copy_if_different "${_ddpx_py_src}/${_rel}" "${_out}"
    DEPENDS "${_ddpx_py_src}/${_rel}")
  list(APPEND _ddpx_py_outputs "${_out}")
endforeach()
add_custom_target(ddpx_python_files ALL DEPENDS ${_ddpx_py_outputs})
add_dependencies(_C ddpx_python_files)
