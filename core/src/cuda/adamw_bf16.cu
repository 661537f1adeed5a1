// AdamW over bf16 moments on a GPU: the CPU kernel's element (adamw_bf16_element.h) in a
// grid-stride loop. One pass over p, g, m, v (20 bytes an element) where the tensor ops it
// replaces made ~40 passes over int64 temporaries (Note [Stochastic rounding of the state] in
// ../adamw.cpp; the numbers in docs/BENCHMARKS.md "Again on an H200, 2026-11-28").
// Compiled with --fmad=false (core/CMakeLists.txt) so it rounds as the CPU kernel does.
#include <cuda_runtime.h>

#include <atomic>

#include "../adamw_bf16_element.h"
#include "adamw_bf16_launch.h"

namespace {

__global__ void adamw_bf16_kernel(float* __restrict__ p, const float* __restrict__ g,
                                  uint16_t* __restrict__ m, uint16_t* __restrict__ v, int64_t n,
                                  loom::AdamWCoefficients c, uint32_t first_index,
                                  uint32_t key_lo, uint32_t key_hi) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    loom::adamw_bf16::update(p, g, m, v, i, c, first_index, key_lo, key_hi);
}

// The multiprocessors of each device, asked once (cudaDeviceGetAttribute is cheap, but not free
// at a launch per tensor and step).
int multiprocessors(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {};
  if (device < 0 || device >= kDevices) return 132;
  int count = known[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        count <= 0)
      count = 132;
    known[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

}  // namespace

namespace loom {

const char* launch_adamw_bf16(int device, float* p, const float* g, uint16_t* m, uint16_t* v,
                              int64_t n, const AdamWCoefficients& c, uint32_t first_index,
                              uint32_t key_lo, uint32_t key_hi, void* stream) {
  if (n <= 0) return nullptr;
  constexpr int kThreads = 256;
  // Enough blocks to fill every multiprocessor several times over; each thread then loops.
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int64_t most = 32LL * multiprocessors(device);
  adamw_bf16_kernel<<<static_cast<int>(wanted < most ? wanted : most), kThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(p, g, m, v, n, c, first_index,
                                                           key_lo, key_hi);
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace loom
