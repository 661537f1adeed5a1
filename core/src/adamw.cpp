// The built-in AdamW update rule: a fused CPU kernel over flat fp32 segments plus a tensor-op
// path for other devices.
#include "adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "loom/error.h"

namespace loom {
namespace {

// AdamW (Loshchilov & Hutter), with torch.optim.AdamW's arithmetic: decoupled decay, then
// m = lerp(m, g, 1-b1), v = b2 v + (1-b2) g², p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
class AdamW final : public UpdateRule {
 public:
  explicit AdamW(const ConfigSection& c)
      : beta1_(c.get_float("beta1")), beta2_(c.get_float("beta2")), eps_(c.get_float("eps")) {
    LOOM_CHECK_AS(ConfigError, beta1_ >= 0 && beta1_ < 1, c.where("beta1"),
                  ": [optimizer] beta1 must be in [0, 1), got ", beta1_);
    LOOM_CHECK_AS(ConfigError, beta2_ >= 0 && beta2_ < 1, c.where("beta2"),
                  ": [optimizer] beta2 must be in [0, 1), got ", beta2_);
    LOOM_CHECK_AS(ConfigError, eps_ >= 0, c.where("eps"), ": [optimizer] eps must be >= 0");
  }
  std::string name() const override { return "adamw"; }
  NamedTensors init_state(const Segment& s) const override {
    return {{"exp_avg", at::zeros_like(s.param)}, {"exp_avg_sq", at::zeros_like(s.param)}};
  }
  void update(Segment& s, const UpdateContext& ctx) const override {
    at::Tensor& m = s.state_at("exp_avg");
    at::Tensor& v = s.state_at("exp_avg_sq");
    const double bc1 = 1.0 - std::pow(beta1_, static_cast<double>(ctx.step));
    const double bc2_sqrt = std::sqrt(1.0 - std::pow(beta2_, static_cast<double>(ctx.step)));
    const double step_size = ctx.lr / bc1;
    if (s.param.is_cpu() && s.param.scalar_type() == at::kFloat && s.param.is_contiguous() &&
        s.grad.is_contiguous()) {
      float* p = s.param.data_ptr<float>();
      const float* g = s.grad.data_ptr<float>();
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      const float decay = static_cast<float>(1.0 - ctx.lr * ctx.weight_decay);
      const float w1 = static_cast<float>(1.0 - beta1_), b2 = static_cast<float>(beta2_),
                  w2 = static_cast<float>(1.0 - beta2_), eps = static_cast<float>(eps_),
                  bc2s = static_cast<float>(bc2_sqrt), lr = static_cast<float>(step_size);
      // One pass over param, grad, m, v; split over threads in cache-friendly chunks.
      at::parallel_for(0, s.param.numel(), 32768, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const float gi = g[i];
          const float pi = p[i] * decay;
          const float mi = mp[i] + w1 * (gi - mp[i]);
          const float vi = b2 * vp[i] + w2 * gi * gi;
          mp[i] = mi;
          vp[i] = vi;
          p[i] = pi - lr * (mi / (std::sqrt(vi) / bc2s + eps));
        }
      });
      return;
    }
    // Any other device: the same arithmetic as tensor ops.
    s.param.mul_(1.0 - ctx.lr * ctx.weight_decay);
    m.lerp_(s.grad, 1.0 - beta1_);
    v.mul_(beta2_).addcmul_(s.grad, s.grad, 1.0 - beta2_);
    s.param.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps_), -step_size);
  }

 private:
  double beta1_, beta2_, eps_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_adamw(const ConfigSection& table) {
  return std::make_unique<AdamW>(table);
}

}  // namespace loom
