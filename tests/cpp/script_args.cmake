# Shared by the `cmake -P` test scripts in this folder (run_consumer_example.cmake,
# check_cuda_mismatch.cmake): their required -D arguments, and the generator default.
function(ddpx_require_script_args script)
  foreach(_var IN LISTS ARGN)
    if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
      message(FATAL_ERROR "${script}: -D${_var}=... is required")
    endif()
  endforeach()
endfunction()

if(NOT DDPX_GENERATOR)
  set(DDPX_GENERATOR Ninja)
endif()
