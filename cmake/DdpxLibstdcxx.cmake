# ddpx._C must use the libstdc++ that Python and torch have loaded, as a shared library. A
# compiler that links libstdc++ statically into shared libraries (-static-libstdc++ in the link
# flags, or a toolchain whose specs add it) puts a second copy inside the module, whose iostreams
# and locale facets then share the process with the shared copy's: a SIGSEGV in PowerSGDState's
# constructor (`std::ostringstream << int64_t`, libstdc++'s code inside ddpx._C) was blamed on
# that, on a machine whose first g++ linked so. The checks here refuse such a build with the
# reason, instead of a module that may crash later.
#
# In the project:
#   ddpx_require_shared_libstdcxx()   at configure time: builds a small shared library with the
#                                     module's compiler and flags and fails configure unless it
#                                     needs libstdc++.so (seconds, before torch is looked for);
#   ddpx_check_module_libstdcxx(tgt)  after each link of the module: the same on the real file,
#                                     which is removed (so the next build links it again) when
#                                     it carries its own copy.
# As a script (scripts/gpu_check.sh picks its compiler with it):
#   cmake -DDDPX_PROBE_CXX=<compiler> [-DDDPX_PROBE_FLAGS=<flags>] -P cmake/DdpxLibstdcxx.cmake
#   cmake -DDDPX_CHECK_MODULE=<file.so> -P cmake/DdpxLibstdcxx.cmake
# exit 0 when libstdc++ is linked as a shared library, 1 with the reason when it is not.
#
# ELF only (Linux): elsewhere the checks do nothing. A probe that cannot be built or read (no
# readelf) is reported and not held against the build: the module's own check still runs.

set(_DDPX_LIBSTDCXX_SELF "${CMAKE_CURRENT_LIST_FILE}")

# <out> = the command that prints an ELF file's dynamic section, NEEDED entries included
# (readelf -d, llvm-readelf -d, or objdump -p), as a list; empty if there is none.
function(_ddpx_dynamic_section_tool out)
  if(CMAKE_READELF)
    set(${out} "${CMAKE_READELF};-d" PARENT_SCOPE)
    return()
  endif()
  find_program(DDPX_READELF NAMES readelf llvm-readelf)
  if(DDPX_READELF)
    set(${out} "${DDPX_READELF};-d" PARENT_SCOPE)
    return()
  endif()
  if(NOT CMAKE_OBJDUMP)
    find_program(CMAKE_OBJDUMP NAMES objdump llvm-objdump)
  endif()
  if(CMAKE_OBJDUMP)
    set(${out} "${CMAKE_OBJDUMP};-p" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

# <out> = YES when the ELF file <file> needs libstdc++.so, NO when not, "" when unknown (no
# tool, or the tool failed; <reason> then says why).
function(_ddpx_elf_needs_libstdcxx file out reason)
  _ddpx_dynamic_section_tool(_tool)
  if(NOT _tool)
    set(${out} "" PARENT_SCOPE)
    set(${reason} "neither readelf nor objdump was found" PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND ${_tool} "${file}" RESULT_VARIABLE _rc OUTPUT_VARIABLE _dyn
    ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0)
    set(${out} "" PARENT_SCOPE)
    set(${reason} "${_tool} ${file} failed: ${_err}" PARENT_SCOPE)
  elseif(_dyn MATCHES "NEEDED[^\n]*libstdc\\+\\+\\.so")
    set(${out} YES PARENT_SCOPE)
  else()
    set(${out} NO PARENT_SCOPE)
  endif()
endfunction()

# <out> = YES / NO / "" (unknown, <reason> says why): whether <compiler> with <flags> (one
# string, as in CMAKE_CXX_FLAGS) links libstdc++ into a shared library as a shared library.
# The probe uses an ostringstream, the code that crashed, so that nothing of libstdc++ is
# left out of the link for being unused.
function(_ddpx_probe_libstdcxx compiler flags workdir out reason)
  file(REMOVE_RECURSE "${workdir}")
  file(MAKE_DIRECTORY "${workdir}")
  file(WRITE "${workdir}/probe.cpp" "#include <sstream>\n#include <string>\n"
    "std::string ddpx_probe(long v) {\n  std::ostringstream os;\n  os << v;\n"
    "  return os.str();\n}\n")
  separate_arguments(_flags UNIX_COMMAND "${flags}")
  execute_process(COMMAND "${compiler}" ${_flags} -shared -fPIC -o probe.so probe.cpp
    WORKING_DIRECTORY "${workdir}" RESULT_VARIABLE _rc OUTPUT_VARIABLE _log ERROR_VARIABLE _log)
  if(NOT _rc EQUAL 0)
    set(${out} "" PARENT_SCOPE)
    set(${reason} "the probe library did not build: ${_log}" PARENT_SCOPE)
    return()
  endif()
  _ddpx_elf_needs_libstdcxx("${workdir}/probe.so" _needs _why)
  set(${out} "${_needs}" PARENT_SCOPE)
  set(${reason} "${_why}" PARENT_SCOPE)
endfunction()

# What a failure says: the fix, whichever check found it.
set(_DDPX_LIBSTDCXX_FIX "ddpx._C must link libstdc++ as a shared library (the one Python and "
  "torch have loaded): a second, static copy inside the module can crash where the two copies' "
  "iostreams meet. Drop -static-libstdc++ from the flags (CMAKE_MODULE_LINKER_FLAGS, "
  "CMAKE_CXX_FLAGS, LDFLAGS), or choose a compiler that links it shared "
  "(-DCMAKE_CXX_COMPILER=..., e.g. the system's /usr/bin/g++)")
string(REPLACE ";" "" _DDPX_LIBSTDCXX_FIX "${_DDPX_LIBSTDCXX_FIX}")

function(ddpx_require_shared_libstdcxx)
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  # The module's link: the compile flags, then the MODULE link flags (pybind11_add_module and
  # Python_add_library both make a MODULE library), each with the build type's own.
  set(_flags "${CMAKE_CXX_FLAGS} ${CMAKE_MODULE_LINKER_FLAGS}")
  if(CMAKE_BUILD_TYPE)
    string(TOUPPER "${CMAKE_BUILD_TYPE}" _cfg)
    string(APPEND _flags " ${CMAKE_CXX_FLAGS_${_cfg}} ${CMAKE_MODULE_LINKER_FLAGS_${_cfg}}")
  endif()
  string(STRIP "${_flags}" _flags)
  _ddpx_probe_libstdcxx("${CMAKE_CXX_COMPILER}" "${_flags}"
    "${CMAKE_BINARY_DIR}/CMakeFiles/ddpx_libstdcxx_probe" _needs _why)
  if(_needs STREQUAL "NO")
    message(FATAL_ERROR "ddpx: ${CMAKE_CXX_COMPILER} with the flags \"${_flags}\" links "
      "libstdc++ statically into shared libraries (a probe library does not need libstdc++.so). "
      "${_DDPX_LIBSTDCXX_FIX}.")
  elseif(_needs STREQUAL "YES")
    message(STATUS "ddpx: ${CMAKE_CXX_COMPILER} links libstdc++ as a shared library")
  else()
    message(STATUS "ddpx: could not check how ${CMAKE_CXX_COMPILER} links libstdc++ (${_why}); "
      "the module is checked after its link")
  endif()
endfunction()

function(ddpx_check_module_libstdcxx target)
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND "${CMAKE_COMMAND}" "-DDDPX_CHECK_MODULE=$<TARGET_FILE:${target}>"
      "-DCMAKE_READELF=${CMAKE_READELF}" "-DCMAKE_OBJDUMP=${CMAKE_OBJDUMP}"
      -P "${_DDPX_LIBSTDCXX_SELF}"
    VERBATIM)
