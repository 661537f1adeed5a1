// The optim plugin: the update rules adafactor, adam8bit, sgd, lion and muon as [optimizer]
// choices (adamw is built into the core), and the element-wise rules sgd and lion themselves.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

#include "loom/engine.h"
#include "loom/log.h"
#include "loom/plugin.h"
#include "loom/prefetch.h"
#include "muon.h"
#include "rules.h"

namespace loom::optim {
namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per parallel chunk: amortises the hand-off

// Note [Multi-tensor passes]: on a GPU sgd and lion ran as tensor ops, tensor by tensor: four to
// seven kernels a tensor (a step of 150 tensors ~1000 launches), each a pass over memory, lion's
// 68 bytes a parameter where its update needs 20. update_many now hands every segment it can of
// one device to one multi-tensor pass: for sgd torch's fused SGD (at::_fused_sgd_, the kernel of
// torch.optim.SGD(fused=True): p, g and the buffer read and written once, a few launches for
// any number of tensors); for lion, which torch has no kernel for, foreach ops (four or five
// launches for the step, 44-52 bytes a parameter). kernel = "auto" takes them for GPU tensors
// only (a CPU's fp32 tensors keep the vectorised loops, which read each element once);
// kernel = "multi_tensor" on any device, which is how the CPU tests hold the GPU's arithmetic to
// torch's and the paper's references (the same ATen ops on both devices); kernel = "tensor_ops"
// keeps the per-tensor ops everywhere. A segment the pass cannot take (not fp32, not
// contiguous, its state elsewhere) goes through update() as before.
enum class RuleKernel { kAuto, kMultiTensor, kTensorOps };

RuleKernel rule_kernel(const ConfigSection& c, const char* rule) {
  const std::string kernel = kernel_in(c, rule, {"auto", "multi_tensor", "tensor_ops"});
  return kernel == "auto"           ? RuleKernel::kAuto
         : kernel == "multi_tensor" ? RuleKernel::kMultiTensor
                                    : RuleKernel::kTensorOps;
}

const char* const kKernelDoc =
    "auto (the vectorised loops on CPU fp32 tensors, one multi-tensor pass a device on a GPU: "
    "Note [Multi-tensor passes]) | multi_tensor (that pass on any device) | tensor_ops";

// The vectorised loops take a CPU fp32 segment unless kernel = "tensor_ops".
bool takes_loops(const Segment& s, RuleKernel kernel) {
  return cpu_fp32(s) && kernel != RuleKernel::kTensorOps;
}

// update_many's segments split for Note [Multi-tensor passes]: those the pass takes (fp32
// contiguous parameter, gradient and `state` tensor, if any, on the parameter's device), one
// group per device in the order met, and the rest.
struct MultiTensorSplit {
  std::vector<std::vector<Segment*>> groups;
  std::vector<Segment*> rest;
};
MultiTensorSplit split_for_multi_tensor(const std::vector<Segment*>& segments, RuleKernel kernel,
                                        const char* state) {
  MultiTensorSplit split;
  std::vector<c10::Device> devices;
  for (Segment* s : segments) {
    const bool wanted = kernel == RuleKernel::kMultiTensor ||
                        (kernel == RuleKernel::kAuto && s->param.is_cuda());
    const bool fits = kernel_ready(*s, s->param, at::kFloat) &&
                      kernel_ready(*s, s->grad, at::kFloat) &&
                      (!state || kernel_ready(*s, s->state_at(state), at::kFloat));
    if (!wanted || !fits) {
      split.rest.push_back(s);
      continue;
    }
    const auto index = static_cast<size_t>(
        std::find(devices.begin(), devices.end(), s->param.device()) - devices.begin());
    if (index == devices.size()) {
      devices.push_back(s->param.device());
      split.groups.emplace_back();
    }
    split.groups[index].push_back(s);
  }
  return split;
}

// One multi-tensor group's lists: parameters, gradients and the named state tensor (if any).
struct TensorLists {
  std::vector<at::Tensor> params, grads, states;
};
TensorLists lists_of(const std::vector<Segment*>& group, const char* state) {
  TensorLists lists;
  for (Segment* s : group) {
    lists.params.push_back(s->param);
    lists.grads.push_back(s->grad);
    if (state) lists.states.push_back(s->state_at(state));
  }
  return lists;
}

// torch.optim.SGD: L2 weight decay added to the gradient (coupled, as torch does), heavy-ball
// momentum whose buffer starts as the first gradient, optional Nesterov look-ahead.
// Note [Kernels outside the lambda]: the element loops are functions of __restrict pointers
// passed by value. Written inside at::parallel_for's lambda, which OpenMP may run in a parallel
// region (Note [OpenMP] in cmake/LoomTorch.cmake), GCC reaches the pointers through the closure
// and left the loops scalar: lion ran 3.7x and sgd 1.4x slower at one thread.
// Both loops run in runs of 16 elements (a cache line of each array), each run first
// prefetching the lines kPrefetchAhead elements on (Note [Streams prefetched ahead] in
// loom/prefetch.h).
__attribute__((always_inline)) inline void sgd_element(float* __restrict p,
                                                       const float* __restrict g,
                                                       float* __restrict buf, int64_t i, float wd,
                                                       float lr, float mu, float keep, bool first,
                                                       bool nesterov) {
  float d = wd != 0 ? g[i] + wd * p[i] : g[i];
  if (buf) {
    const float b = first ? d : mu * buf[i] + keep * d;
    buf[i] = b;
    d = nesterov ? d + mu * b : b;
  }
  p[i] = p[i] - lr * d;
}
void sgd_kernel(float* __restrict p, const float* __restrict g, float* __restrict buf, int64_t n,
                float wd, float lr, float mu, float keep, bool first, bool nesterov) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    cpu::prefetch_ahead(p + i);
    cpu::prefetch_ahead(g + i);
    if (buf) cpu::prefetch_ahead(buf + i);
    for (int64_t k = i; k < i + 16; ++k)
      sgd_element(p, g, buf, k, wd, lr, mu, keep, first, nesterov);
  }
  for (; i < n; ++i) sgd_element(p, g, buf, i, wd, lr, mu, keep, first, nesterov);
}

