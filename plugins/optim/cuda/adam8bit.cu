// adam8bit on a GPU: the CPU kernel's own element code (adam8bit_element.h) per element. The
// tensor ops it replaces made ~25 launches and as many passes per slice of 4 M elements (Note
// [adam8bit's tensor ops in slices]): 10x torch's fused AdamW on an H200 (docs/BENCHMARKS.md
// "Again on an H200, 2026-11-28").
//
// Note [adam8bit's CUDA kernel in teams]: a team of block_size / 8 threads takes one
// quantization block, eight consecutive elements a thread, held in registers from the
// dequantized moments to the new codes: the block's new absmax (a max, exact in any order) is
// reduced across the team by warp shuffles (and shared memory past one warp), and the moments
// are quantized from the registers, so each element is read once and written once. The code
// tables and the one-step cell tables (Note [Quantize in one step], 57 KB) sit in shared memory,
// loaded once per thread block: the thread blocks stay resident and loop over the quantization
// blocks. The first kernel (one thread block a quantization block, the moments computed twice,
// the cell tables read through L1) moved 18 B a parameter at 1.05 TB/s on an H200, 0.48x torch's
// fused AdamW; it stays for block sizes past 8192 (1024 threads in a team). Every path is
// compiled with --fmad=false, so the bits are the CPU kernel's.
#include <cuda_runtime.h>

#include <atomic>

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

// ---- Note [adam8bit's CUDA kernel in teams] ----
constexpr int kPerThread = 8;
constexpr int kCellInts = 2 * kStepCells;  // one map's cell table
// Shared memory: both maps' 256 codes, then both cell tables.
constexpr size_t kTeamSharedBytes = 2 * 256 * sizeof(float) + 2 * kCellInts * sizeof(int32_t);

