// adamw_bf16_launch.h (core-internal) — the CUDA kernel's launcher (adamw_bf16.cu), declared
// without CUDA's headers so loom_cuda.cpp (compiled by the C++ compiler) can call it.
#pragma once

#include <cstdint>

#include "../adamw_bf16_element.h"

namespace loom {

// Queues AdamW over n elements (bf16 moments, stochastic rounding with the span's key) on
// `stream` (a cudaStream_t of GPU `device`, the current one); returns null, or the CUDA
// runtime's words for why the launch failed.
const char* launch_adamw_bf16(int device, float* p, const float* g, uint16_t* m, uint16_t* v,
                              int64_t n, const AdamWCoefficients& c, uint32_t first_index,
                              uint32_t key_lo, uint32_t key_hi, void* stream);

// Queues the weights' stochastic rounding (Note [bf16 weights as their own masters] in
// ../step_driver.cpp) of n elements of one span, `from` fp32 into `into` bf16 bits; null or why
// the launch failed.
const char* launch_round_bf16(int device, const float* from, uint16_t* into, int64_t n,
                              uint32_t first_index, uint32_t key_lo, uint32_t key_hi,
                              void* stream);

}  // namespace loom
