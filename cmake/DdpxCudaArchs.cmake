# ddpx_select_cuda_archs(): the GPU architectures ddpx's kernels are built for.
#
# In order of precedence:
#   1. -DDDPX_CUDA_ARCHS=... or the environment variable DDPX_CUDA_ARCHS, in CMake's
#      CUDA_ARCHITECTURES form ("80;90", "90-real", "native", "all-major"), used as given;
#   2. TORCH_CUDA_ARCH_LIST (CMake variable or environment, torch's form: "8.0;9.0+PTX");
#   3. the architectures the installed torch was built for (torch._C._cuda_getArchFlags());
#   4. "75;80;90" (a CPU torch: the kernels are then only a compile check).
# Lists from 2-4 keep the architectures this nvcc can build (`nvcc --list-gpu-arch`), with SASS
# for each and PTX for the newest, so a GPU newer than the list still runs (JIT from PTX).
# A user with an A100, L4 or RTX card thus gets kernels for it without doing anything.
#
# Sets in the caller's scope: DDPX_CUDA_ARCHS (CMake form), DDPX_NVCC (path or empty) and,
# unless the user set it, TORCH_CUDA_ARCH_LIST (torch's form, so that torch's CMake neither
# probes for a GPU nor picks architectures of its own).
function(_ddpx_arch_to_torch_form arch out)
  string(REGEX REPLACE "^([0-9]+)([0-9])$" "\\1.\\2" _v "${arch}")
  set(${out} "${_v}" PARENT_SCOPE)
endfunction()

# <out> = the CMake variable <name> if set and not empty, else the environment variable <name>.
function(_ddpx_var_or_env name out)
  set(_v "")
  if(DEFINED ${name} AND NOT "${${name}}" STREQUAL "")
    set(_v "${${name}}")
  elseif(DEFINED ENV{${name}})
    set(_v "$ENV{${name}}")
  endif()
  set(${out} "${_v}" PARENT_SCOPE)
endfunction()

function(ddpx_select_cuda_archs)
  set(DDPX_NVCC "" PARENT_SCOPE)
  if(DDPX_CUDA STREQUAL "OFF")
    return()
  endif()
  set(_nvcc "${CMAKE_CUDA_COMPILER}")
  if(NOT _nvcc AND DEFINED ENV{CUDACXX})
    set(_nvcc "$ENV{CUDACXX}")
  endif()
  if(NOT _nvcc)
    find_program(_ddpx_nvcc nvcc PATHS /usr/local/cuda/bin)
    set(_nvcc "${_ddpx_nvcc}")
  endif()
  if(NOT _nvcc)
    return()
  endif()
  set(DDPX_NVCC "${_nvcc}" PARENT_SCOPE)

  _ddpx_var_or_env(DDPX_CUDA_ARCHS _given)
  _ddpx_var_or_env(TORCH_CUDA_ARCH_LIST _torch_list)

  if(_given)
    set(_archs "${_given}")
    set(_source "DDPX_CUDA_ARCHS")
  else()
    if(_torch_list)
      # "7.5;8.0 9.0+PTX" -> 75 80 90 (PTX is added for the newest below in any case)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" _dotted "${_torch_list}")
      set(_wanted "")
      foreach(_d IN LISTS _dotted)
        string(REPLACE "." "" _a "${_d}")
        list(APPEND _wanted "${_a}")
      endforeach()
      set(_source "TORCH_CUDA_ARCH_LIST")
    elseif(DDPX_TORCH_ARCH_LIST)
      string(REGEX REPLACE "a" "" _wanted "${DDPX_TORCH_ARCH_LIST}")
      set(_source "the installed torch")
    else()
      set(_wanted 75 80 90)
      set(_source "the default (torch has no CUDA architectures)")
    endif()
    execute_process(COMMAND "${_nvcc}" --list-gpu-arch OUTPUT_VARIABLE _nv_out
      RESULT_VARIABLE _rc ERROR_QUIET)
    set(_supported "")
    if(_rc EQUAL 0)
      string(REGEX MATCHALL "compute_[0-9]+" _nv "${_nv_out}")
      string(REPLACE "compute_" "" _supported "${_nv}")
    endif()
    list(REMOVE_DUPLICATES _wanted)
    list(SORT _wanted COMPARE NATURAL)
    set(_kept "")
    foreach(_a IN LISTS _wanted)
      if(NOT _supported OR _a IN_LIST _supported)
        list(APPEND _kept "${_a}")
      else()
        message(STATUS "ddpx: nvcc cannot build sm_${_a} (from ${_source}); skipped")
      endif()
    endforeach()
    if(NOT _kept)
      message(FATAL_ERROR "ddpx: nvcc (${_nvcc}) supports none of the CUDA architectures "
        "${_wanted} (from ${_source}); set DDPX_CUDA_ARCHS, or DDPX_CUDA=OFF")
    endif()
    list(POP_BACK _kept _newest)
    set(_archs "")
    foreach(_a IN LISTS _kept)
      list(APPEND _archs "${_a}-real")
    endforeach()
    list(APPEND _archs "${_newest}")  # SASS and PTX
  endif()
  message(STATUS "ddpx: CUDA architectures ${_archs} (from ${_source})")
  set(DDPX_CUDA_ARCHS "${_archs}" PARENT_SCOPE)

  if(NOT _torch_list)
    set(_tl "")
    foreach(_a IN LISTS _archs)
      string(REGEX MATCH "^[0-9]+" _n "${_a}")
      if(_n)
        _ddpx_arch_to_torch_form("${_n}" _t)
        list(APPEND _tl "${_t}")
      endif()
    endforeach()
    if(_tl)
      set(TORCH_CUDA_ARCH_LIST "${_tl}" PARENT_SCOPE)
    endif()
  endif()
endfunction()
