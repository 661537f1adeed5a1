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

}  // namespace loom

#pragma GCC visibility pop
