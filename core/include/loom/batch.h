// loom/batch.h — what flows from the data source into a model, and what comes back.
// Plain data: no behaviour beyond counting and moving.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
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

  // Counts taken on the host before the batch moves to a GPU, so a model reading them there
  // costs no device-to-host sync (a GPU .item() stalls the whole stream). The engine fills them
  // for every batch it draws; `to()` and `pinned()` carry them along.
  struct HostStats {
    bool known = false;
    int64_t loss_targets = 0;
    int64_t min_input_id = 0, max_input_id = -1;
    int64_t max_label = -1;
  } host_stats;

  int64_t num_samples() const { return input_ids.defined() ? input_ids.size(0) : 0; }
  int64_t num_tokens() const { return input_ids.defined() ? input_ids.numel() : 0; }
  // Loss targets in this micro-batch: the labels that are not kIgnoreIndex.
  int64_t num_loss_targets() const;
  // Smallest and largest token id of input_ids ({0, -1} when empty).
  std::pair<int64_t, int64_t> input_id_range() const;
  // Largest label (-1 when there are none).
  int64_t max_label() const;
  // Fills host_stats from this (CPU) batch.
  void compute_host_stats();
  Batch to(c10::Device device, bool non_blocking = false) const;
  // A copy whose CPU tensors are in page-locked memory (for asynchronous copies to a GPU).
  Batch pinned() const;
};

// A model's answer. loss_sum is the *sum* of the per-target losses (fp32 scalar), so the engine
// can normalise by the targets of the whole accumulation window (see Note [Loss normalisation]
// in engine.cpp); num_targets is how many targets it summed.
struct Output {
  at::Tensor loss_sum;
  at::Tensor logits;
  int64_t num_targets = 0;
  // Note [Auxiliary losses]: the forward's auxiliary losses (MoE load balancing, router
  // z-loss...), already weighted by their coefficients and summed: a 0-d fp32 tensor, or
  // undefined for none. A model may set it itself, with a graph: the engine then adds
  // aux_loss / accumulation_steps to what backward runs on. Losses a layer adds with
  // nn::attach_aux_loss (which also works inside recomputed, checkpointed units) arrive here
  // detached from the engine, for the report only: their gradient flows through the activation
  // they were attached to. Either way the engine reports the window's mean as `aux_loss` in
  // metrics.jsonl; the reported `loss` stays the task's loss alone.
  at::Tensor aux_loss;
};

}  // namespace loom

#pragma GCC visibility pop
