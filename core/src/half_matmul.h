// The core's side of Note [Half matmuls through fp32] (loom/nn.h).
#pragma once

namespace loom::nn::detail {

// Frees this thread's small kept widened blocks (Note [Widened blocks kept] in
// half_matmul.cpp). The engine calls it once a step's update is done, so a small model's step
// holds the same memory whether an earlier run in the process (a memory estimate's first
// probe) left blocks in the thread or not.
void release_widened_blocks();

}  // namespace loom::nn::detail
