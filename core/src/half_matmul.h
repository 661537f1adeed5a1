// The core's side of Note [Half matmuls through fp32] (loom/nn.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace loom::nn::detail {

// Rows [r, r + n) of the half weight w widened to fp32 in this thread's kept buffer (Note
// [Widened blocks kept] in half_matmul.cpp): valid until this thread's next widened block. The
// fused loss's head goes through them block by block, as the linears do, instead of widening
// the whole head at once.
at::Tensor widened_weight_rows(const at::Tensor& w, int64_t r, int64_t n);
// Rows of a weight of `in` columns widened at a time (about 1 M elements, 4 MiB).
int64_t widened_rows_per_block(int64_t in);

// Frees this thread's small kept widened blocks (Note [Widened blocks kept] in
// half_matmul.cpp). The engine calls it once a step's update is done, so a small model's step
// holds the same memory whether an earlier run in the process (a memory estimate's first
// probe) left blocks in the thread or not.
void release_widened_blocks();

}  // namespace loom::nn::detail
