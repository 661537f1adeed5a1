# Finds LibTorch inside the project's Python venv (the PyPI torch wheel) and wraps it once into
# the interface target loom::torch that everything else links. The wheel is the CUDA 13.0 build:
# with the CUDA toolkit present, CUDA code compiles and links even where no GPU exists; without
# it, loom builds for the CPU (Note [LibTorch without the CUDA toolkit] in LoomFindTorch.cmake).
set(LOOM_PYTHON "${CMAKE_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH
    "Python of the venv that holds the torch wheel (scripts/setup makes it)")
if(NOT EXISTS "${LOOM_PYTHON}")
  message(FATAL_ERROR "loom: no Python at LOOM_PYTHON=${LOOM_PYTHON}. Run scripts/setup first, "
                      "or pass -DLOOM_PYTHON=/path/to/venv/bin/python.")
endif()
execute_process(
  COMMAND "${LOOM_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path, end='')"
  OUTPUT_VARIABLE LOOM_TORCH_PREFIX RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "loom: ${LOOM_PYTHON} cannot import torch. Run scripts/setup.")
endif()
list(APPEND CMAKE_PREFIX_PATH "${LOOM_TORCH_PREFIX}")
set(LOOM_CUDA auto CACHE STRING
    "CUDA support: auto (where a CUDA toolkit is found), on (Torch's config insists), off")
set_property(CACHE LOOM_CUDA PROPERTY STRINGS auto on off)
include(LoomFindTorch)  # Note [LibTorch without the CUDA toolkit]
loom_find_torch(REQUIRED)

add_library(loom_torch INTERFACE)
add_library(loom::torch ALIAS loom_torch)
# TORCH_LIBRARIES names imported targets (Torch's `torch` and `torch_library`, or without the
# toolkit loom's own `loom_libtorch_cpu`) plus library files; an installed loom re-finds Torch
# (loomConfig.cmake), so the names resolve there too.
# Note [Relocatable package]: the wheel's library files and its libgomp are this machine's
# paths, so they link the build tree only; an installed loom re-finds LibTorch wherever its
# user has it and adds them back (loomConfig.cmake), so the installed package can move.
foreach(_lib ${TORCH_LIBRARIES})
  target_link_libraries(loom_torch INTERFACE $<BUILD_INTERFACE:${_lib}>)
endforeach()
# Note [LibTorch's std::filesystem]: the wheel's libtorch.so exports its own copies of 64
# std::filesystem functions, some broken (remove_all(path, error_code&) jumps to address 0).
# The dynamic linker resolves symbols in load order, and libtorch normally loads before
# libstdc++, so every loom binary lists libstdc++ first among its dependencies.
target_link_options(loom_torch INTERFACE "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
separate_arguments(_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
target_compile_options(loom_torch INTERFACE ${_torch_flags})
# Note [OpenMP]: ATen's at::parallel_for is inline code over OpenMP (the wheel is built with
# AT_PARALLEL_OPENMP=1). Compiled without -fopenmp its `#pragma omp parallel` is ignored and
# every loop of loom's own kernels (the update rules) runs on one thread, whatever the intra-op
# thread count. So loom compiles with -fopenmp and links the wheel's own libgomp (the runtime
# LibTorch's threads already use: one thread pool, one set of OMP_* settings), not the
# system's: no -fopenmp at link time, which would add the system's -lgomp.
target_compile_options(loom_torch INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-fopenmp>)
find_library(LOOM_TORCH_GOMP NAMES libgomp.so.1 PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
if(NOT LOOM_TORCH_GOMP)
  message(FATAL_ERROR "loom: the torch wheel's libgomp.so.1 is not in ${TORCH_INSTALL_PREFIX}/lib")
endif()
target_link_libraries(loom_torch INTERFACE $<BUILD_INTERFACE:${LOOM_TORCH_GOMP}>)
if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  set(LOOM_WITH_CUDA ON)
  target_compile_definitions(loom_torch INTERFACE LOOM_WITH_CUDA=1)
else()
  set(LOOM_WITH_CUDA OFF)
endif()
# Note [CUDA loaded on demand] (core/src/cuda_runtime.cpp): loom::torch links LibTorch's CPU
# half only; loom::torch_cuda adds the CUDA half (libtorch_cuda, libc10_cuda, NCCL: half a
# second of start-up each process pays) for the few targets whose code calls CUDA APIs itself.
add_library(loom_torch_cuda INTERFACE)
add_library(loom::torch_cuda ALIAS loom_torch_cuda)
target_link_libraries(loom_torch_cuda INTERFACE loom_torch)
foreach(_lib ${LOOM_TORCH_CUDA_LIBRARIES})
  target_link_libraries(loom_torch_cuda INTERFACE $<BUILD_INTERFACE:${_lib}>)
endforeach()
# Installed binaries and plugins find LibTorch in the venv it was built against, by that venv's
# real folder: the clone's .venv link may be removed with the clone, or re-pointed at another
# pin's venv, whose LibTorch would not match the binaries.
get_filename_component(LOOM_TORCH_LIBDIR "${TORCH_INSTALL_PREFIX}/lib" REALPATH)
if(LOOM_WITH_CUDA)
  message(STATUS "loom: LibTorch from ${LOOM_TORCH_PREFIX} "
                 "(CUDA build: ON; nvcc: ${LOOM_CUDA_NVCC})")
else()
  message(STATUS "loom: LibTorch from ${LOOM_TORCH_PREFIX} (CUDA build: OFF, "
                 "LOOM_CUDA=${LOOM_CUDA}: no CUDA toolkit used; the GPU code compiles out)")
endif()
