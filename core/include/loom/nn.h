// loom/nn.h — the building blocks a model uses to get every plugin: Linear (with an adapter
// slot for LoRA), Embedding, LayerNorm, RMSNorm, Attention (LibTorch's
// scaled_dot_product_attention, so fused kernels are used where the build has them),
// FeedForward (replaceable, e.g. by MoE), TransformerBlock, and UnitList, which runs the
// repeated layers through the plugins' interceptor chain (checkpointing, ZeRO-3 gather).
// Shapes: B batch, T sequence, C channels, H heads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::nn {

// Something added to a Linear's output: out = base_out + adapter(x, base_out). LoRA is one.
class LinearAdapter : public torch::nn::Module {
 public:
  // x is (..., in_features), base_out (..., out_features); returns the (..., out_features) delta.
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& base_out) = 0;
};

// Note [Half matmuls through fp32]: a CPU without instructions for a half dtype (bf16 needs
// AVX-512 BF16 or AMX; fp16 AVX-512 FP16 or AMX-FP16) has LibTorch emulate it: its bf16 GEMM
// on an AVX2-only EPYC ran a 512 x 768 x 3072 product 10x slower than fp32 sgemm (488 against
// 50 ms, one thread), and a 2-layer GPT-2 step in full_bf16 took 594 s (docs/BENCHMARKS.md
// "Half matmuls through fp32"). Such a CPU instead widens the operands to fp32 (exact: every
// bf16 and fp16 value is an fp32), runs MKL's sgemm, and rounds the product to the half dtype
// once, which is what a half GEMM computes (fp32 accumulation, one rounding of the output) in
// another summation order; backward does the same for both products. The weight is widened
// 4 MiB of rows at a time into a buffer each thread keeps (Note [Widened blocks kept] in
// half_matmul.cpp: fresh blocks fragmented the kept heap); forward saves the half input and
// the weight itself, as the half GEMM's autograd does. Linear, attention() and the fused loss (Note [Fused linear
// cross-entropy] in loom/loss.h; its head, too, a block of rows at a time, not widened whole)
// do it. Which CPUs: the oneDNN level in effect (Note [CPU
// kernel probe]) decides, so a job capped by [train] cpu_isa below bf16 widens too.
// LOOM_HALF_MATMUL=native or =fp32 forces either path (the tests run both on every CPU).
enum class HalfMatmul {
  native,        // LibTorch's half GEMM (oneDNN)
  through_fp32,  // operands widened, sgemm, the product rounded once
};

// The path for `dtype` (kBFloat16 or kHalf; anything else is native) on this CPU.
HalfMatmul half_matmul_path(c10::ScalarType dtype);

// Replaces the CPU's and LOOM_HALF_MATMUL's choice in this process (nullopt: theirs again).
void set_half_matmul_override(std::optional<HalfMatmul> path);

// x (..., in) times w (out, in) transposed plus b (out, or undefined), all of one half dtype,
// through fp32 as the Note says; differentiable in all three.
at::Tensor linear_through_fp32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

// at::linear(x, w, b) on the path the Note picks: where the product's half dtype (autocast's
// on a CPU under autocast, its operands narrowed by autocast's own cached cast; else x's,
// when w and b share it) is one this CPU emulates, linear_through_fp32; anywhere else
// at::linear itself. Linear::forward, tied heads, LoRA's adapters and MoE's experts call it:
// a plugin's own products should too, or they run LibTorch's emulated half GEMM there.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// at::scaled_dot_product_attention(q, k, v, mask, dropout, causal); where q's dtype is a half
// dtype this CPU emulates, with q, k, v (and a float mask) widened to fp32 and the output
// rounded back (LibTorch's CPU flash attention multiplies half blocks with the same emulated
// GEMM). Differentiable. Models call it instead of at::scaled_dot_product_attention.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout, bool causal);

