# ddpx_pin_torch_libraries(<torch root>): makes find_package(Torch) use the torch at <torch root>
# (a pip torch: <root>/share/cmake/Torch, <root>/lib) and nothing of another torch. On a machine
# that also has a system torch (Debian's libtorch-dev beside a pip torch), TorchConfig.cmake
# would otherwise find the system's Caffe2 config (find_package searches system prefixes before
# its PATHS hint) and the system's libtorch.so / libc10_cuda.so (find_library does the same),
# and link two torches into one program.
# Called before find_package(Torch) by ddpx's build and by ddpx's installed package config.
function(ddpx_pin_torch_libraries torch_root)
  if(NOT EXISTS "${torch_root}/share/cmake/Torch/TorchConfig.cmake" OR NOT EXISTS "${torch_root}/lib")
    return()
  endif()
  set(Torch_DIR "${torch_root}/share/cmake/Torch" CACHE PATH "The Torch package config" FORCE)
  set(Caffe2_DIR "${torch_root}/share/cmake/Caffe2" CACHE PATH "torch's Caffe2 config" FORCE)
  foreach(_pair "TORCH_LIBRARY:torch" "C10_CUDA_LIBRARY:c10_cuda")
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
