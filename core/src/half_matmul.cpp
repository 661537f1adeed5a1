// Half-dtype linears through fp32 sgemm on CPUs that emulate the half dtype: Note [Half
// matmuls through fp32] in loom/nn.h.
#include "loom/nn.h"

#include "half_matmul.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/cpu.h"
#include "loom/error.h"

namespace loom::nn {
namespace {

// -1: no override; else a HalfMatmul.
std::atomic<int> g_override{-1};

// Read at each half-dtype product (a getenv beside a matmul), so a bad value is an error
// whenever it is met, tests included.
int from_environment() {
  const char* value = std::getenv("LOOM_HALF_MATMUL");
  if (value == nullptr || *value == '\0' || std::string(value) == "auto") return -1;
  const std::string v(value);
  LOOM_CHECK_AS(ConfigError, v == "native" || v == "fp32", "LOOM_HALF_MATMUL='", v,
                "': use native (LibTorch's half GEMM), fp32 (widened to fp32 sgemm) or auto");
  return static_cast<int>(v == "native" ? HalfMatmul::native : HalfMatmul::through_fp32);
}

// Whether the oneDNN level in effect computes `dtype` natively (cpu_isa.cpp's table: the
// bf16 levels are avx512_core_bf16 and up, the fp16 ones avx512_core_fp16 and the AMX ones).
bool native_on_this_cpu(c10::ScalarType dtype) {
  const std::string& level = cpu::isa_in_effect().level;
  if (level.empty()) return true;  // not x86-64: LibTorch's own choice
  if (dtype == at::kBFloat16)
    return level == "avx512_core_bf16" || level == "avx512_core_fp16" ||
           level == "avx512_core_amx" || level == "avx512_core_amx_fp16";
  return level == "avx512_core_fp16" || level == "avx512_core_amx" ||
         level == "avx512_core_amx_fp16";
}

// Autocast must not narrow the widened operands again inside the products.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::DispatchKeySet(c10::DispatchKey::AutocastCPU)};
};

// Rows of the weight widened at a time: about 1 M fp32 elements (4 MiB), so a product's
// widened copy stays small whatever the layer's size (a whole 1536 x 6144 weight widened at
// once, forward and backward, put a 0.51 B-parameter GPT over its memory cap: the offload
// test). Each block is one sgemm of up to that many output features.
int64_t rows_per_block(int64_t in) { return std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(in, 1)); }

// Note [Widened blocks kept]: the weight's widened rows and the weight gradient's fp32 rows
// live in two buffers this thread keeps, not in a fresh allocation per block. Under loom's
// never-trimmed heap (Note [Freed memory kept], device.h) a 4 MiB block freed between two
// gradients that live until the update leaves a hole the next, larger gradient does not fit:
// on a 0.51 B bf16 GPT whose optimizer state was on NVMe, the second step's peak RSS rose ~700
// MiB above the first (3574 against 2876 MiB), the offload test's cap killed it, and the
// native path did not grow (docs/BENCHMARKS.md "Half matmuls through fp32"). Each buffer
// holds at most one block (4 MiB, rows_per_block) per thread that multiplies; what leaves a
// product is copied out of them into the outputs' own tensors. Small ones (under 1 MiB) live
// through a step: the engine frees them after its update (release_widened_blocks). Kept for the
// thread's life, a memory estimate's probes (batch 1, then batch 2, in one process) counted
// them in the first probe's activations only, made before its setup ended in the second, so the
// per-sample slope came out low by their size and a tiny GPT's bf16 estimate 14 % below its
// measured peak (about 9 x 2 x 147 KB at batch 12).
enum KeptBuffer { kWeightRows, kWeightGrad, kKeptBuffers };

thread_local at::Tensor t_kept[kKeptBuffers];

at::Tensor kept_block(KeptBuffer which, int64_t rows, int64_t cols) {
  at::Tensor& buffer = t_kept[which];
  // Grown to the largest block met, no larger: a small model's buffers stay small (memory
  // estimates hold to 10 %, and tracked peaks count these bytes).
  if (!buffer.defined() || buffer.numel() < rows * cols) buffer = at::empty({rows * cols}, at::kFloat);
  return buffer.narrow(0, 0, rows * cols).view({rows, cols});
}

// Rows [r, r + n) of the half weight w, widened to fp32 into the kept buffer.
at::Tensor widened_rows(const at::Tensor& w, int64_t r, int64_t n) {
  return kept_block(kWeightRows, n, w.size(1)).copy_(w.narrow(0, r, n));
}

