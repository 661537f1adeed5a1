// libloom_cuda.so: the core's calls into CUDA APIs, in a library of their own so that only
// processes that can use a GPU load LibTorch's CUDA half (Note [CUDA loaded on demand] in
// ../cuda_runtime.h).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "../cuda_runtime.h"
#if defined(LOOM_CUDA_KERNELS)
#include "adamw_bf16_launch.h"
#endif

namespace {

bool allocator_initialized() { return c10::cuda::CUDACachingAllocator::get()->initialized(); }

void allocated_bytes(int index, int64_t* current, int64_t* peak, int64_t* count) {
  using namespace c10::CachingDeviceAllocator;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const auto& bytes = stats.allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)];
  *current = bytes.current;
  *peak = bytes.peak;
  *count = stats.allocation[static_cast<size_t>(StatType::AGGREGATE)].current;
}

void reset_peak(int index) { c10::cuda::CUDACachingAllocator::resetPeakStats(index); }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

#if defined(LOOM_CUDA_KERNELS)
void adamw_bf16_update(int device, float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n,
                       const loom::AdamWCoefficients& c, uint32_t first_index, uint32_t key_lo,
                       uint32_t key_hi) {
  // c10's generic guard, not CUDAGuard: its inline code would bind this library to a libcudart.
  const c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
  if (const char* error =
          loom::launch_adamw_bf16(device, p, g, m, v, n, c, first_index, key_lo, key_hi,
                                  c10::cuda::getCurrentCUDAStream(device).stream()))
    throw std::runtime_error(std::string("adamw's bf16-state CUDA kernel did not launch on "
                                         "cuda:") + std::to_string(device) + ": " + error);
}
constexpr auto kAdamwBf16 = &adamw_bf16_update;

void round_bf16_stochastic(int device, const float* from, uint16_t* into, int64_t n,
                           uint32_t first_index, uint32_t key_lo, uint32_t key_hi) {
  const c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
  if (const char* error =
          loom::launch_round_bf16(device, from, into, n, first_index, key_lo, key_hi,
                                  c10::cuda::getCurrentCUDAStream(device).stream()))
    throw std::runtime_error(std::string("the bf16 weights' rounding kernel did not launch on "
                                         "cuda:") + std::to_string(device) + ": " + error);
}
constexpr auto kRoundBf16 = &round_bf16_stochastic;
#else
constexpr decltype(loom::CudaRuntime::adamw_bf16_update) kAdamwBf16 = nullptr;
constexpr decltype(loom::CudaRuntime::round_bf16_stochastic) kRoundBf16 = nullptr;
#endif

const loom::CudaRuntime kRuntime{&allocator_initialized, &allocated_bytes, &reset_peak,
                                 &make_nccl_backend, kAdamwBf16, kRoundBf16};

}  // namespace

extern "C" __attribute__((visibility("default"))) const loom::CudaRuntime* loom_cuda_runtime_v1() {
  return &kRuntime;
}
