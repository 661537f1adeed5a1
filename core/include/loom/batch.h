// loom/batch.h — what flows from the data source into a model, and what comes back.
// Plain data: no behaviour beyond counting and moving.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

// Label value that no loss is computed for (the convention of PyTorch and Hugging Face).
inline constexpr int64_t kIgnoreIndex = -100;

// A micro-batch. input_ids is (B,T) int64. labels is (B,T) int64 for language modelling
// (kIgnoreIndex where no loss is wanted) or (B) for sequence classification.
// attention_mask (B,T), when defined, is 1 for real tokens and 0 for padding.
struct Batch {
  at::Tensor input_ids;
  at::Tensor labels;
  at::Tensor attention_mask;
  at::Tensor token_type_ids;
  std::vector<int64_t> sample_indices;  // dataset index of each row, for errors and checks

  int64_t num_samples() const { return input_ids.defined() ? input_ids.size(0) : 0; }
  int64_t num_tokens() const { return input_ids.defined() ? input_ids.numel() : 0; }
  // Loss targets in this micro-batch: the labels that are not kIgnoreIndex.
  int64_t num_loss_targets() const;
  Batch to(c10::Device device, bool non_blocking = false) const;
};

// A model's answer. loss_sum is the *sum* of the per-target losses (fp32 scalar), so the engine
// can normalise by the targets of the whole accumulation window (see Note [Loss normalisation]
// in engine.cpp); num_targets is how many targets it summed.
struct Output {
  at::Tensor loss_sum;
  at::Tensor logits;
  int64_t num_targets = 0;
};

}  // namespace loom

#pragma GCC visibility pop
