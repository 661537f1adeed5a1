// The built-in AdamW update rule: a fused, vectorised, multi-threaded CPU kernel over flat fp32
// segments, PyTorch's fused kernel on CUDA, and tensor ops on any other device. Not
// torch::optim: no param groups here; the step driver resolves lr and weight decay per segment.
#include "adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "loom/error.h"

namespace loom {
namespace {

struct AdamWCoefficients {
  float decay;      // 1 - lr * weight_decay
  float w1;         // 1 - beta1 (lerp weight)
  float b2, w2;     // beta2, 1 - beta2
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float eps;
  float step_size;  // lr / (1 - beta1^t)
};

// One pass over param, grad, m, v (all (n) fp32): 16 bytes read and 12 written per element,
// the least any AdamW can move. A plain loop the compiler vectorises (see core/CMakeLists.txt:
// no errno so sqrt vectorises, no FMA contraction so the vector body and the scalar tail round
// alike); cloned for AVX-512 and AVX2 and picked at load time. The arithmetic is
// torch.optim.AdamW's: p *= 1 - lr wd; m = lerp(m, g, 1-b1); v = b2 v + (1-b2) g²;
// p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void adamw_kernel(float* __restrict p, const float* __restrict g, float* __restrict m,
                  float* __restrict v, int64_t n, AdamWCoefficients c) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = m[i] + c.w1 * (gi - m[i]);
    const float vi = c.b2 * v[i] + c.w2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * c.decay - c.step_size * (mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps));
  }
}

// AdamW (Loshchilov & Hutter) with torch.optim.AdamW's arithmetic and bias correction.
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
        s.grad.is_contiguous() && s.grad.scalar_type() == at::kFloat) {
      const AdamWCoefficients c{static_cast<float>(1.0 - ctx.lr * ctx.weight_decay),
                                static_cast<float>(1.0 - beta1_),
                                static_cast<float>(beta2_),
                                static_cast<float>(1.0 - beta2_),
                                static_cast<float>(bc2_sqrt),
                                static_cast<float>(eps_),
                                static_cast<float>(step_size)};
      float* p = s.param.data_ptr<float>();
      const float* g = s.grad.data_ptr<float>();
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      // Chunks of 64K elements (1.75 MB of traffic) amortise the thread hand-off; results do
      // not depend on the split since every element is independent.
      at::parallel_for(0, s.param.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        adamw_kernel(p + begin, g + begin, mp + begin, vp + begin, end - begin, c);
      });
      return;
    }
    if (fused_cuda(s)) {
      fused_cuda_update({&s}, ctx);
      return;
    }
    // Any other device: the same arithmetic as tensor ops.
    s.param.mul_(1.0 - ctx.lr * ctx.weight_decay);
    m.lerp_(s.grad, 1.0 - beta1_);
    v.mul_(beta2_).addcmul_(s.grad, s.grad, 1.0 - beta2_);
    s.param.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps_), -step_size);
  }

  void update_many(const std::vector<Segment*>& segments,
                   const UpdateContext& ctx) const override {
    bool fused = !segments.empty();
    for (const Segment* s : segments)
      fused = fused && fused_cuda(*s) && s->param.device() == segments.front()->param.device();
    if (fused) return fused_cuda_update(segments, ctx);
    UpdateRule::update_many(segments, ctx);
  }

 private:
  static bool fused_cuda(const Segment& s) {
    return s.param.is_cuda() && s.param.scalar_type() == at::kFloat &&
           s.grad.scalar_type() == at::kFloat && s.grad.device() == s.param.device();
  }

  // PyTorch's fused CUDA AdamW (what torch.optim.AdamW(fused=True) runs): a multi-tensor
  // kernel that reads and writes each element once, a few launches for any number of tensors.
  // Its step count is a device tensor (one, shared: the kernel only reads it), so nothing
  // syncs the host.
  void fused_cuda_update(const std::vector<Segment*>& segments, const UpdateContext& ctx) const {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    const at::Tensor step =
        at::full({}, static_cast<double>(ctx.step),
                 at::TensorOptions().dtype(at::kFloat).device(segments.front()->param.device()));
    for (Segment* s : segments) {
      params.push_back(s->param);
      grads.push_back(s->grad);
      exp_avgs.push_back(s->state_at("exp_avg"));
      exp_avg_sqs.push_back(s->state_at("exp_avg_sq"));
      steps.push_back(step);
    }
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, ctx.lr, beta1_, beta2_,
                      ctx.weight_decay, eps_, /*amsgrad=*/false, /*maximize=*/false);
  }

  double beta1_, beta2_, eps_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_adamw(const ConfigSection& table) {
  return std::make_unique<AdamW>(table);
}

}  // namespace loom
