// The CPU kernels behind loom::nn::rms_norm, swiglu and rotary (Note [Fused row ops] in
// fused_ops.cpp): internal to libloom_core, called by nn_fused.cpp, which checks the tensors
// and makes the outputs. Each kernel runs the path cpu::kernel_isa() picks (LOOM_KERNEL_ISA
// caps it); every path gives the same bits.
#pragma once

#include <cstdint>

namespace loom::nn::detail {

enum class Elem { f32, bf16 };  // the tensors' dtype: fp32, or bf16 as its bits (uint16)

// Where the rows of D elements (the last dimension, stride 1) of a tensor of up to 8 dimensions
// start: the leading dimensions' sizes and strides, in elements.
struct RowLayout {
  static constexpr int kMaxLead = 7;
  int lead = 0;
  int64_t size[kMaxLead] = {};
  int64_t stride[kMaxLead] = {};
};

// y = x · rstd · w per row of C, rstd = 1 / sqrt(mean(x²) + eps) in fp32, written to rstd.
void rms_norm_forward(Elem e, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                      int64_t C, float eps);
// gx from go, x, w and the forward's rstd; gw (C fp32 sums over the rows) when not null.
void rms_norm_backward(Elem e, const void* go, const void* x, const void* w, const float* rstd,
                       void* gx, float* gw, int64_t rows, int64_t C);

// out = silu(g) · u over n elements.
void swiglu_forward(Elem e, const void* g, const void* u, void* out, int64_t n);
// gg and gu from go, g and u (nullptr: that gradient is not wanted).
void swiglu_backward(Elem e, const void* go, const void* g, const void* u, void* gg, void* gu,
                     int64_t n);

// Rows of D (even) elements, each at the position its index along dimension -2 gives (the last
// leading dimension, T long): out = x · cos + rotate_half(x) · sin, cos and sin (T, D)
// contiguous. Backward takes go for x and writes gx: rotate_half's transpose.
void rotary(Elem e, bool backward, const void* x, const RowLayout& x_rows, const void* cos,
            const void* sin, void* out, const RowLayout& out_rows, int64_t rows, int64_t D);

}  // namespace loom::nn::detail