// A Llama layer's elementwise parts, each one pass forward and one backward on the CPU (fp32
// and bf16; Note [Fused row ops] in core/src/fused_ops.cpp), ATen's composite ops elsewhere.
// Differentiable; values agree with the composite ops to fp32 rounding (bf16: bf16 rounding).
// rms_norm: x (..., C) / sqrt(mean(x², -1) + eps) · weight (C), reduced in fp32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// swiglu: silu(gate) · up, gate and up of one shape.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
// rotary: x (..., T, D) · cos + rotate_half(x) · sin, with cos and sin (T, D) and
// rotate_half(x) = cat(−x[..., D/2:], x[..., :D/2]) (transformers' RoPE); not differentiable
// in cos and sin on the kernel's path (they are constants of the positions).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

class Linear : public torch::nn::Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  at::Tensor forward(const at::Tensor& x);  // (..., in) -> (..., out)
  void set_adapter(std::shared_ptr<LinearAdapter> adapter);  // nullptr removes it
  LinearAdapter* adapter() const { return adapter_.get(); }
  int64_t in_features, out_features;
  at::Tensor weight;  // (out, in)
  at::Tensor bias;    // (out) or undefined

 private:
  std::shared_ptr<LinearAdapter> adapter_;
};

// Note [Frozen weights in half]: the parameters of `model` that train nothing (requires_grad
// false) and that it holds only as a Linear's weight or bias (by registration: a tensor tied to
// an Embedding or any other module is not one). Under autocast a Linear's operands are cast to
// the half dtype at every forward, so such a tensor can be stored in that dtype instead: the
// same bits reach the matmul, with no cast and half the bytes. The precision plugin does so
// (`[precision] frozen_weights`); LoRA's frozen base is the case it is for.
std::vector<at::Tensor> frozen_linear_tensors(torch::nn::Module& model);

class Embedding : public torch::nn::Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim);
  at::Tensor forward(const at::Tensor& ids);  // (...) int64 -> (..., dim)
  at::Tensor weight;  // (num, dim)
};

class LayerNorm : public torch::nn::Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;
  double eps;
};

class RMSNorm : public torch::nn::Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};

// Note [KV cache]: decoding a token at a time (`loom generate`) keeps each layer's keys and
// values of the positions seen so far, so a new token attends to them without recomputing
// them. A model's decode() passes the cache in UnitArgs; UnitList hands unit i its layers[i];
// an attention layer appends its new keys and values and attends over all of them.
struct KVCache {
  struct Layer {
    at::Tensor keys, values;  // (B, H_kv, T_held, D); undefined before the first call
    int64_t held() const { return keys.defined() ? keys.size(2) : 0; }
    // This call's keys and values (B, H_kv, T, D) kept after the held ones; k and v become
    // the whole sequences the queries attend to.
    void append(at::Tensor& k, at::Tensor& v);
  };
  std::vector<Layer> layers;  // one per unit, grown by UnitList
  int64_t length = 0;         // positions held; the model advances it after each call
};

// Causal attention's mask for `new_len` queries at positions held..held+new_len-1 over
// held+new_len keys: (new_len, held+new_len) bool, true = attend.
at::Tensor causal_mask(int64_t held, int64_t new_len, const at::TensorOptions& options);

struct UnitArgs;

// Multi-head self-attention. x (B,T,C); padding_mask, when defined, is (B,T) with 1 = keep;
// kv, when given, holds the earlier positions' keys and values (Note [KV cache]).
class Attention : public torch::nn::Module {
 public:
  Attention(int64_t dim, int64_t n_heads, bool causal, double dropout, bool bias = true);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& padding_mask = {},
                     KVCache::Layer* kv = nullptr);
  // As above, with the attention core run as a region (Note [Recompute regions]).
  at::Tensor forward(const at::Tensor& x, const UnitArgs& args);
  int64_t n_heads;
  bool causal;
  double dropout;
  std::shared_ptr<Linear> qkv, proj;
};

// What a block's MLP must be; MoE replaces FeedForward with another implementation.
class FeedForwardBase : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;  // (B,T,C) -> (B,T,C)
};

class FeedForward : public FeedForwardBase {
 public:
  enum class Activation { gelu, gelu_tanh, relu };
  FeedForward(int64_t dim, int64_t hidden, Activation activation, double dropout, bool bias = true);
  at::Tensor forward(const at::Tensor& x) override;
  std::shared_ptr<Linear> fc_in, fc_out;
  Activation activation;
  double dropout;
};

