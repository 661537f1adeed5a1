// evaluation/training_evaluation.h (core-internal) — evaluation within a training run: the
// evaluation set taken from the job (Note [Evaluation], evaluator.h), the moments eval_strategy
// names, one evaluation run with the model in eval mode, and what each evaluation decides: the
// best model and early stopping (Note [Best model], best_model.h). The engine fires the events
// around it and owns the forward; this unit never touches the training data or its position.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "evaluation/best_model.h"
#include "evaluation/evaluator.h"
#include "loom/data.h"
#include "loom/engine.h"
#include "loom/trainer.h"
#include "resolve.h"

namespace loom {

class Comm;
class Model;

class TrainingEvaluation {
 public:
  // The evaluation set: [data] validation_split's share, taken out of `dataset` (the training
  // set, which keeps the rest) with `split_seed`, or [eval_data]'s source, made by its plugin
  // with `engine`; none when the job has neither. An [eval_data] label map other than the
  // training data's, and a metric_for_best_model the set's labels never give, are ConfigErrors
  // said now rather than at the first evaluation.
  TrainingEvaluation(const ResolvedJob& job, Engine& engine,
                     std::shared_ptr<const Dataset>& dataset, uint64_t split_seed, int rank,
                     int world_size);

  bool has_set() const { return evaluator_ != nullptr; }
  // eval_on_start: one evaluation before the first step.
  bool on_start() const { return has_set() && on_start_; }
  // For the setup log: the set and when it is evaluated ("... ; evaluated every 50 steps").
  std::string describe() const;
  // After training step `step`: whether eval_strategy evaluates now ("steps": every
  // evaluation_interval; "epoch": the step took an epoch's last batch, the data's epoch before
  // the step being `epoch_before`).
  bool due(int64_t step, const DataSource& data, int64_t epoch_before) const;
  // One evaluation of the whole set through `forward` (which places the batch and fires the
  // events): `model` in eval mode without gradients and `state.evaluating` set, both back to
  // training however it ends. Every rank together; `comm` null for one process.
  Evaluator::Metrics run(Model& model, TrainState& state, const Evaluator::Forward& forward,
                         Comm* comm) const;
  // After a training step's evaluation: the best model and early stopping (said once).
  void observe(int64_t step, const Evaluator::Metrics& metrics);
  bool stopped_early() const { return stopped_early_; }
  // Checkpoints record it and rotation keeps its checkpoint (run_saves.h); a resume restores it.
  BestModel& best() { return best_; }
  // At the end of a run that reached step `step`: the best checkpoint into `summary`, said in
  // the log. Returns the folder the run must load (load_best_model_at_end, when the best is
  // not the state it holds), else "".
  std::string report_best(const std::string& output_dir, int64_t step, RunSummary& summary) const;

 private:
  std::unique_ptr<Evaluator> evaluator_;  // null: no evaluation set
  std::string strategy_;                  // eval_strategy: "steps", "epoch" or "no"
  int64_t interval_ = 1;                  // evaluation_interval, for "steps"
  bool on_start_ = false;
  BestModel best_;
  bool stopped_early_ = false;
};

}  // namespace loom
