// loom/model.h — the model contract: a torch::nn::Module with forward(Batch) -> Output.
// Models built from loom::nn blocks get every plugin (LoRA, checkpointing, MoE, ZeRO-3); a model
// of plain torch::nn pieces still trains with precision, optimizers, DDP and ZeRO-1/2.
#pragma once

#include <torch/nn/module.h>

#include "loom/batch.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

class Model : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  virtual Output forward(const Batch& batch) = 0;
  // Names of parameters that take no weight decay (biases, norm weights, embeddings' ties...).
  // Default: every parameter of rank < 2.
  virtual bool no_weight_decay(const std::string& param_name, const at::Tensor& param) const;
};

namespace nn {
struct KVCache;
}

// A model `loom generate` can continue text with: a causal language model that decodes with a
// KV cache (Note [KV cache] in loom/nn.h). Implemented beside Model by gpt and llama.
class CausalLM {
 public:
  virtual ~CausalLM();
  // ids (B, T_new) continue the sequences `cache` holds (empty at first: the prompt). Returns
  // the next-token logits of every new position, (B, T_new, V), and extends the cache by T_new.
  virtual at::Tensor decode(const at::Tensor& ids, nn::KVCache& cache) = 0;
  // The longest sequence (prompt and generated tokens) the model takes.
  virtual int64_t max_positions() const = 0;
};

}  // namespace loom

#pragma GCC visibility pop
