// stochastic_rounding.h (core-internal) — the counter-based random bits of loom's stochastic
// rounding to bf16, shared by adamw's bf16 moments (Note [Stochastic rounding of the state] in
// adamw.cpp) and by weights that are their own masters (Note [bf16 weights as their own
// masters] in step_driver.cpp): the keys, the spans one key serves, the bits as tensor ops, and
// the weights' rounding pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace loom {

// SplitMix64's finaliser (with its golden-ratio increment).
uint64_t mix64(uint64_t z);
// FNV-1a over the bytes of `text`.
uint64_t fnv1a64(const std::string& text);

// Elements [begin, end) of the whole tensor share a key when begin and end - 1 share index >> 32.
inline uint64_t rounding_key(uint64_t tensor_key, int64_t step, int64_t index) {
  return mix64(mix64(tensor_key ^ static_cast<uint64_t>(step)) ^
               (static_cast<uint64_t>(index) >> 32));
}

// Elements [begin, end) of a segment that starts at `offset` in the whole tensor, cut where the
// whole tensor's index crosses a multiple of 2^32, so that one key serves each span:
// span(from, stop, uint32 index of `from`, key).
template <typename Span>
void each_rounding_span(uint64_t tensor_key, int64_t step, int64_t offset, int64_t begin,
                        int64_t end, const Span& span) {
  while (begin < end) {
    const int64_t index = offset + begin;
    const int64_t block_end = ((index >> 32) + 1) << 32;
    const int64_t stop = std::min(end, begin + (block_end - index));
    span(begin, stop, static_cast<uint32_t>(index), rounding_key(tensor_key, step, index));
    begin = stop;
  }
}

// The 32 random bits x of elements [0, n) of a segment at `offset` (an int64 tensor of uint32
// values, on `options`' device), as tensor ops: the kernels' bits, for devices without them.
at::Tensor random_bits_ops(uint64_t tensor_key, int64_t step, int64_t offset, int64_t n,
                           const at::TensorOptions& options);
// x (fp32, contiguous) rounded stochastically into `into` (bf16) with random16 (int64 in
// [0, 65536)), as tensor ops.
void round_into_ops(const at::Tensor& x, const at::Tensor& random16, at::Tensor& into);

// Note [bf16 weights as their own masters]: the stream of parameter `name`'s weights, apart
// from its moments' (which adamw keys by mix64(seed ^ fnv1a64(name))).
uint64_t weight_rounding_key(uint64_t seed, const std::string& name);

// Writes `from` ((n) fp32, contiguous) into `into` ((n) bf16, contiguous, the same device), each
// element rounded stochastically with the bits of (tensor_key, step, offset + i): the CPU
// kernel (three ISA copies, picked by cpu::kernel_isa()), its CUDA twin, or tensor ops, bitwise
// alike.
void round_to_bf16_stochastic(const at::Tensor& from, at::Tensor& into, uint64_t tensor_key,
                              int64_t step, int64_t offset);

}  // namespace loom
