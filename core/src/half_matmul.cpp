// Half-dtype linears through fp32 sgemm on CPUs that emulate the half dtype: Note [Half
// matmuls through fp32] in loom/half_matmul.h.
#include "loom/nn.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "loom/cpu.h"
#include "loom/error.h"

namespace loom::nn {
namespace {

// -1: no override; else a HalfMatmul.
std::atomic<int> g_override{-1};

int from_environment() {
  static const int forced = [] {
    const char* value = std::getenv("LOOM_HALF_MATMUL");
    if (value == nullptr || *value == '\0' || std::string(value) == "auto") return -1;
    const std::string v(value);
    LOOM_CHECK_AS(ConfigError, v == "native" || v == "fp32", "LOOM_HALF_MATMUL='", v,
                  "': use native (LibTorch's half GEMM), fp32 (widened to fp32 sgemm) or auto");
    return static_cast<int>(v == "native" ? HalfMatmul::native : HalfMatmul::through_fp32);
  }();
  return forced;
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

struct LinearThroughFp32 : public torch::autograd::Function<LinearThroughFp32> {
  // The bias as an optional: an undefined tensor among a Function's inputs has no device.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const std::optional<at::Tensor>& b) {
    NoAutocast no_autocast;
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = b.has_value();
    const std::optional<at::Tensor> wide_b =
        b ? std::optional<at::Tensor>(b->to(at::kFloat)) : std::nullopt;
    return at::linear(x.to(at::kFloat), w.to(at::kFloat), wide_b).to(x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor gy = grads[0].to(at::kFloat);
    const int64_t out = w.size(0), in = w.size(1);
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = gy.matmul(w.to(at::kFloat)).to(x.scalar_type());
    const at::Tensor gy2 = gy.reshape({-1, out});
    if (ctx->needs_input_grad(1))
      gw = gy2.t().mm(x.reshape({-1, in}).to(at::kFloat)).to(w.scalar_type());
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2))
      gb = gy2.sum(0).to(w.scalar_type());
    return {gx, gw, gb};
  }
};

}  // namespace

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