// Note [Recompute regions]: a unit marks the parts of its forward that an interceptor may run
// differently (selective activation checkpointing recomputes just one in backward) by running
// them through UnitArgs::region. A region is a pure function of its inputs and of the
// parameters of the module it names: `fn` must capture by value whatever else it reads (it may
// run again in backward, after the unit's forward returned), must not touch a KV cache, and
// uses no trainable tensor that the named module does not hold (its gradient would be lost).
//   attention: the attention core, from the q/k/v projections' outputs to the output
//              projection's input (scores, softmax, attention dropout): no parameters.
//   mlp:       the MLP (FeedForwardBase, fc_in -> activation -> fc_out, its dropout included).
enum class Region { attention, mlp };
const char* to_string(Region region);
using RegionFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
struct RegionCall {
  Region region;
  torch::nn::Module* owner;  // whose parameters the region uses; null for none
  const std::vector<at::Tensor>& inputs;
};

// Arguments a unit needs besides the activation; fixed for one forward.
struct UnitArgs {
  at::Tensor padding_mask;     // (B,T) or undefined
  KVCache* cache = nullptr;    // decoding (Note [KV cache]); null in training
  KVCache::Layer* kv = nullptr;  // this unit's layer of `cache`, set by UnitList
  // Runs a region through the UnitList's interceptors (set by UnitList; empty: fn runs as is).
  std::function<at::Tensor(const RegionCall&, const RegionFn&)> run_region;
  // Note [Recompute regions]: fn(inputs), or what the interceptors make of it.
  at::Tensor region(Region region, torch::nn::Module* owner, const std::vector<at::Tensor>& inputs,
                    const RegionFn& fn) const;
};

// One repeated layer.
class Unit : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x, const UnitArgs& args) = 0;
};

// A transformer layer: pre-norm (GPT-2) or post-norm (BERT).
class TransformerBlock : public Unit {
 public:
  struct Options {
    int64_t dim = 768, n_heads = 12, hidden = 3072;
    bool causal = true, pre_norm = true, bias = true;
    double dropout = 0.0, attention_dropout = 0.0, norm_eps = 1e-5;
    FeedForward::Activation activation = FeedForward::Activation::gelu_tanh;
  };
  explicit TransformerBlock(const Options& options);
  at::Tensor forward(const at::Tensor& x, const UnitArgs& args) override;
  void set_feed_forward(std::shared_ptr<FeedForwardBase> ffn);  // MoE's hook
  std::shared_ptr<LayerNorm> norm1, norm2;
  std::shared_ptr<Attention> attn;
  std::shared_ptr<FeedForwardBase> ffn;
  Options options;
};

using UnitFn = std::function<at::Tensor(const at::Tensor&)>;

// Wraps the running of one unit. Calls next(x) to run the rest of the chain (and finally the
// unit), or runs it differently (recompute in backward, gather sharded params first...).
class UnitInterceptor {
 public:
  virtual ~UnitInterceptor();
  virtual std::string name() const = 0;
  // index: the unit's position in its UnitList; x: its input activation.
  virtual at::Tensor intercept(int64_t index, Unit& unit, const at::Tensor& x,
                               const UnitFn& next) = 0;
  // A region of unit `index` (Note [Recompute regions]): next(inputs) runs the rest of the
  // chain and finally the region; an interceptor may keep next and call it again later. By
  // default the region runs as is.
  virtual at::Tensor intercept_region(int64_t index, const RegionCall& call, const RegionFn& next);
};

// The repeated layers. Units run in order; each through the interceptors (first added is the
// outermost).
class UnitList : public torch::nn::Module {
 public:
  UnitList() = default;
  void push_back(std::shared_ptr<Unit> unit);
  at::Tensor forward(const at::Tensor& x, const UnitArgs& args = {});
  size_t size() const { return units_.size(); }
  Unit& operator[](size_t i) { return *units_.at(i); }
  std::shared_ptr<Unit> unit_ptr(size_t i) const { return units_.at(i); }
  void set_interceptors(std::vector<std::shared_ptr<UnitInterceptor>> interceptors);
  const std::vector<std::shared_ptr<UnitInterceptor>>& interceptors() const {
    return interceptors_;
  }

