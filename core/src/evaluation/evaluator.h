// evaluation/evaluator.h (core-internal) — Note [Evaluation]: the evaluation set, split over the
// ranks, read in order, and the numbers it gives, summed exactly over the ranks.
#pragma once

#include <c10/core/Device.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/batch.h"
#include "loom/config.h"
#include "loom/data.h"

namespace loom {

class Comm;

// Note [Evaluation]: evaluation runs the model in eval mode without gradients over the whole
// evaluation set, [eval_data] or [data] validation_split's held-out share, after the steps
// eval_strategy names (and before the first, with eval_on_start). Rank r reads samples r, r+W,
// r+2W... in order (no shuffle, nothing dropped, nothing repeated), per_device_eval_batch_size
// at a time; every rank runs the same number of forwards (ZeRO-3's gathers and expert
// parallelism's all-to-alls are collectives), a rank whose share ran out runs one sample with
// every label kIgnoreIndex, which counts nothing. The numbers are sums over every target of
// every rank (loss, targets, correct predictions, per-class counts), all-reduced once, so the
// result is the one-process result whatever the world size: eval_loss is token-weighted like
// the training loss (Note [Loss normalisation]), not a mean of per-batch means.
//
// Evaluation never changes training: the engine fires before_forward/after_forward with
// TrainState::evaluating set (autocast, MoE's eval capacity) and nothing else; eval mode draws
// no random numbers (no dropout, no router jitter); the evaluation set is its own source, so
// the training data's position and its preload workers are untouched. The weights after N steps
// are bitwise those of the same run without evaluation (tests/core/test_evaluation.cpp).
//
// Metrics (Hugging Face's names): eval_loss always; for language models (labels (B, T))
// eval_perplexity = exp(eval_loss); for classifiers (labels (B)) eval_accuracy and eval_f1,
// scikit-learn's macro F1: the mean over the classes that occur among the labels or the
// predictions of 2TP / (2TP + FP + FN); and eval_runtime (s), eval_samples_per_second,
// eval_steps_per_second (batches of one rank per second), eval_samples.
class Evaluator {
 public:
  struct Options {
    int64_t batch_size = 8;
    int rank = 0, world_size = 1;
  };
  using Forward = std::function<Output(const Batch&)>;
  using Metrics = std::vector<std::pair<std::string, double>>;

  Evaluator(std::shared_ptr<const Dataset> dataset, Options options);
  // Forwards per rank: the same on every rank.
  int64_t batches() const { return batches_; }
  std::string describe() const;
  // Whether the set holds one label per sample (a classifier's), judged by its first sample.
  bool classifies() const;
  // Every batch of this rank's share through `forward`; every rank must call it together.
  // `comm` may be null for one process.
  Metrics run(const Forward& forward, Comm* comm) const;

 private:
  Batch batch(int64_t k) const;

  std::shared_ptr<const Dataset> dataset_;
  Options options_;
  int64_t batches_ = 0;
};

// eval_strategy = "steps"'s interval: eval_steps, or (0) logging_steps as the Trainer does (at
// least 1). The engine evaluates by it and `loom check` checks load_best_model_at_end's saves
// against it.
inline int64_t evaluation_interval(const ConfigSection& train) {
  const int64_t steps = train.get_int("eval_steps");
  return steps > 0 ? steps : std::max<int64_t>(1, train.get_int("logging_steps"));
}

// The sums one evaluation gathers, on the host or the device, and the metrics they give. The
// classification counts have one entry per class (the logits' width).
struct EvalTotals {
  double loss_sum = 0;
  int64_t targets = 0, samples = 0, correct = 0;
  bool classification = false;
  std::vector<int64_t> true_positive, predicted, actual;  // per class

  // Adds one batch: its output and labels on the host (labels (B) for classification).
  void add(const Output& output, const Batch& batch);
  Evaluator::Metrics metrics(double seconds, int64_t batches) const;
};

// [data] validation_split: the dataset's samples split once, seeded: a share `fraction` (rounded
// up, at least one sample, never all) for evaluation, the rest for training, each in the
// dataset's own order.
struct SplitDatasets {
  std::shared_ptr<const Dataset> train, eval;
};
SplitDatasets split_for_validation(std::shared_ptr<const Dataset> dataset, double fraction,
                                   uint64_t seed);

}  // namespace loom