endfunction()

# ---- script mode -------------------------------------------------------------------------------
if(CMAKE_SCRIPT_MODE_FILE AND CMAKE_SCRIPT_MODE_FILE STREQUAL _DDPX_LIBSTDCXX_SELF)
  if(DDPX_CHECK_MODULE)
    _ddpx_elf_needs_libstdcxx("${DDPX_CHECK_MODULE}" _needs _why)
    if(_needs STREQUAL "NO")
      # Removed, so that the next build links it again instead of taking it as up to date.
      file(REMOVE "${DDPX_CHECK_MODULE}")
      message(FATAL_ERROR "ddpx: ${DDPX_CHECK_MODULE} does not need libstdc++.so: it carries a "
        "static copy of libstdc++ (removed). ${_DDPX_LIBSTDCXX_FIX}.")
    elseif(NOT _needs)
      message(STATUS "ddpx: could not check how ${DDPX_CHECK_MODULE} links libstdc++ (${_why})")
    endif()
  elseif(DDPX_PROBE_CXX)
    string(RANDOM LENGTH 8 _tag)
    set(_dir "$ENV{TMPDIR}")
    if(NOT _dir)
      set(_dir /tmp)
    endif()
    _ddpx_probe_libstdcxx("${DDPX_PROBE_CXX}" "${DDPX_PROBE_FLAGS}" "${_dir}/ddpx-libstdcxx-${_tag}"
      _needs _why)
    file(REMOVE_RECURSE "${_dir}/ddpx-libstdcxx-${_tag}")
    if(_needs STREQUAL "YES")
      message(STATUS "ddpx: ${DDPX_PROBE_CXX} links libstdc++ as a shared library")
    elseif(_needs STREQUAL "NO")
      message(FATAL_ERROR "ddpx: ${DDPX_PROBE_CXX} links libstdc++ statically into shared "
        "libraries")
    else()
      message(FATAL_ERROR "ddpx: could not check how ${DDPX_PROBE_CXX} links libstdc++: ${_why}")
    endif()
  else()
    message(FATAL_ERROR "ddpx: set DDPX_CHECK_MODULE=<file> or DDPX_PROBE_CXX=<compiler>")
  endif()
endif()
