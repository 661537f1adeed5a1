// grad_scale.h (core-internal) — the clipping factor applied to the gradients in one pass
// (scale_gradients in loom/step_driver.h). See Note [Gradient scale in one pass].
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace loom {

// Multiplies every tensor of `grads` in place by `factor`, each element as ATen's _foreach_mul_
// by a Scalar makes it: fp32, the product with the fp32 factor rounded to fp32; bf16, widened,
// times the factor rounded to bf16, the fp32 product rounded to the nearest bf16, ties to even.
// Contiguous fp32 and bf16 CPU tensors in one pass over chunks of all of them; the rest by ATen.
void scale_in_place(const std::vector<at::Tensor>& grads, double factor);

}  // namespace loom
