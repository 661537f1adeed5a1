// adam8bit on a GPU: one thread block per quantization block, the CPU kernel's own element code
// (adam8bit_element.h). The tensor ops it replaces made ~25 launches and as many passes per
// slice of 4 M elements (Note [adam8bit's tensor ops in slices]): 10x torch's fused AdamW on an
// H200 (docs/BENCHMARKS.md "Again on an H200, 2026-11-28").
//
// Two passes over each block: the first computes every element's new moments only for the
// block's new absmax; the second computes them again (the same operations on the same inputs,
// so the same bits), updates the parameter and writes the codes. Recomputing reads the block's
// gradient and codes twice, the second time from cache, where keeping the moments would need
// 8 B x block of shared memory (512 KB at the largest block_size). Compiled with --fmad=false.
#include <cuda_runtime.h>

#include "adam8bit_launch.h"

namespace loom::optim {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// The largest of each thread's x over the thread block (kThreads threads), for every thread.
__device__ __forceinline__ float block_max(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_max(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < kThreads / 32 ? scratch[lane] : 0.0f;
  x = warp_max(x);
  __syncthreads();  // scratch is reused by the next call
  return x;
}

__global__ void __launch_bounds__(kThreads) adam8bit_kernel(Adam8bitDeviceTensor t,
                                                            Adam8bitCoefficients c) {
  __shared__ float mcode[256], vcode[256];
  __shared__ float scratch[kThreads / 32];
  for (int i = threadIdx.x; i < 256; i += kThreads) {
    mcode[i] = t.mcode[i];
    vcode[i] = t.vcode[i];
  }
  const int64_t b = blockIdx.x, start = b * t.block;
  const int64_t len = t.n - start < t.block ? t.n - start : t.block;
  const float am = t.am[b], av = t.av[b];  // read by every thread before thread 0 rewrites them
  __syncthreads();
  // Pass 1: the new moments' absmax (max is exact: any order gives the CPU's value).
  float new_am = 0.0f, new_av = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const int64_t k = start + i;
    float p = 0.0f, m = mcode[t.qm[k]] * am, v = vcode[t.qv[k]] * av;
    adamw_element(p, t.g[k], m, v, c);
    new_am = fmaxf(new_am, fabsf(m));
    new_av = fmaxf(new_av, v);
  }
  new_am = block_max(new_am, scratch);
  new_av = block_max(new_av, scratch);
  const float inv_m = new_am > 0 ? 1.0f / new_am : 0.0f;
  const float inv_v = new_av > 0 ? 1.0f / new_av : 0.0f;
  // Pass 2: the same moments again, the parameter, the codes.
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const int64_t k = start + i;
    float p = t.p[k], m = mcode[t.qm[k]] * am, v = vcode[t.qv[k]] * av;
    adamw_element(p, t.g[k], m, v, c);
    t.p[k] = p;
    t.qm[k] = quantize_by_cells(m * inv_m, t.mcells);
    t.qv[k] = quantize_by_cells(v * inv_v, t.vcells);
  }
  if (threadIdx.x == 0) {
    t.am[b] = new_am;
    t.av[b] = new_av;
  }
}

}  // namespace

const char* launch_adam8bit(int /*device*/, const Adam8bitDeviceTensor& t,
                            const Adam8bitCoefficients& c, void* stream) {
  if (t.n <= 0) return nullptr;
  const int64_t blocks = (t.n + t.block - 1) / t.block;
  if (blocks > 0x7fffffffLL) return "more than 2^31 - 1 quantization blocks in one tensor";
  adam8bit_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                    static_cast<cudaStream_t>(stream)>>>(t, c);
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace loom::optim
