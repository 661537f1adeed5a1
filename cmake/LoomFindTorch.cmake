# loom_find_torch(REQUIRED|QUIET): LibTorch from the torch wheel that CMAKE_PREFIX_PATH or
# Torch_DIR points at, as find_package(Torch) gives it: Torch_FOUND, TORCH_LIBRARIES,
# TORCH_INSTALL_PREFIX, Torch_VERSION, TORCH_CXX_FLAGS. loom's build (LoomTorch.cmake) and its
# installed package (loomConfig.cmake) both call it, so a plugin finds LibTorch as loom did.
#
# Note [LibTorch without the CUDA toolkit]: the PyPI wheel is a CUDA build, and its
# TorchConfig.cmake (through Caffe2Config.cmake and public/cuda.cmake) stops with a fatal error
# where it finds no CUDA toolkit, although the wheel runs on any CPU machine (its CUDA runtime
# libraries come as pip packages). So unless a toolkit is found, by the search Torch's FindCUDA
# makes, loom never runs TorchConfig: it imports the wheel's CPU half itself — libtorch_cpu.so
# and libc10.so, the include folders, and torch_cpu's compile definitions read from the wheel's
# own export file — and links no CUDA library, so LOOM_WITH_CUDA is off and the GPU code (CUDA
# memory statistics, NCCL, pinned preloading) compiles out. libtorch.so is left out too: in the
# CUDA wheel it holds no LibTorch code, only the dependency that loads libtorch_cuda.so, and a
# loom that cannot account for a GPU must not see one. With a toolkit, TorchConfig runs as it
# always did. LOOM_CUDA (auto, on, off; a CMake variable) overrides the search.