class Sgd final : public UpdateRule {
 public:
  explicit Sgd(const ConfigSection& c)
      : momentum_(beta_in_range(c, "momentum")),
        dampening_(c.get_float("dampening")),
        nesterov_(c.get_bool("nesterov")),
        kernel_(rule_kernel(c, "sgd")) {
    LOOM_CHECK_AS(ConfigError, dampening_ >= 0 && dampening_ <= 1, c.where("dampening"),
                  ": [optimizer] dampening must be in [0, 1], got ", dampening_);
    LOOM_CHECK_AS(ConfigError, !nesterov_ || (momentum_ > 0 && dampening_ == 0),
                  c.where("nesterov"),
                  ": [optimizer] nesterov = true needs momentum > 0 and dampening = 0");
  }
  std::string name() const override { return "sgd"; }
  NamedTensors init_state(const Segment& s) const override {
    if (momentum_ == 0) return {};
    return {{"momentum_buffer", at::zeros_like(s.param)}};
  }
  void update_many(const std::vector<Segment*>& segments,
                   const UpdateContext& ctx) const override {
    MultiTensorSplit split = split_for_multi_tensor(segments, kernel_, buffer_state());
    for (const auto& group : split.groups) fused_update(group, ctx);
    // Note [Whole tensors shared among threads] (loom/update_rule.h).
    update_sharing_threads(*this, split.rest, ctx,
                           [this](const Segment& s) { return takes_loops(s, kernel_); });
  }
  void update(Segment& s, const UpdateContext& ctx) const override {
    const bool first = ctx.step == 1;  // torch's buffer is None before the first update
    if (takes_loops(s, kernel_)) {
      float* p = s.param.data_ptr<float>();
      const float* g = s.grad.data_ptr<float>();
      float* buf = momentum_ == 0 ? nullptr : s.state_at("momentum_buffer").data_ptr<float>();
      const float wd = static_cast<float>(ctx.weight_decay), lr = static_cast<float>(ctx.lr),
                  mu = static_cast<float>(momentum_), keep = static_cast<float>(1.0 - dampening_);
      const bool nesterov = nesterov_;
      at::parallel_for(0, s.param.numel(), kGrain, [&](int64_t begin, int64_t end) {
        sgd_kernel(p + begin, g + begin, buf ? buf + begin : nullptr, end - begin, wd, lr, mu,
                   keep, first, nesterov);
      });
      return;
    }
    at::Tensor d = ctx.weight_decay != 0 ? s.grad.add(s.param, ctx.weight_decay) : s.grad;
    if (momentum_ != 0) {
      at::Tensor& buf = s.state_at("momentum_buffer");
      if (first)
        buf.copy_(d);
      else
        buf.mul_(momentum_).add_(d, 1.0 - dampening_);
      d = nesterov_ ? d.add(buf, momentum_) : buf;
    }
    s.param.add_(d, -ctx.lr);
  }