// The largest x over the team's T threads, for each of them. T <= 32: the team is part of one
// warp and xor-shuffles with offsets below T stay inside it. T > 32: warp maxima through shared
// memory (`scratch`, one float a warp of the thread block). Every thread of the block calls it.
template <int T>
__device__ __forceinline__ float team_max(float x, float* scratch) {
  const int width = T < 32 ? T : 32;
  for (int offset = width / 2; offset > 0; offset >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if constexpr (T > 32) {
    const int warp = threadIdx.x >> 5, first = (threadIdx.x / T) * (T / 32);
    if ((threadIdx.x & 31) == 0) scratch[warp] = x;
    __syncthreads();
    x = scratch[first];
    for (int w = 1; w < T / 32; ++w) x = fmaxf(x, scratch[first + w]);
    __syncthreads();  // scratch is reused by the next call
  }
  return x;
}

// T threads a quantization block of 8·T elements (Note [adam8bit's CUDA kernel in teams]);
// Threads = the thread block (a multiple of T). Vec: p and g 16-byte aligned, the codes 8-byte
// aligned, so a thread's eight elements load as two float4 and one uint2.
// Two thread blocks a multiprocessor (Threads <= 512; one of 1024): registers for 64 each.
template <int T, int Threads, bool Vec>
__global__ void __launch_bounds__(Threads, Threads >= 1024 ? 1 : 2) adam8bit_team_kernel(Adam8bitDeviceTensor t,
                                                                Adam8bitCoefficients c) {
  extern __shared__ float shared[];
  float* mcode = shared;
  float* vcode = shared + 256;
  int32_t* mcells = reinterpret_cast<int32_t*>(shared + 512);
  int32_t* vcells = mcells + kCellInts;
  __shared__ float scratch_m[Threads / 32], scratch_v[Threads / 32];
  for (int i = threadIdx.x; i < 256; i += Threads) {
    mcode[i] = t.mcode[i];
    vcode[i] = t.vcode[i];
  }
  for (int i = threadIdx.x; i < kCellInts; i += Threads) {
    mcells[i] = t.mcells[i];
    vcells[i] = t.vcells[i];
  }
  __syncthreads();
  constexpr int kTeams = Threads / T;
  const int team = threadIdx.x / T, rank = threadIdx.x % T;
  const int64_t blocks = (t.n + t.block - 1) / t.block;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kTeams;
  // Every thread runs the same number of rounds (the reductions synchronise the thread block);
  // a team past the last quantization block computes on nothing.
  const int64_t rounds = (blocks + stride - 1) / stride;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t b = round * stride + static_cast<int64_t>(blockIdx.x) * kTeams + team;
    const bool live = b < blocks;
    const int64_t start = b * t.block;
    const int64_t len = live ? (t.n - start < t.block ? t.n - start : t.block) : 0;
    const int64_t i0 = static_cast<int64_t>(rank) * kPerThread;
    const int count = len - i0 >= kPerThread ? kPerThread : (len > i0 ? int(len - i0) : 0);
    float p[kPerThread], g[kPerThread], m[kPerThread], v[kPerThread];
    uint8_t qm[kPerThread], qv[kPerThread];
    const int64_t k = start + i0;
    if (Vec && count == kPerThread) {
      const float4* p4 = reinterpret_cast<const float4*>(t.p + k);
      const float4* g4 = reinterpret_cast<const float4*>(t.g + k);
      const float4 pa = p4[0], pb = p4[1], ga = __ldg(g4), gb = __ldg(g4 + 1);
      p[0] = pa.x, p[1] = pa.y, p[2] = pa.z, p[3] = pa.w;
      p[4] = pb.x, p[5] = pb.y, p[6] = pb.z, p[7] = pb.w;
      g[0] = ga.x, g[1] = ga.y, g[2] = ga.z, g[3] = ga.w;
      g[4] = gb.x, g[5] = gb.y, g[6] = gb.z, g[7] = gb.w;
      const uint2 cm = *reinterpret_cast<const uint2*>(t.qm + k);
      const uint2 cv = *reinterpret_cast<const uint2*>(t.qv + k);
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        qm[e] = static_cast<uint8_t>(cm.x >> (8 * e));
        qm[e + 4] = static_cast<uint8_t>(cm.y >> (8 * e));
        qv[e] = static_cast<uint8_t>(cv.x >> (8 * e));
        qv[e + 4] = static_cast<uint8_t>(cv.y >> (8 * e));
      }
    } else {
      #pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const bool here = e < count;
        p[e] = here ? t.p[k + e] : 0.0f;
        g[e] = here ? t.g[k + e] : 0.0f;
        qm[e] = here ? t.qm[k + e] : 0;
        qv[e] = here ? t.qv[k + e] : 0;
      }
    }
    const float am = live ? t.am[b] : 0.0f, av = live ? t.av[b] : 0.0f;
    float new_am = 0.0f, new_av = 0.0f;
    #pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      m[e] = mcode[qm[e]] * am;
      v[e] = vcode[qv[e]] * av;
      adamw_element(p[e], g[e], m[e], v[e], c);
      if (e < count) {
        new_am = fmaxf(new_am, fabsf(m[e]));
        new_av = fmaxf(new_av, v[e]);
      }
    }
    // Every thread has read the old absmaxes before the reduction's shuffles (and barriers).
    new_am = team_max<T>(new_am, scratch_m);
    new_av = team_max<T>(new_av, scratch_v);
    const float inv_m = new_am > 0 ? 1.0f / new_am : 0.0f;
    const float inv_v = new_av > 0 ? 1.0f / new_av : 0.0f;
    #pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      qm[e] = quantize_by_cells(m[e] * inv_m, mcells);
      qv[e] = quantize_by_cells(v[e] * inv_v, vcells);
    }
    if (Vec && count == kPerThread) {
      float4* p4 = reinterpret_cast<float4*>(t.p + k);
      p4[0] = make_float4(p[0], p[1], p[2], p[3]);
      p4[1] = make_float4(p[4], p[5], p[6], p[7]);
      uint2 cm = make_uint2(0, 0), cv = make_uint2(0, 0);
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        cm.x |= static_cast<uint32_t>(qm[e]) << (8 * e);
        cm.y |= static_cast<uint32_t>(qm[e + 4]) << (8 * e);
        cv.x |= static_cast<uint32_t>(qv[e]) << (8 * e);
        cv.y |= static_cast<uint32_t>(qv[e + 4]) << (8 * e);
      }
      *reinterpret_cast<uint2*>(t.qm + k) = cm;
      *reinterpret_cast<uint2*>(t.qv + k) = cv;
    } else {
      #pragma unroll
      for (int e = 0; e < kPerThread; ++e) {  // not e < count: registers need fixed indices
        if (e >= count) break;
        t.p[k + e] = p[e];
        t.qm[k + e] = qm[e];
        t.qv[k + e] = qv[e];
      }
    }
    if (live && rank == 0) {
      t.am[b] = new_am;
      t.av[b] = new_av;
    }
  }
}

