// cuda_runtime.h (core-internal) — the CUDA half of the core, loaded on demand.
// Note [CUDA loaded on demand]: LibTorch's CUDA half (libtorch_cuda and the CUDA, cuBLAS,
// cuDNN and NCCL libraries it needs) costs every process about half a second of start-up and
// ~0.7 s of CPU to load and register, on machines with no GPU too, where it can never be used:
// a CPU job paid it on every rank, every `loom check`, every test process. So libloom_core links
// only the CPU half (libtorch_cpu, libc10), and the few core functions that call CUDA APIs
// themselves (the caching allocator's statistics, NCCL process groups) live in libloom_cuda.so
// beside it, which links the CUDA half. The core loads it while it is itself being loaded —
// before any code can ask ATen whether CUDA exists, because ATen decides that once per process
// (getCUDAHooks) and a process that asked before libtorch_cuda was loaded never sees a GPU —
// and only where a GPU can exist: an NVIDIA driver's device nodes (/dev/nvidiactl,
// /proc/driver/nvidia) or WSL's GPU device (/dev/dxg). LOOM_LOAD_CUDA=1 loads it anyway (a
// driver in an unusual place), =0 never (a GPU machine running a CPU job). On a GPU machine
// nothing changes: the CUDA half is loaded before main, as when it was linked. A CPU build
// (Note [LibTorch without the CUDA toolkit]) has no libloom_cuda: cuda_runtime() is null.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "adamw_bf16_element.h"

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace loom {

// What libloom_cuda.so gives the core: plain functions, filled in by the library.
struct CudaRuntime {
  // The CUDA caching allocator of device `index`: whether it has allocated yet, its allocated
  // bytes (current, peak) and live allocation count; and resetting the peak.
  bool (*allocator_initialized)();
  void (*allocated_bytes)(int index, int64_t* current, int64_t* peak, int64_t* count);
  void (*reset_peak)(int index);
  // A ProcessGroupNCCL of `size` ranks over `store` whose collectives time out after `timeout`.
  c10::intrusive_ptr<c10d::Backend> (*make_nccl_backend)(const c10::intrusive_ptr<c10d::Store>& store,
                                                         int rank, int size,
                                                         std::chrono::milliseconds timeout);
  // AdamW over bf16 moments (Note [Stochastic rounding of the state] in adamw.cpp) for n
  // elements of one rounding span, queued on device `device`'s current stream; throws on a
  // launch error. Null where loom was built without CUDA kernels (no CUDA compiler found).
  void (*adamw_bf16_update)(int device, float* p, const float* g, uint16_t* m, uint16_t* v,
                            int64_t n, const AdamWCoefficients& c, uint32_t first_index,
                            uint32_t key_lo, uint32_t key_hi);
  // bf16 weights written back from their fp32 update, rounded stochastically (Note [bf16
  // weights as their own masters] in step_driver.cpp): n elements of one rounding span, queued
  // as adamw_bf16_update is. Null without CUDA kernels.
  void (*round_bf16_stochastic)(int device, const float* from, uint16_t* into, int64_t n,
                                uint32_t first_index, uint32_t key_lo, uint32_t key_hi);
};

// The loaded CUDA half, or null: not a CUDA build, no GPU driver here, LOOM_LOAD_CUDA=0, or
// the library failed to load (cuda_runtime_status() says which).
const CudaRuntime* cuda_runtime();

// One line for `loom env` and errors: "loaded from PATH", or why it was not.
std::string cuda_runtime_status();

}  // namespace loom

// libloom_cuda.so's one entry point (C linkage, so dlsym finds it by this name).
extern "C" const loom::CudaRuntime* loom_cuda_runtime_v1();
