// sum_of_squares.h (core-internal) — one gradient's sum of squares, the gradient norm's part per
// tensor (squared_norm in loom/step_driver.h totals them). See Note [Sum of squares in one pass].
#pragma once

#include <ATen/core/Tensor.h>

namespace loom {

// sum(g²) of one tensor as a 0-d fp64 tensor on its device: each square rounded to fp32 (as
// fp32 arithmetic makes it), summed in fp64. On the CPU for fp32 and bf16 one pass in fixed
// chunks, so the bits do not depend on the thread count; ATen's ops elsewhere.
at::Tensor sum_of_squares(const at::Tensor& grad);

}  // namespace loom
