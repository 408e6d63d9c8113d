# Writes a C++ header holding a Metal source file as a string, so the host compiles the kernel at run time
# and the build needs no Xcode `metal` tool.
#   cmake -DINPUT=gated_group_rms_norm.metal -DOUTPUT=<dir>/gated_group_rms_norm_metal_source.h -P embed_msl.cmake
if(NOT INPUT OR NOT OUTPUT)
  message(FATAL_ERROR "embed_msl.cmake needs -DINPUT=<file.metal> -DOUTPUT=<header>")
endif()
file(READ "${INPUT}" _msl)
if(_msl MATCHES "\\)mambafuse_msl\"")
  message(FATAL_ERROR "${INPUT} contains the raw-string delimiter )mambafuse_msl\"")
endif()
get_filename_component(_name "${INPUT}" NAME)
# Written only when it changes, so an unchanged kernel does not rebuild the host.
set(_header "// Generated from ${_name} by embed_msl.cmake; do not edit.\n#pragma once\n\nnamespace mambafuse {\ninline constexpr char kGatedGroupRMSNormMsl[] = R\"mambafuse_msl(${_msl})mambafuse_msl\";\n}  // namespace mambafuse\n")
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" _old)
  if(_old STREQUAL _header)
    return()
  endif()
endif()
file(WRITE "${OUTPUT}" "${_header}")
