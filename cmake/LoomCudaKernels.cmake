# Note [loom's own CUDA kernels]: most of loom's GPU work is LibTorch's kernels, but where an
# operation has no ATen kernel and tensor ops would make tens of passes over memory (adamw's
# bf16 state with stochastic rounding, core/src/cuda/adamw_bf16.cu), loom compiles its own,
# into libloom_cuda_kernels.so, which libloom_cuda.so calls (Note [CUDA loaded on demand]). Each such kernel runs the CPU kernel's
# per-element code from a header both compilers read, so the CPU tests test its arithmetic and
# the GPU tests hold the two bitwise equal. They need the CUDA compiler: with a CUDA build of
# LibTorch but no usable nvcc (LOOM_CUDA=on without a toolkit on the path), LOOM_CUDA_KERNELS is
# off and those operations keep their tensor-op paths. The CUDA runtime is linked statically
# into libloom_cuda_kernels.so, as NCCL links it, so nothing beyond what LibTorch loads is looked up at
# run time; the kernels run on LibTorch's streams.
set(LOOM_CUDA_KERNELS OFF)
if(LOOM_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS "${LOOM_CUDA_NVCC}")
    set(CMAKE_CUDA_COMPILER "${LOOM_CUDA_NVCC}")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The architectures are TORCH_CUDA_ARCH_LIST's (LoomFindTorch.cmake): Torch's config turns
    # it into CMAKE_CUDA_FLAGS and sets CMAKE_CUDA_ARCHITECTURES off.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    set(LOOM_CUDA_KERNELS ON)
    message(STATUS "loom: CUDA kernels ON (${CMAKE_CUDA_COMPILER}, architectures "
                   "${TORCH_CUDA_ARCH_LIST})")
  else()
    message(WARNING "loom: a CUDA build of LibTorch but no CUDA compiler: loom's own CUDA "
                    "kernels compile out and their operations use tensor ops on a GPU")
  endif()
endif()