 private:
  const char* buffer_state() const { return momentum_ != 0 ? "momentum_buffer" : nullptr; }
  // Note [Multi-tensor passes]: torch's fused SGD over one device's segments. Its first step
  // copies the decayed gradient into the buffer, as torch's SGD and update() do.
  void fused_update(const std::vector<Segment*>& group, const UpdateContext& ctx) const {
    const TensorLists l = lists_of(group, buffer_state());
    at::_fused_sgd_(l.params, l.grads, l.states, ctx.weight_decay, momentum_, ctx.lr, dampening_,
                    nesterov_, /*maximize=*/false, /*is_first_step=*/ctx.step == 1);
  }

  double momentum_, dampening_;
  bool nesterov_;
  RuleKernel kernel_;
};

// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
// c = b1 m + (1-b1) g; p = p (1 - lr wd) - lr sign(c); m = b2 m + (1-b2) g.
__attribute__((always_inline)) inline void lion_element(float* __restrict p,
                                                        const float* __restrict g,
                                                        float* __restrict m, int64_t i, float b1,
                                                        float w1, float b2, float w2, float lr,
                                                        float decay) {
  const float c = b1 * m[i] + w1 * g[i];
  const float sign = static_cast<float>((c > 0) - (c < 0));
  p[i] = p[i] * decay - lr * sign;
  m[i] = b2 * m[i] + w2 * g[i];
}
void lion_kernel(float* __restrict p, const float* __restrict g, float* __restrict m, int64_t n,
                 float b1, float w1, float b2, float w2, float lr, float decay) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    cpu::prefetch_ahead(p + i);
    cpu::prefetch_ahead(g + i);
    cpu::prefetch_ahead(m + i);
    for (int64_t k = i; k < i + 16; ++k) lion_element(p, g, m, k, b1, w1, b2, w2, lr, decay);
  }
  for (; i < n; ++i) lion_element(p, g, m, i, b1, w1, b2, w2, lr, decay);
}

class Lion final : public UpdateRule {
 public:
  explicit Lion(const ConfigSection& c)
      : beta1_(beta_in_range(c, "beta1")),
        beta2_(beta_in_range(c, "beta2")),
        kernel_(rule_kernel(c, "lion")) {}
  std::string name() const override { return "lion"; }
  NamedTensors init_state(const Segment& s) const override {
    return {{"exp_avg", at::zeros_like(s.param)}};
  }
  void update_many(const std::vector<Segment*>& segments,
                   const UpdateContext& ctx) const override {
    MultiTensorSplit split = split_for_multi_tensor(segments, kernel_, "exp_avg");
    for (const auto& group : split.groups) foreach_update(group, ctx);
    // Note [Whole tensors shared among threads] (loom/update_rule.h).
    update_sharing_threads(*this, split.rest, ctx,
                           [this](const Segment& s) { return takes_loops(s, kernel_); });
  }
  void update(Segment& s, const UpdateContext& ctx) const override {
    at::Tensor& m = s.state_at("exp_avg");
    if (takes_loops(s, kernel_)) {
      float* p = s.param.data_ptr<float>();
      const float* g = s.grad.data_ptr<float>();
      float* mp = m.data_ptr<float>();
      const float b1 = static_cast<float>(beta1_), w1 = static_cast<float>(1.0 - beta1_),
                  b2 = static_cast<float>(beta2_), w2 = static_cast<float>(1.0 - beta2_),
                  lr = static_cast<float>(ctx.lr),
                  decay = static_cast<float>(1.0 - ctx.lr * ctx.weight_decay);
      at::parallel_for(0, s.param.numel(), kGrain, [&](int64_t begin, int64_t end) {
        lion_kernel(p + begin, g + begin, mp + begin, end - begin, b1, w1, b2, w2, lr, decay);
      });
      return;
    }
    at::Tensor direction = m.mul(beta1_).add_(s.grad, 1.0 - beta1_).sign_();
    s.param.mul_(1.0 - ctx.lr * ctx.weight_decay).add_(direction, -ctx.lr);
    m.mul_(beta2_).add_(s.grad, 1.0 - beta2_);
  }

