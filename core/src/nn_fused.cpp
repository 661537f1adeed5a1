// loom::nn::rms_norm, swiglu and rotary: one CPU kernel pass each way (Note [Fused row ops] in
// fused_ops.cpp) behind autograd functions; ATen's composite ops elsewhere (CUDA, other dtypes,
// shapes the kernels do not take) and where LOOM_FUSED_OPS_ATEN=1 asks for them (the tests
// compare the two; a benchmark times them side by side).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <optional>
#include <string_view>

#include "fused_ops.h"
#include "loom/error.h"
#include "loom/nn.h"

namespace loom::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool aten_forced() {
  const char* value = std::getenv("LOOM_FUSED_OPS_ATEN");
  return value && std::string_view(value) == "1";
}

// The kernels' element type for `t` (a CPU tensor of fp32 or bf16); nullopt where they do not run.
std::optional<detail::Elem> kernel_elem(const at::Tensor& t) {
  if (!t.is_cpu() || aten_forced()) return std::nullopt;
  if (t.scalar_type() == at::kFloat) return detail::Elem::f32;
  if (t.scalar_type() == at::kBFloat16) return detail::Elem::bf16;
  return std::nullopt;
}

// Inside the autograd functions: the dtype was checked when the graph was made.
detail::Elem elem(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? detail::Elem::f32 : detail::Elem::bf16;
}

bool wants_graph(std::initializer_list<at::Tensor> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor& t : inputs)
    if (t.requires_grad()) return true;
  return false;
}

// ---- RMSNorm ----
// y and rstd for contiguous x.
std::pair<at::Tensor, at::Tensor> rms_norm_pass(detail::Elem e, const at::Tensor& x,
                                                const at::Tensor& w, double eps) {
  const int64_t C = x.size(-1), rows = C > 0 ? x.numel() / C : 0;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  detail::rms_norm_forward(e, x.const_data_ptr(), w.const_data_ptr(), y.mutable_data_ptr(),
                           rstd.mutable_data_ptr<float>(), rows, C, static_cast<float>(eps));
  return {y, rstd};
}

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    auto [y, rstd] = rms_norm_pass(elem(xc), xc, wc, eps);
    ctx->save_for_backward({xc, wc, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor go = grad[0].to(x.scalar_type()).contiguous();
    const int64_t C = x.size(-1), rows = C > 0 ? x.numel() / C : 0;
    at::Tensor gx = at::empty_like(x);
    const bool want_w = ctx->needs_input_grad(1);
    at::Tensor gw = want_w ? at::empty({C}, x.options().dtype(at::kFloat)) : at::Tensor();
    detail::rms_norm_backward(elem(x), go.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr(),
                              rstd.const_data_ptr<float>(), gx.mutable_data_ptr(),
                              want_w ? gw.mutable_data_ptr<float>() : nullptr, rows, C);
    return {ctx->needs_input_grad(0) ? gx : at::Tensor(),
            want_w ? gw.to(w.scalar_type()) : at::Tensor(), at::Tensor()};
  }
};

// ---- SwiGLU ----
// silu(g) · u for contiguous g and u.
at::Tensor swiglu_pass(detail::Elem e, const at::Tensor& g, const at::Tensor& u) {
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  detail::swiglu_forward(e, g.const_data_ptr(), u.const_data_ptr(), out.mutable_data_ptr(),
                         g.numel());
  return out;
}

struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::Tensor g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return swiglu_pass(elem(g), g, u);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    const at::Tensor go = grad[0].to(g.scalar_type()).contiguous();
    at::Tensor gg = ctx->needs_input_grad(0) ? at::empty_like(g) : at::Tensor();
    at::Tensor gu = ctx->needs_input_grad(1) ? at::empty_like(u) : at::Tensor();
    detail::swiglu_backward(elem(g), go.const_data_ptr(), g.const_data_ptr(), u.const_data_ptr(),
                            gg.defined() ? gg.mutable_data_ptr() : nullptr,
                            gu.defined() ? gu.mutable_data_ptr() : nullptr, g.numel());
    return {gg, gu};
  }
};

// ---- RoPE ----
detail::RowLayout rows_of(const at::Tensor& t) {
  detail::RowLayout layout;
  layout.lead = static_cast<int>(t.dim()) - 1;
  for (int d = 0; d < layout.lead; ++d) {
    layout.size[d] = t.size(d);
    layout.stride[d] = t.stride(d);
  }
  return layout;
}

// x with its last dimension of stride 1 (a copy otherwise).
at::Tensor unit_stride_rows(const at::Tensor& x) {
  return x.stride(-1) == 1 || x.size(-1) == 1 ? x : x.contiguous();
}

// x · cos + rotate_half(x) · sin, or (backward) its transpose applied to x, by the kernel.
at::Tensor rotary_pass(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin,
                       bool backward) {
  const at::Tensor x = unit_stride_rows(in);
  at::Tensor out = at::empty_like(x);  // x's strides where x is dense, else contiguous
  if (out.stride(-1) != 1) out = at::empty(x.sizes(), x.options());
  const int64_t D = x.size(-1), rows = D > 0 ? x.numel() / D : 0;
  detail::rotary(elem(x), backward, x.const_data_ptr(), rows_of(x), cos.const_data_ptr(),
                 sin.const_data_ptr(), out.mutable_data_ptr(), rows_of(out), rows, D);
  return out;
}

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotary_pass(x, cos, sin, /*backward=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor go = grad[0].to(saved[0].scalar_type());
    return {rotary_pass(go, saved[0], saved[1], /*backward=*/true), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  LOOM_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0), "rms_norm: x ",
             x.sizes(), " does not end in the weight's ", weight.sizes());
  const std::optional<detail::Elem> e = kernel_elem(x);
  if (!e || weight.scalar_type() != x.scalar_type() || !weight.is_cpu())
    return at::rms_norm(x, {weight.size(0)}, weight, eps);
  if (wants_graph({x, weight})) return RmsNormFunction::apply(x, weight, eps);
  return rms_norm_pass(*e, x.contiguous(), weight.contiguous(), eps).first;
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  const std::optional<detail::Elem> e = kernel_elem(gate);
  if (!e || up.scalar_type() != gate.scalar_type() || !up.is_cpu() ||
      !gate.sizes().equals(up.sizes()))
    return at::silu(gate) * up;
  if (wants_graph({gate, up})) return SwigluFunction::apply(gate, up);
  return swiglu_pass(*e, gate.contiguous(), up.contiguous());
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  LOOM_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "rotary: x ", x.sizes(),
             " needs positions and an even last dimension");
  const std::optional<detail::Elem> e = kernel_elem(x);
  const std::vector<int64_t> table = {x.size(-2), x.size(-1)};
  const bool kernel =
      e && x.dim() <= detail::RowLayout::kMaxLead + 1 && cos.scalar_type() == x.scalar_type() &&
      sin.scalar_type() == x.scalar_type() && cos.is_cpu() && sin.is_cpu() &&
      cos.sizes().equals(table) && sin.sizes().equals(table) && cos.is_contiguous() &&
      sin.is_contiguous() && !cos.requires_grad() && !sin.requires_grad();
  if (!kernel) return rotary_reference(x, cos, sin);
  if (wants_graph({x})) return RotaryFunction::apply(x, cos, sin);
  return rotary_pass(x, cos, sin, /*backward=*/false);
}

}  // namespace loom::nn
