// adam8bit_element.h — adam8bit's per-element arithmetic, compiled by the C++ compiler for the
// CPU kernels (adam8bit.cpp, quantize.h) and by nvcc for the CUDA kernel (cuda/adam8bit.cu), so
// the GPU runs the CPU's own code (Note [loom's own CUDA kernels] in cmake/LoomCudaKernels.cmake).
// Both sides keep each operation's rounding: -ffp-contract=off for the plugin, --fmad=false for
// the kernel; IEEE division and square root on both. No LibTorch header: nvcc reads this file.
#pragma once

#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace loom::optim {

// One step's AdamW constants.
struct Adam8bitCoefficients {
  float decay, w1, b2, w2, bc2_sqrt, eps, step_size;
};

// One AdamW element, torch.optim.AdamW's arithmetic (as the core's fused kernel).
LOOM_OPTIM_HOST_DEVICE void adamw_element(float& p, float g, float& m, float& v,
                                          const Adam8bitCoefficients& c) {
  m = m + c.w1 * (g - m);
  v = c.b2 * v + c.w2 * g * g;
  p = p * c.decay - c.step_size * (m / (optim_sqrt(v) / c.bc2_sqrt + c.eps));
}

// Note [Quantize in one step] (quantize.h): the cells and their table.
constexpr int kStepBits = 7, kStepMinExponent = 127 - 26;
constexpr int kStepCells = 1 + (127 - kStepMinExponent + 1) * (1 << kStepBits) + 1;

LOOM_OPTIM_HOST_DEVICE uint32_t float_bits(float y) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(y);
#else
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  return bits;
#endif
}

// y's code by one lookup in `step_cell` (2 x kStepCells entries, by 2 x cell + sign: base |
// offset << 8) and one comparison; NaN gives 0. The scalar statement of quantize.h's vector code.
LOOM_OPTIM_HOST_DEVICE uint8_t quantize_by_cells(float y, const int32_t* step_cell) {
  const uint32_t bits = float_bits(y);
  const uint32_t magnitude = bits & 0x7fffffffu;
  const int raw = static_cast<int>(magnitude >> 16) - (kStepMinExponent << kStepBits) + 1;
  const int cell = raw < 0 ? 0 : (raw > kStepCells - 1 ? kStepCells - 1 : raw);
  const int32_t negative = -static_cast<int32_t>(bits >> 31);  // 0 or -1 (all ones)
  const int32_t entry = step_cell[2 * cell - negative];
  const int32_t offset =
      (raw <= 0 ? static_cast<int32_t>(magnitude < 1u ? magnitude : 1u)
                : static_cast<int32_t>(magnitude & 0xffffu)) ^ negative;
  const int q = (entry & 0xff) + static_cast<int>((entry >> 8) < offset);
  return static_cast<uint8_t>(y == y ? q : 0);
}

}  // namespace loom::optim