 private:
  // Note [Multi-tensor passes]: lion over one device's segments in foreach ops. b1 m + (1-b1) g
  // is lerp(m, g, 1-b1) (one pass, no product list), and the same for the moment's update.
  void foreach_update(const std::vector<Segment*>& group, const UpdateContext& ctx) const {
    const TensorLists l = lists_of(group, "exp_avg");
    std::vector<at::Tensor> direction = at::_foreach_lerp(l.states, l.grads, 1.0 - beta1_);
    at::_foreach_sign_(direction);
    if (ctx.weight_decay != 0) at::_foreach_mul_(l.params, 1.0 - ctx.lr * ctx.weight_decay);
    at::_foreach_add_(l.params, direction, -ctx.lr);
    at::_foreach_lerp_(l.states, l.grads, 1.0 - beta2_);
  }

  double beta1_, beta2_;
  RuleKernel kernel_;
};

// A key whose default is an array (the Schema's setters take scalars).
KeySpec float_array(const std::string& name, const std::vector<double>& values,
                    const std::string& doc) {
  ConfigArray array;
  for (double v : values) array.push_back(ConfigValue{v, "default"});
  return KeySpec{name, ValueType::Array, ConfigValue{std::move(array), "default"}, doc, false};
}
KeySpec string_array(const std::string& name, const std::vector<std::string>& values,
                     const std::string& doc) {
  ConfigArray array;
  for (const auto& v : values) array.push_back(ConfigValue{v, "default"});
  return KeySpec{name, ValueType::Array, ConfigValue{std::move(array), "default"}, doc, false};
}