# The nvcc Torch's FindCUDA would take (Modules_CUDA_fix/upstream/FindCUDA.cmake: the folders
# the environment names, then PATH and the system prefixes' cuda/bin), if it runs and has the
# toolkit's headers beside it; else empty.
function(loom_cuda_toolkit_nvcc out)
  set(${out} "" PARENT_SCOPE)
  if(CUDA_TOOLKIT_ROOT_DIR)
    set(nvcc "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc")
  else()
    find_program(nvcc NAMES nvcc PATHS ENV CUDA_TOOLKIT_ROOT ENV CUDA_PATH ENV CUDA_BIN_PATH
                 PATH_SUFFIXES bin bin64 NO_DEFAULT_PATH NO_CACHE)
    if(NOT nvcc)
      find_program(nvcc NAMES nvcc PATHS /opt/cuda/bin PATH_SUFFIXES cuda/bin NO_CACHE)
    endif()
  endif()
  if(NOT EXISTS "${nvcc}")
    return()
  endif()
  # A wrapper left behind by a removed toolkit is no toolkit.
  execute_process(COMMAND "${nvcc}" --version RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  get_filename_component(root "${nvcc}" DIRECTORY)
  get_filename_component(root "${root}" DIRECTORY)
  if(rc EQUAL 0 AND EXISTS "${root}/include/cuda_runtime_api.h")
    set(${out} "${nvcc}" PARENT_SCOPE)
  endif()
endfunction()

# The imported target loom_libtorch_cpu (libtorch_cpu.so, linking libc10.so) with LibTorch's
# include folders and compile definitions, once.
function(loom_torch_cpu_target lib_torch_cpu lib_c10 include_dirs definitions)
  if(TARGET loom_libtorch_cpu)
    return()
  endif()
  add_library(loom_libc10 SHARED IMPORTED)
  set_target_properties(loom_libc10 PROPERTIES IMPORTED_LOCATION "${lib_c10}")
  add_library(loom_libtorch_cpu SHARED IMPORTED)
  set_target_properties(loom_libtorch_cpu PROPERTIES
    IMPORTED_LOCATION "${lib_torch_cpu}"
    INTERFACE_INCLUDE_DIRECTORIES "${include_dirs}"
    INTERFACE_COMPILE_DEFINITIONS "${definitions}"
    INTERFACE_LINK_LIBRARIES loom_libc10)
endfunction()

# The wheel's CPU libraries as the imported target loom_libtorch_cpu (Note [LibTorch without
# the CUDA toolkit]).
function(loom_import_torch_cpu mode)
  set(Torch_FOUND FALSE PARENT_SCOPE)
  find_file(config TorchConfig.cmake
    HINTS ${Torch_DIR} ENV Torch_DIR ${CMAKE_PREFIX_PATH} ENV CMAKE_PREFIX_PATH
    PATH_SUFFIXES Torch share/cmake/Torch NO_DEFAULT_PATH NO_CACHE)
  if(NOT config)
    if(mode STREQUAL "REQUIRED")
      message(FATAL_ERROR "loom: no TorchConfig.cmake in Torch_DIR or CMAKE_PREFIX_PATH")
    endif()
    return()
  endif()
  get_filename_component(dir "${config}" DIRECTORY)
  # As TorchConfig.cmake: the wheel's root is three folders up, unless the environment says.
  if(DEFINED ENV{TORCH_INSTALL_PREFIX})
    set(prefix "$ENV{TORCH_INSTALL_PREFIX}")
  else()
    get_filename_component(prefix "${dir}/../../.." ABSOLUTE)
  endif()
  include("${dir}/TorchConfigVersion.cmake")  # PACKAGE_VERSION
  set(export_file "${dir}/../Caffe2/Caffe2Targets.cmake")
  find_library(lib_torch_cpu NAMES torch_cpu PATHS "${prefix}/lib" NO_DEFAULT_PATH NO_CACHE)
  find_library(lib_c10 NAMES c10 PATHS "${prefix}/lib" NO_DEFAULT_PATH NO_CACHE)
  if(NOT lib_torch_cpu OR NOT lib_c10 OR NOT EXISTS "${export_file}")
    if(mode STREQUAL "REQUIRED")
      message(FATAL_ERROR "loom: the torch wheel at ${prefix} lacks lib/libtorch_cpu.so, "
                          "lib/libc10.so or ${export_file}")
    endif()
    return()
  endif()
  # What the wheel was built with that its headers test (USE_DISTRIBUTED, USE_C10D_GLOO, ...).
  file(READ "${export_file}" exported)
  set(definitions "")
  set(block "set_target_properties\\(torch_cpu PROPERTIES[^)]*")
  if(exported MATCHES "${block}INTERFACE_COMPILE_DEFINITIONS \"([^\"]*)\"")
    set(definitions "${CMAKE_MATCH_1}")
  endif()
  set(include_dirs "${prefix}/include;${prefix}/include/torch/csrc/api/include")
  loom_torch_cpu_target("${lib_torch_cpu}" "${lib_c10}" "${include_dirs}" "${definitions}")
  set(Torch_FOUND TRUE PARENT_SCOPE)
  set(TORCH_FOUND TRUE PARENT_SCOPE)
  set(Torch_VERSION "${PACKAGE_VERSION}" PARENT_SCOPE)
  set(TORCH_INSTALL_PREFIX "${prefix}" PARENT_SCOPE)
  set(TORCH_INCLUDE_DIRS "${include_dirs}" PARENT_SCOPE)
  set(TORCH_LIBRARIES loom_libtorch_cpu PARENT_SCOPE)
  set(TORCH_CXX_FLAGS "" PARENT_SCOPE)
endfunction()

# Note [CUDA loaded on demand] (core/src/cuda_runtime.h): after Torch's own config ran, the
# imported target loom_libtorch_cpu links only libtorch_cpu and libc10 but compiles with
# everything the whole `torch` target gives (its CPU and CUDA halves' definitions, the CUDA
# toolkit's headers), so a TU compiles the same whichever half its target links.
function(loom_torch_cpu_half_of_cuda_build)
  set(definitions "")
  foreach(half torch_cpu torch_cuda)
    get_target_property(defs ${half} INTERFACE_COMPILE_DEFINITIONS)
    if(defs)
      list(APPEND definitions ${defs})
    endif()
  endforeach()
  set(include_dirs ${TORCH_INCLUDE_DIRS})
  if(TARGET CUDA::cudart)
    get_target_property(cuda_include CUDA::cudart INTERFACE_INCLUDE_DIRECTORIES)
    if(cuda_include)
      list(APPEND include_dirs ${cuda_include})
    endif()
  endif()
  get_target_property(lib_torch_cpu torch_cpu LOCATION)
  get_target_property(lib_c10 c10 LOCATION)
  loom_torch_cpu_target("${lib_torch_cpu}" "${lib_c10}" "${include_dirs}" "${definitions}")
endfunction()

# A macro: find_package's results land in the caller's scope, as they did before.
macro(loom_find_torch mode)
  string(TOLOWER "${LOOM_CUDA}" _loom_cuda)
  if(_loom_cuda STREQUAL "" OR _loom_cuda STREQUAL "auto")
    loom_cuda_toolkit_nvcc(LOOM_CUDA_NVCC)
  elseif(_loom_cuda STREQUAL "on")
    set(LOOM_CUDA_NVCC "the one Torch's config finds (LOOM_CUDA=on)")
  elseif(_loom_cuda STREQUAL "off")
    set(LOOM_CUDA_NVCC "")
  else()
    message(FATAL_ERROR "loom: LOOM_CUDA is auto, on or off, not '${LOOM_CUDA}'")
  endif()
  if(LOOM_CUDA_NVCC)
    # The GPUs loom's own .cu files are compiled for (Note [loom's own CUDA kernels]): Turing to
    # Hopper as machine code, and Hopper's PTX, which the driver compiles for later GPUs.
    if(NOT DEFINED TORCH_CUDA_ARCH_LIST)
      set(TORCH_CUDA_ARCH_LIST "7.5;8.0;8.6;8.9;9.0+PTX")
    endif()
    find_package(Torch ${mode})
    # Note [CUDA loaded on demand]: everything links the CPU half; what needs the CUDA half
    # (libloom_cuda, the preload plugin, the GPU tests) links LOOM_TORCH_CUDA_LIBRARIES.
    if(Torch_FOUND)
      set(LOOM_TORCH_CUDA_LIBRARIES ${TORCH_LIBRARIES})
      loom_torch_cpu_half_of_cuda_build()
      set(TORCH_LIBRARIES loom_libtorch_cpu)
    endif()
  else()
    set(LOOM_TORCH_CUDA_LIBRARIES "")
    loom_import_torch_cpu(${mode})
  endif()
endmacro()
