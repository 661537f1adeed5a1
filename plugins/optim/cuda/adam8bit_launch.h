// adam8bit_launch.h — the adam8bit CUDA kernel's launcher (adam8bit.cu), declared without CUDA's
// headers so adam8bit.cpp (compiled by the C++ compiler, LibTorch's CPU half only) can call it.
#pragma once

#include <cstdint>

#include "../adam8bit_element.h"

namespace loom::optim {

// Where one tensor's update reads and writes, all on one GPU: n elements in blocks of `block`
// (the last one ragged), the two maps' 256 codes and their one-step cell tables
// (2 x kStepCells int32 each).
struct Adam8bitDeviceTensor {
  float* p;
  const float* g;
  uint8_t *qm, *qv;
  float *am, *av;  // per block
  int64_t n, block;
  const float *mcode, *vcode;
  const int32_t *mcells, *vcells;
};

// Queues adam8bit's update of `t` on `stream` (a cudaStream_t of GPU `device`, the current one):
// per block, dequantize, AdamW, the new absmax, requantize, as the CPU's block_scalar does.
// Returns null, or the CUDA runtime's words for why the launch failed.
const char* launch_adam8bit(int device, const Adam8bitDeviceTensor& t,
                            const Adam8bitCoefficients& c, void* stream);

}  // namespace loom::optim