struct LinearThroughFp32 : public torch::autograd::Function<LinearThroughFp32> {
  // The bias as an optional: an undefined tensor among a Function's inputs has no device.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const std::optional<at::Tensor>& b) {
    NoAutocast no_autocast;
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = b.has_value();
    const int64_t out = w.size(0), in = w.size(1), step = rows_per_block(in);
    const at::Tensor x2 = x.reshape({-1, in}).to(at::kFloat);
    at::Tensor y = at::empty({x2.size(0), out}, x.options());
    for (int64_t r = 0; r < out; r += step) {
      const int64_t n = std::min(step, out - r);
      const at::Tensor wb = widened_rows(w, r, n).t();
      // The block's product in fp32 (bias added there, as linear does), rounded once.
      y.narrow(1, r, n).copy_(b ? at::addmm(b->narrow(0, r, n).to(at::kFloat), x2, wb)
                                : at::mm(x2, wb));
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = out;
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const int64_t out = w.size(0), in = w.size(1), step = rows_per_block(in);
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const bool want_b = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2);
    const at::Tensor gy = grads[0].reshape({-1, out});
    const at::Tensor x2 = want_w ? x.reshape({-1, in}).to(at::kFloat) : at::Tensor();
    at::Tensor gx = want_x ? at::zeros({gy.size(0), in}, gy.options().dtype(at::kFloat)) : at::Tensor();
    at::Tensor gw = want_w ? at::empty_like(w) : at::Tensor();
    at::Tensor gb = want_b ? at::empty({out}, w.options()) : at::Tensor();
    for (int64_t r = 0; r < out; r += step) {
      const int64_t n = std::min(step, out - r);
      const at::Tensor gyb = gy.narrow(1, r, n).to(at::kFloat);
      if (want_x) gx.addmm_(gyb, widened_rows(w, r, n));  // fp32 over the blocks
      if (want_w) {
        at::Tensor block = kept_block(kWeightGrad, n, in);
        gw.narrow(0, r, n).copy_(at::mm_out(block, gyb.t(), x2));
      }
      if (want_b) gb.narrow(0, r, n).copy_(gyb.sum(0));
    }
    if (want_x) gx = gx.to(x.scalar_type()).view(x.sizes());
    return {gx, gw, gb};
  }
};

}  // namespace

at::Tensor detail::widened_weight_rows(const at::Tensor& w, int64_t r, int64_t n) {
  return widened_rows(w, r, n);
}

int64_t detail::widened_rows_per_block(int64_t in) { return rows_per_block(in); }

void detail::release_widened_blocks() {
  // Blocks of 1 MiB and up stay: freed and made again each step they fragment the heap as
  // fresh blocks per product did (the 0.51 B GPT's step-2 peak went back up, 2872 -> 3096-3357
  // MiB). Against a model with such blocks their 4-8 MiB are noise in an estimate.
  for (at::Tensor& buffer : t_kept)
    if (buffer.defined() && buffer.numel() < (int64_t{1} << 18)) buffer = at::Tensor();
}

HalfMatmul half_matmul_path(c10::ScalarType dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return HalfMatmul::native;
  if (const int forced = g_override.load(); forced >= 0) return static_cast<HalfMatmul>(forced);
  if (const int forced = from_environment(); forced >= 0) return static_cast<HalfMatmul>(forced);
  return native_on_this_cpu(dtype) ? HalfMatmul::native : HalfMatmul::through_fp32;
}

void set_half_matmul_override(std::optional<HalfMatmul> path) {
  g_override.store(path ? static_cast<int>(*path) : -1);
}

at::Tensor linear_through_fp32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  LOOM_CHECK(x.scalar_type() == w.scalar_type() && (!b.defined() || b.scalar_type() == w.scalar_type()),
             "linear_through_fp32: operands of one dtype, got ", x.scalar_type(), " and ",
             w.scalar_type());
  return LinearThroughFp32::apply(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout, bool causal) {
  const at::ScalarType dtype = q.scalar_type();
  if (!q.is_cpu() || half_matmul_path(dtype) != HalfMatmul::through_fp32)
    return at::scaled_dot_product_attention(q, k, v, mask, dropout, causal);
  std::optional<at::Tensor> wide_mask = mask;
  if (mask && mask->is_floating_point()) wide_mask = mask->to(at::kFloat);
  at::Tensor wq = q.to(at::kFloat), wk = k.to(at::kFloat), wv = v.to(at::kFloat);
  NoAutocast no_autocast;
  return at::scaled_dot_product_attention(wq, wk, wv, wide_mask, dropout, causal).to(dtype);
}

}  // namespace loom::nn
