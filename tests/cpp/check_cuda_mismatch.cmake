# ctest cmake_cuda_version_mismatch: configures ddpx against a torch that reports another CUDA
# major version than nvcc's (torch.version.cuda patched through a sitecustomize module) and
# checks both outcomes: DDPX_CUDA=AUTO warns and builds without the CUDA path; DDPX_CUDA=ON stops
# with both versions named. Usage (tests/cpp/CMakeLists.txt):
#   cmake -DDDPX_SOURCE_DIR=... -DDDPX_PYTHON=... -DDDPX_WORK_DIR=... -DFAKE_CUDA=12.8
#         [-DDDPX_GENERATOR=Ninja] -P check_cuda_mismatch.cmake
cmake_minimum_required(VERSION 3.19)
include("${CMAKE_CURRENT_LIST_DIR}/script_args.cmake")
ddpx_require_script_args(check_cuda_mismatch.cmake DDPX_SOURCE_DIR DDPX_PYTHON DDPX_WORK_DIR FAKE_CUDA)
file(REMOVE_RECURSE "${DDPX_WORK_DIR}")
file(MAKE_DIRECTORY "${DDPX_WORK_DIR}/site")
file(WRITE "${DDPX_WORK_DIR}/site/sitecustomize.py"
  "import torch.version as _v\n_v.cuda = \"${FAKE_CUDA}\"\n")
set(ENV{PYTHONPATH} "${DDPX_WORK_DIR}/site")

function(configure mode out_var rc_var)
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${DDPX_SOURCE_DIR}"
      -B "${DDPX_WORK_DIR}/build-${mode}" -G "${DDPX_GENERATOR}" "-DDDPX_PYTHON=${DDPX_PYTHON}"
      "-DPython_EXECUTABLE=${DDPX_PYTHON}" -DDDPX_CUDA=${mode} -DDDPX_BUILD_TESTS=OFF
      -DDDPX_BUILD_BENCHMARKS=OFF -DDDPX_BUILD_PYTHON=OFF
    OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc)
  string(REGEX REPLACE "[ \n]+" " " _all "${_out} ${_err}")  # CMake wraps warning text
  set(${out_var} "${_all}" PARENT_SCOPE)
  set(${rc_var} "${_rc}" PARENT_SCOPE)
endfunction()

configure(AUTO _auto _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "DDPX_CUDA=AUTO with CUDA ${FAKE_CUDA} torch failed to configure:\n${_auto}")
endif()
foreach(_needle "but torch was built with CUDA ${FAKE_CUDA}" "CUDA path OFF")
  string(FIND "${_auto}" "${_needle}" _pos)
  if(_pos EQUAL -1)
    message(FATAL_ERROR "DDPX_CUDA=AUTO: expected '${_needle}' in:\n${_auto}")
  endif()
endforeach()

configure(ON _on _rc)
if(_rc EQUAL 0)
  message(FATAL_ERROR "DDPX_CUDA=ON with CUDA ${FAKE_CUDA} torch configured without error")
endif()
string(FIND "${_on}" "DDPX_CUDA=ON, but nvcc is CUDA" _pos)
string(FIND "${_on}" "torch was built with CUDA ${FAKE_CUDA}" _pos2)
if(_pos EQUAL -1 OR _pos2 EQUAL -1)
  message(FATAL_ERROR "DDPX_CUDA=ON: unexpected error text:\n${_on}")
endif()
file(REMOVE_RECURSE "${DDPX_WORK_DIR}")
message(STATUS "nvcc/torch CUDA mismatch: AUTO warns and drops the CUDA path, ON stops")
