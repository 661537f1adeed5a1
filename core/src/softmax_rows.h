// The fused loss's per-row softmax kernel (Note [Softmax rows in one kernel] in
// softmax_rows.cpp): internal to libloom_core, used by nn::linear_cross_entropy_sum.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace loom::nn::detail {

// For each row r of `logits` (n, V), contiguous, on the CPU, fp32 or bf16, and labels in [0, V)
// or ignore_index (linear_cross_entropy_sum checks them): row_loss[r] = the
// row's cross-entropy against labels[r] (logsumexp − the label's logit; 0 where labels[r] ==
// ignore_index), in fp32. With `write_grad`, the row is then overwritten in place by the loss's
// gradient with respect to it, softmax − one-hot (zero on an ignored row), rounded to the
// logits' dtype. Returns false, touching nothing, where this CPU or these tensors cannot take
// the vector kernel (the caller then uses ATen's ops), or where LOOM_FUSED_CE_ATEN=1 asks for
// ATen's path (the tests compare the two).
bool softmax_rows(at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index,
                  bool write_grad, at::Tensor& row_loss);

}  // namespace loom::nn::detail