// The multiprocessors of each device, asked once.
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

template <int T, bool Vec>
cudaError_t launch_team(int device, const Adam8bitDeviceTensor& t, const Adam8bitCoefficients& c,
                        cudaStream_t stream) {
  constexpr int kBlockThreads = T > 512 ? T : 512;
  const auto kernel = adam8bit_team_kernel<T, kBlockThreads, Vec>;
  // Past the 48 KB a launch gets unasked; set on every launch (a host-side attribute, per
  // function: cheap, and right on whichever device is current).
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kTeamSharedBytes));
  if (error != cudaSuccess) return error;
  const int64_t blocks = (t.n + t.block - 1) / t.block;
  const int64_t wanted = (blocks + kBlockThreads / T - 1) / (kBlockThreads / T);
  // As many as are resident at once (the launch bounds'), each then loops over the blocks.
  const int64_t most = (kBlockThreads >= 1024 ? 1LL : 2LL) * multiprocessors(device);
  const unsigned grid = static_cast<unsigned>(wanted < most ? wanted : most);
  kernel<<<grid, kBlockThreads, kTeamSharedBytes, stream>>>(t, c);
  return cudaGetLastError();
}

template <bool Vec>
cudaError_t launch_team_for(int device, const Adam8bitDeviceTensor& t,
                            const Adam8bitCoefficients& c, cudaStream_t stream) {
  switch (t.block / kPerThread) {
    case 2: return launch_team<2, Vec>(device, t, c, stream);
    case 4: return launch_team<4, Vec>(device, t, c, stream);
    case 8: return launch_team<8, Vec>(device, t, c, stream);
    case 16: return launch_team<16, Vec>(device, t, c, stream);
    case 32: return launch_team<32, Vec>(device, t, c, stream);
    case 64: return launch_team<64, Vec>(device, t, c, stream);
    case 128: return launch_team<128, Vec>(device, t, c, stream);
    case 256: return launch_team<256, Vec>(device, t, c, stream);
    case 512: return launch_team<512, Vec>(device, t, c, stream);
    case 1024: return launch_team<1024, Vec>(device, t, c, stream);
    default: return cudaErrorInvalidValue;  // not reached: launch_adam8bit checks the size
  }
}

bool aligned(const void* pointer, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

}  // namespace

const char* launch_adam8bit(int device, const Adam8bitDeviceTensor& t,
                            const Adam8bitCoefficients& c, void* stream) {
  if (t.n <= 0) return nullptr;
  const int64_t blocks = (t.n + t.block - 1) / t.block;
  if (blocks > 0x7fffffffLL) return "more than 2^31 - 1 quantization blocks in one tensor";
  const auto on = static_cast<cudaStream_t>(stream);
  cudaError_t error;
  if (t.block >= 2 * kPerThread && t.block <= 1024 * kPerThread &&
      (t.block & (t.block - 1)) == 0) {
    const bool vec = aligned(t.p, 16) && aligned(t.g, 16) && aligned(t.qm, 8) && aligned(t.qv, 8);
    error = vec ? launch_team_for<true>(device, t, c, on) : launch_team_for<false>(device, t, c, on);
  } else {
    adam8bit_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, on>>>(t, c);
    error = cudaGetLastError();
  }
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace loom::optim
