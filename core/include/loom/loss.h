// loom/loss.h — a language model's loss without its logits: the fused, chunked linear +
// cross-entropy a model plugin calls in place of `linear` then `cross_entropy` (Note [Fused
// linear cross-entropy]).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "loom/batch.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::nn {

// Note [Fused linear cross-entropy]: with a 50257-token vocabulary the (tokens, vocab) logits of
// a batch of 4 × 1024 tokens are 0.8 GB in fp32, and the usual path holds two such tensors
// (logits and their log-softmax) from forward to backward, plus a third during backward. Here
// the head runs over `chunk_rows` rows at a time, and each chunk's logits live only inside the
// forward: they give the chunk's loss and, when a gradient is wanted, at once the chunk's
// gradient (softmax − one-hot), whose two matmuls give the gradients of x and of the head. Those
// (tokens × dim and vocab × dim, fp32) are what forward keeps for backward, which only scales
// them by the incoming gradient: three matmuls, as the unfused path, and no (tokens, vocab)
// tensor at any time.
// - Autocast: under autocast the matmuls run in its dtype, as `linear` would; the softmax, the
//   loss and the accumulated gradient of the head are fp32. fp16 autocast takes the unfused path,
//   because the gradient computed in forward would meet fp16's range before the loss scale.
// - On a CPU with AVX-512 or AVX2, each chunk's softmax, loss and gradient are one kernel over
//   the logits in their own dtype, the gradient written over them (Note [Softmax rows in one
//   kernel] in core/src/softmax_rows.cpp; the two ISAs give the same bits); on other CPUs and
//   devices, or with a trained bias, ATen's ops. The two agree to fp32 rounding.
// - Rows whose label is `ignore_index` add nothing to the loss and get a zero gradient.
// - The head's gradient is accumulated over chunks. In fp32 the first chunk's product is
//   written into it (no zero-fill first) and each later one adds into it inside the matmul. In
//   half precision the matmul sums up to four chunks itself (its output, like the unfused path's,
//   is rounded to the half dtype), and each such partial sum is added into an fp32 gradient
//   (the first copied; later ones a few MiB of rows at a time, since a mixed-dtype add_ widens
//   its half operand into a temporary of its whole size): adding every chunk's product to fp32
//   separately moved three head-sized tensors per chunk, which cost 10 % of the loss's time in
//   bf16. So results match the unfused path to rounding (a few half roundings more at most), not
//   bitwise.
// - On the CPU every chunk's logits go to one buffer (a chunk's logits, tens of MiB, would
//   otherwise be mapped afresh each time, page by page).
//
// x (..., D), weight (V, D), bias (V) or undefined, labels (...) int64 with x's leading shape.
// Returns the 0-d fp32 sum over non-ignored rows of cross_entropy(x·weightᵀ + bias, label).
// chunk_rows <= 0 picks default_chunk_rows(V).
at::Tensor linear_cross_entropy_sum(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& bias, const at::Tensor& labels,
                                    int64_t ignore_index, int64_t chunk_rows = 0);

// A language model's output from its final hidden states x (B, T, D) and its linear head
// (`head`, or the tied embedding `tied_weight` where head is null): with labels, num_targets and
// the loss — fused (linear_cross_entropy_sum, no logits) when `fused` and the head is a plain
// matmul, else over the logits; without labels, the logits. What gpt and llama share; each
// checks its labels' shape first.
class Linear;
Output causal_lm_output(const at::Tensor& x, Linear* head, const at::Tensor& tied_weight,
                        const Batch& batch, bool fused, int64_t chunk_rows);

// Rows per chunk for a vocabulary of `vocab`: chunks of about 16 M logits (64 MB in fp32), large
// enough that each matmul reads the head once per several hundred rows.
int64_t default_chunk_rows(int64_t vocab);

}  // namespace loom::nn

#pragma GCC visibility pop
