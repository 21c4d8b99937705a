# Helpers for using one torch, and nothing of another, in ddpx's build and in ddpx's installed
# package config (both include this file).
#
# ddpx_pin_torch_libraries(<torch root>): makes find_package(Torch) use the torch at <torch root>
# (a pip torch: <root>/share/cmake/Torch, <root>/lib) and nothing of another torch. On a machine
# that also has a system torch (Debian's libtorch-dev beside a pip torch), TorchConfig.cmake
# would otherwise find the system's Caffe2 config (find_package searches system prefixes before
# its PATHS hint) and the system's libtorch.so / libc10.so / libc10_cuda.so (find_library does
# the same: torch 2.15's config finds c10 by find_library, 2.11's through its Caffe2 targets),
# and link two torches into one program.
# Called before find_package(Torch).
function(ddpx_pin_torch_libraries torch_root)
  if(NOT EXISTS "${torch_root}/share/cmake/Torch/TorchConfig.cmake" OR NOT EXISTS "${torch_root}/lib")
    return()
  endif()
  set(Torch_DIR "${torch_root}/share/cmake/Torch" CACHE PATH "The Torch package config" FORCE)
  set(Caffe2_DIR "${torch_root}/share/cmake/Caffe2" CACHE PATH "torch's Caffe2 config" FORCE)
  foreach(_pair "TORCH_LIBRARY:torch" "C10_CUDA_LIBRARY:c10_cuda" "c10_LIBRARY:c10")
    string(REPLACE ":" ";" _pair "${_pair}")
    list(GET _pair 0 _var)
    list(GET _pair 1 _name)
    # A value cached by an earlier configure may point at another torch: look again.
    unset(${_var} CACHE)
    find_library(${_var} ${_name} PATHS "${torch_root}/lib" NO_DEFAULT_PATH)
    if(NOT ${_var})
      unset(${_var} CACHE)  # absent (a CPU torch has no c10_cuda): let TorchConfig decide
    endif()
  endforeach()
endfunction()

# ddpx_fix_torch_link(<torch root>): after find_package(Torch). A pip torch's libraries find
# their CUDA libraries (libnccl.so.2, libcudnn, ...) in the nvidia-* wheels beside it, through
# their own RPATH. At run time that RPATH is searched first; at link time GNU ld searches the
# program's -rpath directories first, and CUDA::cudart puts the toolkit's lib directory there,
# whose libnccl.so.2 may be older than the wheel's (torch 2.15 needs NCCL 2.30's symbols, the
# CUDA 13.0 toolkit has 2.28). -rpath-link to the wheels' directories makes link time resolve as
# run time does. Nothing changes for a system torch (no wheels beside it).
function(ddpx_fix_torch_link torch_root)
  if(NOT TARGET torch)
    return()
  endif()
  file(GLOB _wheel_libs LIST_DIRECTORIES true "${torch_root}/../nvidia/*/lib"
    "${torch_root}/../nvidia/cu*/lib")
  list(REMOVE_DUPLICATES _wheel_libs)
  set(_dirs "")
  foreach(_d IN LISTS _wheel_libs)
    if(IS_DIRECTORY "${_d}")
      get_filename_component(_d "${_d}" ABSOLUTE)
      list(APPEND _dirs "${_d}")
    endif()
  endforeach()
  if(_dirs)
    string(REPLACE ";" ":" _joined "${_dirs}")
    set_property(TARGET torch APPEND PROPERTY INTERFACE_LINK_OPTIONS
      "LINKER:-rpath-link,${_joined}")
  endif()
endfunction()

# ddpx_torch_cxx_standard(<out var>): the C++ language level for code that includes torch's
# headers: 20 when torch's package requires it (torch >= 2.14 puts cxx_std_20 on its target, or
# -std=c++20 when the compiler reports no features), else 17. The one place this is decided:
# ddpx's build uses it for its targets and exports it to consumers as a compile feature, so a
# consumer that asks for C++17 gets C++20 exactly when its torch needs it.
function(ddpx_torch_cxx_standard out)
  set(_std 17)
  if(TARGET torch)
    get_target_property(_features torch INTERFACE_COMPILE_FEATURES)
    get_target_property(_options torch INTERFACE_COMPILE_OPTIONS)
    if("cxx_std_20" IN_LIST _features OR "${_options}" MATCHES "std[=:]c\\+\\+20")
      set(_std 20)
    endif()
  endif()
  set(${out} ${_std} PARENT_SCOPE)
endfunction()
