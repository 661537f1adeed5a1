// adam8bit: AdamW with blockwise dynamically quantized 8-bit state (Dettmers et al. 2021). A
// fused CPU kernel (dequantize -> update -> requantize per block, in one pass over the data)
// and a tensor-op path for other devices. Small tensors keep fp32 state.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "quantize.h"
#include "rules.h"

namespace loom::optim {
namespace {

struct Coefficients {
  float decay, w1, b2, w2, bc2_sqrt, eps, step_size;
};

// One AdamW element, torch.optim.AdamW's arithmetic (as the core's fused kernel).
inline void adamw_element(float& p, float g, float& m, float& v, const Coefficients& c) {
  m = m + c.w1 * (g - m);
  v = c.b2 * v + c.w2 * g * g;
  p = p * c.decay - c.step_size * (m / (std::sqrt(v) / c.bc2_sqrt + c.eps));
}

class Adam8bit final : public UpdateRule {
 public:
  explicit Adam8bit(const ConfigSection& c)
      : beta1_(beta_in_range(c, "beta1")),
        beta2_(beta_in_range(c, "beta2")),
        eps_(c.get_float("eps")),
        block_(c.get_int("block_size")),
        min_8bit_(c.get_int("min_8bit_size")) {
    LOOM_CHECK_AS(ConfigError, eps_ >= 0, c.where("eps"), ": [optimizer] eps must be >= 0");
    LOOM_CHECK_AS(ConfigError, block_ >= 16 && block_ <= 65536 && (block_ & (block_ - 1)) == 0,
                  c.where("block_size"),
                  ": [optimizer] block_size must be a power of two in [16, 65536], got ", block_,
                  "; 256 is the default, 2048 the paper's");
    LOOM_CHECK_AS(ConfigError, min_8bit_ >= 0, c.where("min_8bit_size"),
                  ": [optimizer] min_8bit_size must be >= 0");
  }
  std::string name() const override { return "adam8bit"; }
  Partitioning partitioning() const override { return {Granularity::block, block_}; }

  NamedTensors init_state(const Segment& s) const override {
    if (!quantized(s))
      return {{"exp_avg", at::zeros_like(s.param)}, {"exp_avg_sq", at::zeros_like(s.param)}};
    const int64_t n = s.param.numel(), blocks = (n + block_ - 1) / block_;
    auto bytes = s.param.options().dtype(at::kByte);
    // Code of 0.0: the signed map's zero sits in the middle, the unsigned map's at 0.
    const auto zero_m = static_cast<int64_t>(signed_map().quantize(0.0f));
    return {{"exp_avg_q", at::full({n}, zero_m, bytes)},
            {"exp_avg_absmax", at::zeros({blocks}, s.param.options())},
            {"exp_avg_sq_q", at::zeros({n}, bytes)},
            {"exp_avg_sq_absmax", at::zeros({blocks}, s.param.options())}};
  }

  void update(Segment& s, const UpdateContext& ctx) const override {
    const double bc1 = 1.0 - std::pow(beta1_, static_cast<double>(ctx.step));
    const Coefficients c{static_cast<float>(1.0 - ctx.lr * ctx.weight_decay),
                         static_cast<float>(1.0 - beta1_),
                         static_cast<float>(beta2_),
                         static_cast<float>(1.0 - beta2_),
                         static_cast<float>(std::sqrt(1.0 - std::pow(beta2_, double(ctx.step)))),
                         static_cast<float>(eps_),
                         static_cast<float>(ctx.lr / bc1)};
    if (!quantized(s)) return update_fp32(s, c);
    if (cpu_fp32(s)) return update_fused(s, c);
    update_tensors(s, c);
  }

 private:
  // The whole tensor's size decides, so every segment of a tensor agrees.
  bool quantized(const Segment& s) const {
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    return numel >= min_8bit_;
  }

  void update_fp32(Segment& s, const Coefficients& c) const {
    at::Tensor& m = s.state_at("exp_avg");
    at::Tensor& v = s.state_at("exp_avg_sq");
    if (cpu_fp32(s)) {
      float* p = s.param.data_ptr<float>();
      const float* g = s.grad.data_ptr<float>();
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      for (int64_t i = 0, n = s.param.numel(); i < n; ++i)
        adamw_element(p[i], g[i], mp[i], vp[i], c);
      return;
    }
    s.param.mul_(c.decay);
    m.lerp_(s.grad, c.w1);
    v.mul_(c.b2).addcmul_(s.grad, s.grad, c.w2);
    s.param.addcdiv_(m, v.sqrt().div_(c.bc2_sqrt).add_(c.eps), -c.step_size);
  }

