// libloom_cuda.so: the core's calls into CUDA APIs, in a library of their own so that only
// processes that can use a GPU load LibTorch's CUDA half (Note [CUDA loaded on demand] in
// ../cuda_runtime.h).
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "../cuda_runtime.h"

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

const loom::CudaRuntime kRuntime{&allocator_initialized, &allocated_bytes, &reset_peak,
                                 &make_nccl_backend};

}  // namespace

extern "C" __attribute__((visibility("default"))) const loom::CudaRuntime* loom_cuda_runtime_v1() {
  return &kRuntime;
}
