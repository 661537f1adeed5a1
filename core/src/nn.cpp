// loom::nn building blocks, written on ATen's functional ops (no torch::nn module headers: they
// cost compile time and would hide the adapter and interceptor slots loom needs).
#include "loom/nn.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cmath>
#include <unordered_map>

#include "loom/error.h"

namespace loom::nn {

Linear::Linear(int64_t in, int64_t out, bool with_bias) : in_features(in), out_features(out) {
  LOOM_CHECK(in > 0 && out > 0, "Linear needs positive sizes, got ", in, "x", out);
  // PyTorch's default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  weight = register_parameter("weight", at::empty({out, in}).uniform_(-bound, bound));
  if (with_bias) bias = register_parameter("bias", at::empty({out}).uniform_(-bound, bound));
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  // Note [Half matmuls through fp32]: on a CPU that emulates the half dtype, the product goes
  // through fp32 sgemm (under autocast its operands are narrowed first, as autocast's own
  // linear would).
  const bool autocast = x.is_cpu() && at::autocast::is_autocast_enabled(at::kCPU);
  const at::ScalarType half =
      autocast ? at::autocast::get_autocast_dtype(at::kCPU)
               : (x.scalar_type() == w.scalar_type() &&
                          (!b.defined() || b.scalar_type() == w.scalar_type())
                      ? x.scalar_type()
                      : at::kFloat);
  if (x.is_cpu() && half_matmul_path(half) == HalfMatmul::through_fp32) {  // fp32: native
    // Under autocast its cached cast, so Note [Cast once per update] holds here too.
    auto narrow = [&](const at::Tensor& t) {
      return autocast ? at::autocast::cached_cast(half, t, c10::DeviceType::CPU) : t;
    };
    return linear_through_fp32(narrow(x), narrow(w), b.defined() ? narrow(b) : b);
  }
  return at::linear(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
}

at::Tensor Linear::forward(const at::Tensor& x) {
  at::Tensor w = weight, b = bias;
  // A frozen weight held in half (Note [Frozen weights in half]) meeting an fp32 input outside
  // autocast (an evaluation forward of the caller's own): the input's dtype decides, as it
  // would have with the fp32 weight.
  if (!w.requires_grad() && w.scalar_type() != x.scalar_type() && x.scalar_type() == at::kFloat &&
      !at::autocast::is_autocast_enabled(x.device().type())) {
    w = w.to(at::kFloat);
    if (b.defined()) b = b.to(at::kFloat);
  }
  at::Tensor out = nn::linear(x, w, b);
  if (adapter_) out = out + adapter_->forward(x, out);
  return out;
}

std::vector<at::Tensor> frozen_linear_tensors(torch::nn::Module& model) {
  // Every place a tensor is registered, in the model's order: is each a Linear's weight/bias?
  std::vector<at::Tensor> order;
  std::unordered_map<const c10::TensorImpl*, bool> linear_only;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    const bool linear = dynamic_cast<const Linear*>(module.get()) != nullptr;
    for (const auto& p : module->named_parameters(/*recurse=*/false)) {
      auto [it, fresh] = linear_only.emplace(p.value().unsafeGetTensorImpl(), true);
      if (fresh) order.push_back(p.value());
      it->second = it->second && linear && (p.key() == "weight" || p.key() == "bias");
    }
  }
  std::vector<at::Tensor> out;
  for (const auto& t : order)
    if (!t.requires_grad() && linear_only.at(t.unsafeGetTensorImpl())) out.push_back(t);
  return out;
}

void Linear::set_adapter(std::shared_ptr<LinearAdapter> adapter) {
  // register_module replaces a child of the same name, so the adapter's parameters appear as
  // "<linear>.adapter.<name>" in named_parameters() and checkpoints.
  if (adapter) {
    adapter_ = register_module("adapter", std::move(adapter));
  } else if (adapter_) {
    unregister_module("adapter");
    adapter_.reset();
  }
}

Embedding::Embedding(int64_t num, int64_t dim) {
  LOOM_CHECK(num > 0 && dim > 0, "Embedding needs positive sizes, got ", num, "x", dim);
  weight = register_parameter("weight", at::randn({num, dim}));
}

at::Tensor Embedding::forward(const at::Tensor& ids) { return at::embedding(weight, ids); }

LayerNorm::LayerNorm(int64_t dim, double eps_, bool with_bias) : eps(eps_) {
  weight = register_parameter("weight", at::ones({dim}));
  if (with_bias) bias = register_parameter("bias", at::zeros({dim}));
}

at::Tensor LayerNorm::forward(const at::Tensor& x) {
  return at::layer_norm(x, {weight.size(0)}, weight,
                        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, eps);
}

RMSNorm::RMSNorm(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNorm::forward(const at::Tensor& x) {
  return rms_norm(x, weight, eps);
}

Attention::Attention(int64_t dim, int64_t heads, bool causal_, double dropout_, bool bias)
    : n_heads(heads), causal(causal_), dropout(dropout_) {
  LOOM_CHECK(heads > 0 && dim % heads == 0, "attention width ", dim,
             " must be divisible by the number of heads ", heads);
  qkv = register_module("qkv", std::make_shared<Linear>(dim, 3 * dim, bias));
  proj = register_module("proj", std::make_shared<Linear>(dim, dim, bias));
}

at::Tensor causal_mask(int64_t held, int64_t new_len, const at::TensorOptions& options) {
  // Query i sits at position held + i and sees keys 0..held+i.
  return at::ones({new_len, held + new_len}, options.dtype(at::kBool)).tril(held);
}

void KVCache::Layer::append(at::Tensor& k, at::Tensor& v) {
  if (keys.defined()) {
    k = at::cat({keys, k}, 2);
    v = at::cat({values, v}, 2);
  }
  keys = k;
  values = v;
}

at::Tensor Attention::forward(const at::Tensor& x, const at::Tensor& padding_mask,
                              KVCache::Layer* kv) {
  if (!kv) {
    UnitArgs args;
    args.padding_mask = padding_mask;
    return forward(x, args);
  }
  // x is (B,T,C); q, k, v are (B,H,T,D).
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / n_heads;
  const std::vector<at::Tensor> parts = qkv->forward(x).view({B, T, 3, n_heads, D}).unbind(2);
  at::Tensor q = parts[0].transpose(1, 2), k = parts[1].transpose(1, 2),
             v = parts[2].transpose(1, 2);
  std::optional<at::Tensor> mask;
  LOOM_CHECK(!padding_mask.defined(), "attention with a KV cache takes no padding mask");
  const int64_t held = kv->held();
  kv->append(k, v);
  // One new query sees every key; a longer chunk after earlier ones needs the offset mask
  // (SDPA's is_causal aligns the mask to the top left).
  if (held > 0 && T > 1 && causal) mask = causal_mask(held, T, x.options());
  at::Tensor y = attention(q, k, v, mask, 0.0, causal && held == 0 && T > 1);
  return proj->forward(y.transpose(1, 2).reshape({B, T, C}));
}

at::Tensor Attention::forward(const at::Tensor& x, const UnitArgs& args) {
  if (args.kv) return forward(x, args.padding_mask, args.kv);
  // x is (B,T,C); the core takes qkv's (B,T,3C) output to the (B,T,C) input of proj.
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / n_heads;
  std::optional<at::Tensor> mask;
  if (args.padding_mask.defined()) {
    at::Tensor keep = args.padding_mask.to(at::kBool).view({B, 1, 1, T});
    if (causal) keep = keep & at::ones({T, T}, keep.options()).tril().view({1, 1, T, T});
    mask = keep;
  }
  const int64_t H = n_heads;
  const double p = is_training() ? dropout : 0.0;
  const bool is_causal = causal && !mask.has_value();
  // By value: the region may run again in backward (Note [Recompute regions]).
  RegionFn core = [B, T, C, D, H, p, is_causal, mask](const std::vector<at::Tensor>& in) {
    // q, k and v (B, H, T, D) by one unbind of qkv's (B, T, 3, H, D) output, not three
    // selects: unbind's backward stacks the three gradients straight into qkv's layout (a
    // view of it: no copy after), where each select's wrote a zero-filled tensor of all three,
    // backward added the three, and the permuted sum was copied into qkv's layout.
    const std::vector<at::Tensor> parts = in[0].view({B, T, 3, H, D}).unbind(2);
    at::Tensor y = attention(parts[0].transpose(1, 2), parts[1].transpose(1, 2),
                             parts[2].transpose(1, 2), mask, p, is_causal);
    return y.transpose(1, 2).reshape({B, T, C});
  };
  return proj->forward(args.region(Region::attention, nullptr, {qkv->forward(x)}, core));
}

FeedForward::FeedForward(int64_t dim, int64_t hidden, Activation act, double dropout_, bool bias)
    : activation(act), dropout(dropout_) {
  fc_in = register_module("fc_in", std::make_shared<Linear>(dim, hidden, bias));
  fc_out = register_module("fc_out", std::make_shared<Linear>(hidden, dim, bias));
}

at::Tensor FeedForward::forward(const at::Tensor& x) {
  at::Tensor h = fc_in->forward(x);
  switch (activation) {
    case Activation::gelu: h = at::gelu(h); break;
    case Activation::gelu_tanh: h = at::gelu(h, "tanh"); break;
    case Activation::relu: h = at::relu(h); break;
  }
  return at::dropout(fc_out->forward(h), dropout, is_training());
}

TransformerBlock::TransformerBlock(const Options& o) : options(o) {
  norm1 = register_module("norm1", std::make_shared<LayerNorm>(o.dim, o.norm_eps, o.bias));
  attn = register_module("attn",
                         std::make_shared<Attention>(o.dim, o.n_heads, o.causal, o.attention_dropout, o.bias));
  norm2 = register_module("norm2", std::make_shared<LayerNorm>(o.dim, o.norm_eps, o.bias));
  ffn = register_module("ffn", std::make_shared<FeedForward>(o.dim, o.hidden, o.activation,
                                                             o.dropout, o.bias));
}

void TransformerBlock::set_feed_forward(std::shared_ptr<FeedForwardBase> replacement) {
  LOOM_CHECK(replacement, "set_feed_forward needs a module");
  ffn = replace_module("ffn", std::move(replacement));
}

at::Tensor TransformerBlock::forward(const at::Tensor& x, const UnitArgs& args) {
  const double p = is_training() ? options.dropout : 0.0;
  FeedForwardBase* mlp = ffn.get();
  auto feed_forward = [&args, mlp](const at::Tensor& in) {
    return args.region(Region::mlp, mlp, {in},
                       [mlp](const std::vector<at::Tensor>& v) { return mlp->forward(v[0]); });
  };
  if (options.pre_norm) {
    at::Tensor h = x + at::dropout(attn->forward(norm1->forward(x), args), p, true);
    return h + feed_forward(norm2->forward(h));
  }
  at::Tensor h = norm1->forward(x + at::dropout(attn->forward(x, args), p, true));
  return norm2->forward(h + feed_forward(h));
}

const char* to_string(Region region) {
  switch (region) {
    case Region::attention: return "attention";
    case Region::mlp: return "mlp";
  }
  return "?";
}

at::Tensor UnitArgs::region(Region region, torch::nn::Module* owner,
                            const std::vector<at::Tensor>& inputs, const RegionFn& fn) const {
  if (!run_region) return fn(inputs);
  return run_region(RegionCall{region, owner, inputs}, fn);
}

at::Tensor UnitInterceptor::intercept_region(int64_t, const RegionCall& call,
                                             const RegionFn& next) {
  return next(call.inputs);
}

namespace {

UnitBuildObserver* build_observer = nullptr;

// The tensors init_normal_ writes whole, whatever they held: under sharded initialization a
// unit's constructor values of these are never read (Note [Sharded initialization]).
std::vector<at::Tensor> rewritten_by_init(torch::nn::Module& unit) {
  std::vector<at::Tensor> out;
  auto add = [&out](const at::Tensor& t) {
    if (t.defined()) out.push_back(t);
  };
  std::vector<torch::nn::Module*> all{&unit};
  for (const auto& child : unit.modules(/*include_self=*/false)) all.push_back(child.get());
  for (torch::nn::Module* module : all) {
    if (auto* linear = dynamic_cast<Linear*>(module)) {
      add(linear->weight);
      add(linear->bias);
    } else if (auto* embedding = dynamic_cast<Embedding*>(module)) {
      add(embedding->weight);
    } else if (auto* norm = dynamic_cast<LayerNorm*>(module)) {
      add(norm->weight);
      add(norm->bias);
    } else if (auto* rms = dynamic_cast<RMSNorm*>(module)) {
      add(rms->weight);
    }
  }
  return out;
}

}  // namespace

UnitBuildObserver::~UnitBuildObserver() = default;

void set_unit_build_observer(UnitBuildObserver* observer) { build_observer = observer; }
UnitBuildObserver* unit_build_observer() { return build_observer; }

void release_storage(const at::Tensor& tensor) {
  c10::StorageImpl& storage = *tensor.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  storage.set_data_ptr_noswap(storage.allocator()->allocate(0));
  storage.set_nbytes(0);
}

void restore_storage(const at::Tensor& tensor) {
  c10::StorageImpl& storage = *tensor.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
  if (storage.nbytes() == bytes) return;
  storage.set_data_ptr_noswap(storage.allocator()->allocate(bytes));
  storage.set_nbytes(bytes);
}

bool storage_released(const at::Tensor& tensor) {
  return tensor.defined() && tensor.numel() > 0 && tensor.has_storage() &&
         tensor.storage().nbytes() == 0;
}

void UnitList::push_back(std::shared_ptr<Unit> unit) {
  Unit& added = *unit;
  units_.push_back(register_module(std::to_string(units_.size()), std::move(unit)));
  if (!build_observer) return;
  // Note [Sharded initialization], step 1: what init_normal_ will overwrite holds no bytes
  // until then, so the model's units are never whole at once.
  for (const at::Tensor& t : rewritten_by_init(added)) release_storage(t);
  build_observer->unit_constructed(added);
}

void UnitList::set_interceptors(std::vector<std::shared_ptr<UnitInterceptor>> interceptors) {
  interceptors_ = std::move(interceptors);
}

at::Tensor UnitList::forward(const at::Tensor& x, const UnitArgs& args) {
  at::Tensor h = x;
  for (size_t i = 0; i < units_.size(); ++i) {
    Unit& unit = *units_[i];
    UnitArgs unit_args = args;
    if (args.cache) {
      if (args.cache->layers.size() < units_.size()) args.cache->layers.resize(units_.size());
      unit_args.kv = &args.cache->layers[i];
    }
    if (!interceptors_.empty()) {
      // A region runs through the interceptors' intercept_region, the first added outermost;
      // by value, as the unit's args (a region may run again in backward).
      const auto index = static_cast<int64_t>(i);
      unit_args.run_region = [chain = interceptors_, index](const RegionCall& call,
                                                            const RegionFn& fn) {
        RegionFn run = fn;
        for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
          UnitInterceptor* interceptor = it->get();
          run = [interceptor, index, region = call.region, owner = call.owner,
                 inner = std::move(run)](const std::vector<at::Tensor>& inputs) {
            return interceptor->intercept_region(index, RegionCall{region, owner, inputs}, inner);
          };
        }
        return run(call.inputs);
      };
    }
    // args by value: an interceptor may keep `next` and call it again after forward returned
    // (checkpointing recomputes the unit in backward).
    UnitFn run = [&unit, unit_args](const at::Tensor& input) {
      return unit.forward(input, unit_args);
    };
    // The first interceptor added is the outermost: wrap from the last one inwards.
    for (auto it = interceptors_.rbegin(); it != interceptors_.rend(); ++it) {
      UnitFn inner = std::move(run);
      UnitInterceptor* interceptor = it->get();
      const auto index = static_cast<int64_t>(i);
      run = [interceptor, index, &unit, inner = std::move(inner)](const at::Tensor& input) {
        return interceptor->intercept(index, unit, input, inner);
      };
    }
    h = run(h);
  }
  return h;
}

namespace {

void init_module(torch::nn::Module* module, double std) {
  // Note [Sharded initialization], step 2: what was released at construction gets bytes again
  // (the tensors written below, all of them whole).
  if (dynamic_cast<Linear*>(module) || dynamic_cast<Embedding*>(module) ||
      dynamic_cast<LayerNorm*>(module) || dynamic_cast<RMSNorm*>(module))
    for (const at::Tensor& t : module->parameters(/*recurse=*/false))
      if (storage_released(t)) restore_storage(t);
  if (auto* linear = dynamic_cast<Linear*>(module)) {
    linear->weight.normal_(0.0, std);
    if (linear->bias.defined()) linear->bias.zero_();
  } else if (auto* embedding = dynamic_cast<Embedding*>(module)) {
    embedding->weight.normal_(0.0, std);
  } else if (auto* norm = dynamic_cast<LayerNorm*>(module)) {
    norm->weight.fill_(1.0);
    if (norm->bias.defined()) norm->bias.zero_();
  } else if (auto* rms = dynamic_cast<RMSNorm*>(module)) {
    rms->weight.fill_(1.0);
  }
}

// Pre-order, children in registration order: the order of modules(include_self), so the
// generator's draws land where they always did. A UnitList's units are finished one by one.
void init_tree(torch::nn::Module* module, double std,
               const std::function<void(Unit&)>& finish_unit) {
  init_module(module, std);
  const bool list = dynamic_cast<UnitList*>(module) != nullptr;
  for (const auto& child : module->children()) {
    auto* unit = list ? dynamic_cast<Unit*>(child.get()) : nullptr;
    init_tree(child.get(), std, finish_unit);
    if (!unit) continue;
    if (finish_unit) finish_unit(*unit);
    if (build_observer) build_observer->unit_initialised(*unit);
  }
}

}  // namespace

void init_normal_(torch::nn::Module& module, double std) { init_normal_(module, std, {}); }

void init_normal_(torch::nn::Module& module, double std,
                  const std::function<void(Unit&)>& finish_unit) {
  at::NoGradGuard no_grad;
  init_tree(&module, std, finish_unit);
}

}  // namespace loom::nn