class OptimPlugin final : public Plugin {
 public:
  std::string name() const override { return "optim"; }
  std::string description() const override {
    return "update rules adafactor, adam8bit (blockwise 8-bit state), sgd, lion, muon";
  }
  std::vector<Schema> schemas() const override {
    Schema adafactor("optimizer", "adafactor");
    adafactor.key_float("eps1", 1e-30, "added to g² (Transformers' eps[0])")
        .key_float("eps2", 1e-3, "floor of the parameter RMS when scale_parameter (eps[1])")
        .key_float("clip_threshold", 1.0, "the update's RMS is clipped to this")
        .key_float("decay_rate", -0.8, "second-moment decay 1 - t^decay_rate")
        .key_float("beta1", 0.0, "first-moment decay; 0 = none (Transformers' beta1=None)")
        .key_bool("scale_parameter", true, "scale the step by the parameter's RMS")
        .key_bool("relative_step", true,
                  "step size min(1e-2, 1/sqrt(t)) (ignores [train] learning_rate); false: the "
                  "job's learning rate, as the Trainer's optim=\"adafactor\"")
        .key_bool("warmup_init", false, "relative step 1e-6 t during warm-up")
        .key_float("weight_decay", 0.0, "decay p *= 1 - lr wd (not biases/norms)")
        .key_string("kernel", "auto",
                    "auto (CPU loops on CPU tensors, CUDA kernels on GPU fp32 tensors, tensor "
                    "ops otherwise) | cpu_loops | tensor_ops");
    Schema adam8bit("optimizer", "adam8bit");
    adam8bit.key_float("beta1", 0.9, "first-moment decay")
        .key_float("beta2", 0.999, "second-moment decay")
        .key_float("eps", 1e-8, "added to the denominator")
        .key_float("weight_decay", 0.0, "decoupled weight decay (not biases/norms)")
        .key_int("block_size", 256, "elements per quantization block (one absmax each)")
        .key_int("min_8bit_size", 4096, "tensors with fewer elements keep fp32 state")
        .key_string("kernel", "auto",
                    "auto (the fused kernel on CPU fp32 tensors, a CUDA kernel on GPU fp32 "
                    "tensors, tensor ops otherwise) | tensor_ops");
    Schema sgd("optimizer", "sgd");
    sgd.key_float("momentum", 0.0, "heavy-ball momentum in [0, 1)")
        .key_float("dampening", 0.0, "momentum dampening")
        .key_bool("nesterov", false, "Nesterov momentum")
        .key_float("weight_decay", 0.0, "L2 penalty added to the gradient (not biases/norms)")
        .key_string("kernel", "auto", kKernelDoc);
    Schema lion("optimizer", "lion");
    lion.key_float("beta1", 0.9, "interpolation for the update's sign")
        .key_float("beta2", 0.99, "momentum decay")
        .key_float("weight_decay", 0.0, "decoupled weight decay (not biases/norms)")
        .key_string("kernel", "auto", kKernelDoc);
    Schema muon("optimizer", "muon");
    muon.key_float("momentum", 0.95, "momentum of the matrices' buffer (buf = momentum buf + g)")
        .key_bool("nesterov", true, "Nesterov look-ahead: orthogonalise g + momentum buf")
        .key_int("ns_steps", 5, "Newton-Schulz iterations (fp32: Note [Newton-Schulz in fp32])")
        .add(float_array("ns_coefficients", {3.4445, -4.7750, 2.0315},
                         "the quintic iteration's (a, b, c): X = a X + (b S + c S S) X, S = X X^T"))
        .key_float("rms_scale", 0.2,
                   "an A x B update is scaled by rms_scale sqrt(max(A, B)), so its RMS is "
                   "rms_scale (Moonlight's match of AdamW's: its lr and weight decay carry over)")
        .key_float("weight_decay", 0.1,
                   "decoupled weight decay p *= 1 - lr wd, both rules (not biases/norms)")
        .add(float_array("adamw_betas", {0.9, 0.95}, "AdamW's (beta1, beta2) for the tensors "
                                                     "Muon does not take"))
        .key_float("adamw_eps", 1e-8, "AdamW's eps for the tensors Muon does not take")
        .add(string_array("adamw_params", {kDefaultAdamWParams},
                          "regexes over whole parameter names given to AdamW besides rank < 2 "
                          "tensors; the default: embeddings and output heads (wte, wpe, "
                          "embed_tokens, lm_head, classifier...); [] = by shape alone"));
    return {adafactor, adam8bit, sgd, lion, muon};
  }
  // The muon rule says which tensors it orthogonalises and which go to AdamW, once the
  // trainable parameters are known (Note [Which tensors Muon takes]).
  void attach(Engine& engine) override {
    const ConfigSection& optimizer = engine.section("optimizer");
    if (optimizer.get_string("name") != "muon") return;
    engine.on(Event::params_ready, [](Engine& e) {
      const MuonSelection selection(e.section("optimizer"));
      std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
      std::vector<std::string> names;
      for (const Param& p : e.params()) {
        // A placed parameter's own rows are what the rule sees (Note [Placed parameters]).
        shapes.emplace_back(p.name, p.tensor.sizes().vec());
        names.push_back(p.name);
      }
      selection.check_patterns_match(names);
      log::info(selection.report(shapes));
    });
  }
  std::unique_ptr<UpdateRule> create_update_rule(const std::string& name,
                                                 const ConfigSection& c) override {
    if (name == "adafactor") return make_adafactor(c);
    if (name == "adam8bit") return make_adam8bit(c);
    if (name == "sgd") return make_sgd(c);
    if (name == "lion") return make_lion(c);
    if (name == "muon") return make_muon(c);
    throw InternalError("plugin optim has no optimizer " + name);
  }
};

}  // namespace

std::unique_ptr<UpdateRule> make_sgd(const ConfigSection& c) { return std::make_unique<Sgd>(c); }
std::unique_ptr<UpdateRule> make_lion(const ConfigSection& c) { return std::make_unique<Lion>(c); }

void* current_cuda_stream(const c10::Device& device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStreamNativeHandle(impl->getStream(device));
}

}  // namespace loom::optim

LOOM_DEFINE_PLUGIN(loom::optim::OptimPlugin, "optim", "0.1.0")