 private:
  std::vector<std::shared_ptr<Unit>> units_;
  std::vector<std::shared_ptr<UnitInterceptor>> interceptors_;
};

// Note [Auxiliary losses]: returns x unchanged, but backward also sends `aux_loss` (a 0-d
// tensor with a graph) the gradient the engine's objective gives it: loss_scale /
// accumulation_steps, set by the engine before each backward. So a layer's auxiliary loss
// trains its parameters wherever the layer runs, a recomputed (checkpointed) unit included;
// its detached value is also collected for Output::aux_loss.
at::Tensor attach_aux_loss(const at::Tensor& x, const at::Tensor& aux_loss);

namespace detail {
// The engine's side of attach_aux_loss: the gradient its backward gives an auxiliary loss, and
// the collection of the values attached since the last reset (summed; undefined for none).
void set_aux_loss_grad_scale(double scale);
void reset_aux_losses();
at::Tensor collected_aux_losses();
}  // namespace detail

// GPT-2's initialisation: weights N(0, std), biases 0, norms 1/0. Deterministic given the
// global generator's state. Modules are visited in modules() order (pre-order); `finish_unit`,
// when given, runs on each unit of a UnitList as soon as its own modules are initialised
// (the model's per-unit finishing touches, e.g. GPT-2's scaled residual projections): under
// sharded initialization (Note [Sharded initialization]) that is the last moment the unit is
// whole.
void init_normal_(torch::nn::Module& module, double std = 0.02);
void init_normal_(torch::nn::Module& module, double std,
                  const std::function<void(Unit&)>& finish_unit);

// A weight's bytes freed while it keeps its shape, dtype, autograd identity and storage object
// (FSDP's resize-to-zero; Note [Releasing a weight] in sharding/src/zero_gather.cpp), and given
// bytes again (uninitialised). released: it has elements but its storage holds no bytes.
void release_storage(const at::Tensor& tensor);
void restore_storage(const at::Tensor& tensor);
bool storage_released(const at::Tensor& tensor);

// Note [Sharded initialization]: at ZeRO stage 3 no rank should ever hold the whole model,
// not even while it is built. An observer installed around a model's construction (the zero
// plugin's, sharding/sharded_init.h) sees each unit of every UnitList as it is built:
//   1. UnitList::push_back: the unit is constructed. Its constructor's random draws are made
//      (they move the global generator exactly as without the observer) but its values are
//      not final: the tensors init_normal_ overwrites (Linear, Embedding, LayerNorm, RMSNorm
//      weights and biases) are released at once, and the observer's unit_constructed runs.
//   2. init_normal_ reaching the unit: those tensors get bytes again, are initialised in the
//      same order with the same draws, the model's finish_unit runs, then the observer's
//      unit_initialised: it keeps this rank's part and releases the rest. So one unit at a
//      time is whole, and every value is bitwise what the unobserved build gives.
//   3. pretrained::assign, for a weight the observer released: the observer's assign copies
//      only the elements it keeps from the source (a read-only map of the file).
// A model keeps its units' values final once init_normal_ has finished them: code that reads
// or writes a unit's weights after that (other than assign) needs the whole model, and the
// observer's user must refuse it. Without an observer (the default) nothing changes.
class UnitBuildObserver {
 public:
  virtual ~UnitBuildObserver();
  virtual void unit_constructed(Unit& unit) = 0;
  virtual void unit_initialised(Unit& unit) = 0;
  // `target` is a weight this observer released; `source` (the same shape, any dtype and
  // strides) holds its values. Returns false for a tensor the observer does not keep.
  virtual bool assign(const at::Tensor& target, const at::Tensor& source) = 0;
};
// One per process, installed for the duration of a model's construction; null removes it.
void set_unit_build_observer(UnitBuildObserver* observer);
UnitBuildObserver* unit_build_observer();

}  // namespace loom::nn

#pragma GCC visibility pop
