// The gradients scaled in one pass. See grad_scale.h.
#include "grad_scale.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_foreach_mul.h>

#include <algorithm>
#include <cstdint>

#include "adamw_bf16_element.h"

namespace loom {
namespace {

// Note [Gradient scale in one pass]: clipping by the global norm multiplies every gradient by
// max_norm / (norm + 1e-6) when that is below 1: one more read and write of every gradient each
// step. ATen's _foreach_mul_ does it a tensor at a time (148 dispatches for GPT-2), and for bf16
// through its generic reduced-float path: 74 ms a step for GPT-2's 124 M bf16 gradients at 2
// threads on an Intel Xeon with AMX, 4 % of a full_bf16 step, where moving their 0.5 GB takes a
// fifth of that. Here the tensors are cut into chunks of kChunk elements, all of them shared
// among the threads at once, and each chunk is one auto-vectorised loop (an AVX-512, an AVX2 and
// a baseline clone). Each element is computed as ATen's _foreach_mul_ by a Scalar computes it:
// fp32, the factor rounded to fp32 once and the product rounded to fp32; bf16, the factor
// rounded to bf16 (through fp32; as torch's clip_grad_norm_ does too, whose coefficient is a
// bf16 tensor for bf16 gradients), the element widened exactly, the product in fp32 rounded to
// the nearest bf16, ties to even. So the bits are ATen's (the GradScale tests hold them to
// _foreach_mul_'s), whatever the threads or the ISA. The gradients are finite here (a
// non-finite norm stops the run first); a NaN would still come out as a NaN.
constexpr int64_t kChunk = int64_t{1} << 16;

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void scale_fp32(float* __restrict x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * factor;
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void scale_bf16(uint16_t* __restrict x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i)
    x[i] = adamw_bf16::float_to_bf16_nearest(adamw_bf16::bf16_to_float(x[i]) * factor);
}

struct Chunk {
  void* data;
  int64_t numel;
  bool bf16;
};

}  // namespace

void scale_in_place(const std::vector<at::Tensor>& grads, double factor) {
  std::vector<at::Tensor> rest;
  std::vector<Chunk> chunks;
  for (const at::Tensor& grad : grads) {
    const auto type = grad.scalar_type();
    if (!grad.is_cpu() || !grad.is_contiguous() || (type != at::kFloat && type != at::kBFloat16)) {
      rest.push_back(grad);
      continue;
    }
    const bool bf16 = type == at::kBFloat16;
    grad.unsafeGetTensorImpl()->bump_version();  // an in-place change, as mul_ counts it
    char* base = static_cast<char*>(grad.data_ptr());
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t at = 0; at < grad.numel(); at += kChunk)
      chunks.push_back({base + at * size, std::min(kChunk, grad.numel() - at), bf16});
  }
  const float f = static_cast<float>(factor);
  const float f_bf16 = adamw_bf16::bf16_to_float(adamw_bf16::float_to_bf16_nearest(f));
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      if (chunk.bf16) scale_bf16(static_cast<uint16_t*>(chunk.data), chunk.numel, f_bf16);
      else scale_fp32(static_cast<float*>(chunk.data), chunk.numel, f);
    }
  });
  if (!rest.empty()) at::_foreach_mul_(rest, factor);
}

}  // namespace loom
