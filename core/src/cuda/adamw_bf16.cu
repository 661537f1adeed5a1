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

// The same, four elements a thread: one 16-byte load of p and of g and one 8-byte load of m
// and of v, where one element a thread made four- and two-byte loads (2.4 TB/s on an H200
// against torch's fused AdamW's 3.4). Each element is still update()'s, with its own index in
// the hash, so the bits are the scalar kernel's. p and g 16-byte aligned, m and v 8-byte; the
// last n % 4 elements go to block 0's first threads.
__global__ void adamw_bf16_kernel4(float* __restrict__ p, const float* __restrict__ g,
                                   uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                                   int64_t n, loom::AdamWCoefficients c, uint32_t first_index,
                                   uint32_t key_lo, uint32_t key_hi) {
  const int64_t groups = n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < groups;
       q += stride) {
    const float4 p4 = reinterpret_cast<const float4*>(p)[q];
    const float4 g4 = reinterpret_cast<const float4*>(g)[q];
    const uint2 m4 = reinterpret_cast<const uint2*>(m)[q];
    const uint2 v4 = reinterpret_cast<const uint2*>(v)[q];
    float lp[4] = {p4.x, p4.y, p4.z, p4.w};
    const float lg[4] = {g4.x, g4.y, g4.z, g4.w};
    uint16_t lm[4] = {static_cast<uint16_t>(m4.x), static_cast<uint16_t>(m4.x >> 16),
                      static_cast<uint16_t>(m4.y), static_cast<uint16_t>(m4.y >> 16)};
    uint16_t lv[4] = {static_cast<uint16_t>(v4.x), static_cast<uint16_t>(v4.x >> 16),
                      static_cast<uint16_t>(v4.y), static_cast<uint16_t>(v4.y >> 16)};
    const uint32_t first = first_index + static_cast<uint32_t>(4 * q);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      loom::adamw_bf16::update(lp, lg, lm, lv, j, c, first, key_lo, key_hi);
    reinterpret_cast<float4*>(p)[q] = make_float4(lp[0], lp[1], lp[2], lp[3]);
    reinterpret_cast<uint2*>(m)[q] = make_uint2(lm[0] | (static_cast<uint32_t>(lm[1]) << 16),
                                                lm[2] | (static_cast<uint32_t>(lm[3]) << 16));
    reinterpret_cast<uint2*>(v)[q] = make_uint2(lv[0] | (static_cast<uint32_t>(lv[1]) << 16),
                                                lv[2] | (static_cast<uint32_t>(lv[3]) << 16));
  }
  const int64_t tail = 4 * groups + threadIdx.x;
  if (blockIdx.x == 0 && tail < n)
    loom::adamw_bf16::update(p, g, m, v, tail, c, first_index, key_lo, key_hi);
}

// The weights' stochastic rounding: round_weight in a grid-stride loop (6 bytes an element).
__global__ void round_bf16_kernel(const float* __restrict__ from, uint16_t* __restrict__ into,
                                  int64_t n, uint32_t first_index, uint32_t key_lo,
                                  uint32_t key_hi) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    loom::adamw_bf16::round_weight(from, into, i, first_index, key_lo, key_hi);
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

bool aligned(const void* pointer, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

}  // namespace

namespace loom {

const char* launch_adamw_bf16(int device, float* p, const float* g, uint16_t* m, uint16_t* v,
                              int64_t n, const AdamWCoefficients& c, uint32_t first_index,
                              uint32_t key_lo, uint32_t key_hi, void* stream) {
  if (n <= 0) return nullptr;
  constexpr int kThreads = 256;
  const bool by_four = aligned(p, 16) && aligned(g, 16) && aligned(m, 8) && aligned(v, 8);
  // Enough blocks to fill every multiprocessor several times over; each thread then loops.
  const int64_t per_thread = by_four ? 4 : 1;
  const int64_t wanted = (n / per_thread + kThreads - 1) / kThreads;
  const int64_t most = 32LL * multiprocessors(device);
  const unsigned blocks = static_cast<unsigned>(wanted < 1 ? 1 : (wanted < most ? wanted : most));
  const auto on = static_cast<cudaStream_t>(stream);
  if (by_four)
    adamw_bf16_kernel4<<<blocks, kThreads, 0, on>>>(p, g, m, v, n, c, first_index, key_lo, key_hi);
  else
    adamw_bf16_kernel<<<blocks, kThreads, 0, on>>>(p, g, m, v, n, c, first_index, key_lo, key_hi);
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

const char* launch_round_bf16(int device, const float* from, uint16_t* into, int64_t n,
                              uint32_t first_index, uint32_t key_lo, uint32_t key_hi,
                              void* stream) {
  if (n <= 0) return nullptr;
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int64_t most = 32LL * multiprocessors(device);
  const unsigned blocks = static_cast<unsigned>(wanted < most ? wanted : most);
  round_bf16_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      from, into, n, first_index, key_lo, key_hi);
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace loom
