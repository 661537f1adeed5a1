// evaluation/best_model.h (core-internal) — Note [Best model]: the best evaluation so far, the
// checkpoint that holds it, and early stopping.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom {

class ConfigSection;

// Note [Best model]: Hugging Face's Trainer semantics. metric_for_best_model names an
// evaluation metric ("loss" means "eval_loss": the prefix is added), by default eval_loss when
// load_best_model_at_end or early stopping asks for one; greater_is_better defaults to false for
// a loss or a perplexity, true otherwise. After each evaluation of a training step (not
// eval_on_start's, not a Trainer::evaluate() call): early stopping first compares the value with
// the best so far, an improvement of more than early_stopping_threshold resetting the patience
// count and anything else adding one (EarlyStoppingCallback), and training stops after the step
// whose evaluation brings the count to early_stopping_patience; then a better value (any margin)
// becomes the best. A checkpoint saved at the best evaluation's step is the best checkpoint:
// save_total_limit never deletes it (it counts as one of the kept, but the newest also stays
// when the limit is 1, as in the Trainer), every checkpoint's manifest records the best value,
// its step, the best checkpoint and the patience count, so a resumed run goes on with them, and
// with load_best_model_at_end the run ends by loading it. load_best_model_at_end needs a
// checkpoint at evaluation steps: eval_strategy "steps" and save_steps a multiple of the
// evaluation interval (the Trainer's rule).
class BestModel {
 public:
  struct Options {
    std::string metric;  // "" = nothing tracked
    bool greater_is_better = false;
    int64_t patience = 0;  // 0 = no early stopping
    double threshold = 0.0;
    bool load_at_end = false;
  };
  using Metrics = std::vector<std::pair<std::string, double>>;

  BestModel() = default;
  explicit BestModel(Options options) : options_(std::move(options)) {}
  // From [train]'s keys, with the defaults above.
  static Options options_from(const ConfigSection& train);

  const Options& options() const { return options_; }
  bool tracking() const { return !options_.metric.empty(); }
  // After an evaluation at `step`. The metric must be among `metrics` (a ConfigError otherwise).
  void observe(int64_t step, const Metrics& metrics);
  bool should_stop() const { return options_.patience > 0 && patience_count_ >= options_.patience; }
  // A checkpoint of `step` is about to be written: if it holds the best evaluation, it becomes
  // the best checkpoint.
  void saving(int64_t step);
  // The step of the best checkpoint, which rotation keeps; -1 when none.
  int64_t best_checkpoint_step() const { return best_checkpoint_step_; }
  bool has_best() const { return best_step_ >= 0; }
  double best_value() const { return best_value_; }
  int64_t best_step() const { return best_step_; }
  int64_t patience_count() const { return patience_count_; }
  // Manifest values ("best.metric", ...) and back.
  void save(std::map<std::string, std::string>& values) const;
  void load(const std::map<std::string, std::string>& values);

 private:
  bool better(double value, double than) const {
    return options_.greater_is_better ? value > than : value < than;
  }
  Options options_;
  double best_value_ = 0;
  int64_t best_step_ = -1, best_checkpoint_step_ = -1, patience_count_ = 0;
};

}  // namespace loom
