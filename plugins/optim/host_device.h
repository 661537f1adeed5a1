// host_device.h — what the optim plugin's element headers (adam8bit_element.h,
// adafactor_element.h) need to be read by both the C++ compiler (the CPU kernels) and nvcc (the
// CUDA kernels in cuda/): one spelling of "inline on both sides", and square roots that round
// alike. No LibTorch header: nvcc reads this file.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define LOOM_OPTIM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LOOM_OPTIM_HOST_DEVICE __attribute__((always_inline)) inline
#endif

namespace loom::optim {

// Correctly rounded on both sides: nvcc's default -prec-sqrt=true, as sqrtss / sqrtsd.
LOOM_OPTIM_HOST_DEVICE float optim_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);
#else
  return std::sqrt(x);
#endif
}
LOOM_OPTIM_HOST_DEVICE double optim_sqrt(double x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

}  // namespace loom::optim