  // Per block: dequantize m and v, update p, m, v, keep the new m, v in a block-sized buffer
  // (L1-resident), take their absmax, requantize. Blocks are independent: threads take ranges.
  void update_fused(Segment& s, const Coefficients& c) const {
    const QuantMap& ms = signed_map();
    const QuantMap& vs = unsigned_map();
    float* p = s.param.data_ptr<float>();
    const float* g = s.grad.data_ptr<float>();
    uint8_t* qm = s.state_at("exp_avg_q").data_ptr<uint8_t>();
    uint8_t* qv = s.state_at("exp_avg_sq_q").data_ptr<uint8_t>();
    float* am = s.state_at("exp_avg_absmax").data_ptr<float>();
    float* av = s.state_at("exp_avg_sq_absmax").data_ptr<float>();
    const int64_t n = s.param.numel(), block = block_, blocks = (n + block - 1) / block;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / block);
    at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
      std::vector<float> mbuf(block), vbuf(block);
      for (int64_t b = first; b < last; ++b) {
        const int64_t start = b * block, len = std::min(block, n - start);
        const float old_am = am[b], old_av = av[b];
        float new_am = 0.0f, new_av = 0.0f;
        for (int64_t i = 0; i < len; ++i) {
          const int64_t k = start + i;
          float m = ms.code[qm[k]] * old_am, v = vs.code[qv[k]] * old_av;
          adamw_element(p[k], g[k], m, v, c);
          mbuf[i] = m;
          vbuf[i] = v;
          new_am = std::max(new_am, std::fabs(m));
          new_av = std::max(new_av, v);
        }
        const float inv_m = new_am > 0 ? 1.0f / new_am : 0.0f;
        const float inv_v = new_av > 0 ? 1.0f / new_av : 0.0f;
        for (int64_t i = 0; i < len; ++i) {
          qm[start + i] = ms.quantize_fast(mbuf[i] * inv_m);
          qv[start + i] = vs.quantize_fast(vbuf[i] * inv_v);
        }
        am[b] = new_am;
        av[b] = new_av;
      }
    });
  }

  // Other devices: the same steps as tensor ops over (blocks, block) views.
  void update_tensors(Segment& s, const Coefficients& c) const {
    const int64_t n = s.param.numel(), blocks = (n + block_ - 1) / block_, padded = blocks * block_;
    auto codes_of = [&](const QuantMap& map) {
      return at::from_blob(const_cast<float*>(map.code.data()), {256}, at::kFloat)
          .to(s.param.device());
    };
    const at::Tensor mcode = codes_of(signed_map()), vcode = codes_of(unsigned_map());
    auto blocked = [&](const at::Tensor& t) {  // (n) -> (blocks, block), zero-padded
      return at::constant_pad_nd(t, {0, padded - n}).view({blocks, block_});
    };
    at::Tensor& qm = s.state_at("exp_avg_q");
    at::Tensor& qv = s.state_at("exp_avg_sq_q");
    at::Tensor& am = s.state_at("exp_avg_absmax");
    at::Tensor& av = s.state_at("exp_avg_sq_absmax");
    at::Tensor m = (blocked(mcode.index_select(0, qm.to(at::kLong))) * am.unsqueeze(1))
                       .view(-1)
                       .slice(0, 0, n);
    at::Tensor v = (blocked(vcode.index_select(0, qv.to(at::kLong))) * av.unsqueeze(1))
                       .view(-1)
                       .slice(0, 0, n);
    m = m.lerp(s.grad, c.w1);
    v = v.mul(c.b2).addcmul_(s.grad, s.grad, c.w2);
    s.param.mul_(c.decay).addcdiv_(m, v.sqrt().div_(c.bc2_sqrt).add_(c.eps), -c.step_size);
    // Requantize: nearest code via the midpoints (searchsorted counts thresholds below y).
    auto requantize = [&](const at::Tensor& x, const QuantMap& map, at::Tensor& q,
                          at::Tensor& absmax) {
      at::Tensor xb = blocked(x);
      absmax.copy_(xb.abs().amax(1));
      at::Tensor inv = at::where(absmax > 0, absmax.reciprocal(), at::zeros_like(absmax));
      at::Tensor y = (xb * inv.unsqueeze(1)).view(-1).slice(0, 0, n);
      at::Tensor thresholds =
          at::from_blob(const_cast<float*>(map.threshold.data()), {255}, at::kFloat).to(x.device());
      q.copy_(at::searchsorted(thresholds, y, /*out_int32=*/false, /*right=*/false));
    };
    requantize(m, signed_map(), qm, am);
    requantize(v, unsigned_map(), qv, av);
  }

  double beta1_, beta2_, eps_;
  int64_t block_, min_8bit_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_adam8bit(const ConfigSection& c) {
  return std::make_unique<Adam8bit>(c);
}

}  // namespace loom::optim
