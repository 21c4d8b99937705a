# ctest cpp_consumer_example: install this build of ddpx, build examples/cpp against the installed
# package with find_package(ddpx), run the programs. Usage (see tests/cpp/CMakeLists.txt):
#   cmake -DDDPX_BUILD_DIR=... -DDDPX_EXAMPLE_SOURCE_DIR=... [-DDDPX_GENERATOR=Ninja]
#         [-DDDPX_MAKE_PROGRAM=...] [-DDDPX_CXX_COMPILER=...] [-DDDPX_CCACHE=...]
#         [-DDDPX_TORCH_DIR=...] [-DDDPX_BUILD_TYPE=...] [-DDDPX_CXX_STANDARD=17|20]
#         [-DDDPX_EXAMPLE_BUILD_NAME=_example] -P run_consumer_example.cmake
# DDPX_CXX_STANDARD: the language level the consumer asks for (CMAKE_CXX_STANDARD); the package
# raises it to C++20 where its torch requires that.
cmake_minimum_required(VERSION 3.19)  # COMMAND_ERROR_IS_FATAL

include("${CMAKE_CURRENT_LIST_DIR}/script_args.cmake")
ddpx_require_script_args(run_consumer_example.cmake DDPX_BUILD_DIR DDPX_EXAMPLE_SOURCE_DIR)

if(NOT DDPX_EXAMPLE_BUILD_NAME)
  set(DDPX_EXAMPLE_BUILD_NAME _example)
endif()
set(_prefix "${DDPX_BUILD_DIR}/${DDPX_EXAMPLE_BUILD_NAME}_install")
set(_build "${DDPX_BUILD_DIR}/${DDPX_EXAMPLE_BUILD_NAME}")

# 1. Install exactly what a user would get.
file(REMOVE_RECURSE "${_prefix}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${DDPX_BUILD_DIR}" --prefix "${_prefix}"
  OUTPUT_QUIET COMMAND_ERROR_IS_FATAL ANY)
message(STATUS "installed ddpx into ${_prefix}")

# 2. Configure the example against the installed package only (plus torch's own prefix, which
#    a user provides the same way).
set(_prefix_path "${_prefix}")
set(_args -S "${DDPX_EXAMPLE_SOURCE_DIR}" -B "${_build}" -G "${DDPX_GENERATOR}")
if(DDPX_TORCH_DIR)
  list(APPEND _args "-DTorch_DIR=${DDPX_TORCH_DIR}")
endif()
if(DDPX_MAKE_PROGRAM)
  list(APPEND _args "-DCMAKE_MAKE_PROGRAM=${DDPX_MAKE_PROGRAM}")
endif()
if(DDPX_CXX_COMPILER)
  list(APPEND _args "-DCMAKE_CXX_COMPILER=${DDPX_CXX_COMPILER}")
endif()
if(DDPX_CCACHE)
  list(APPEND _args "-DCMAKE_CXX_COMPILER_LAUNCHER=${DDPX_CCACHE}")
endif()
if(DDPX_BUILD_TYPE)
  list(APPEND _args "-DCMAKE_BUILD_TYPE=${DDPX_BUILD_TYPE}")
endif()
if(DDPX_CXX_STANDARD)
  list(APPEND _args "-DCMAKE_CXX_STANDARD=${DDPX_CXX_STANDARD}")
endif()
# A stale cache from another prefix would hide a broken package: start clean.
file(REMOVE "${_build}/CMakeCache.txt")
execute_process(COMMAND "${CMAKE_COMMAND}" ${_args} "-DCMAKE_PREFIX_PATH=${_prefix_path}"
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "configuring examples/cpp against ${_prefix} failed:\n${_out}\n${_err}")
endif()

# 3. Build (two jobs: the CI machine has two cores) and run.
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${_build}" --parallel 2
  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "building examples/cpp failed:\n${_out}\n${_err}")
endif()
foreach(_program ddpx_cpp_example ddpx_post_local_sgd_example)
  execute_process(COMMAND "${_build}/${_program}" RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${_program} failed (exit status ${_rc})")
  endif()
endforeach()
