// Evaluation within a training run. See training_evaluation.h.
#include "evaluation/training_evaluation.h"

#include <ATen/core/grad_mode.h>

#include "loom/error.h"
#include "loom/log.h"
#include "loom/model.h"
#include "plugin_host.h"
#include "training_plan.h"

namespace loom {
namespace {

std::string join_names(const std::vector<std::string>& names) {
  if (names.empty()) return "integer ids";
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

TrainingEvaluation::TrainingEvaluation(const ResolvedJob& job, Engine& engine,
                                       std::shared_ptr<const Dataset>& dataset,
                                       uint64_t split_seed, int rank, int world_size) {
  const auto& train = job.section("train");
  strategy_ = train.get_string("eval_strategy");
  interval_ = evaluation_interval(train);
  on_start_ = train.get_bool("eval_on_start");
  const std::vector<std::string> label_names = dataset->label_names();
  std::shared_ptr<const Dataset> eval_set;
  if (const double split = job.section("data").get_float("validation_split"); split > 0) {
    SplitDatasets parts = split_for_validation(std::move(dataset), split, split_seed);
    dataset = std::move(parts.train);
    eval_set = std::move(parts.eval);
  } else if (job.eval_data.provider) {
    eval_set = job.eval_data.provider->plugin->create_dataset(
        job.eval_data.name, job.section("eval_data"), engine);
  }
  if (eval_set && eval_set->label_names() != label_names)
    throw ConfigError(detail::cat(
        "[eval_data]'s label map (", join_names(eval_set->label_names()),
        ") differs from [data]'s (", join_names(label_names), "): the ids would mean other "
        "classes; set the same label_names = [...] in both tables"));
  if (eval_set)
    evaluator_ = std::make_unique<Evaluator>(
        std::move(eval_set),
        Evaluator::Options{train.get_int("per_device_eval_batch_size"), rank, world_size});
  best_ = BestModel(BestModel::options_from(train));
  if (!best_.tracking() || !evaluator_) return;
  // The metrics a classifier's evaluation gives differ from a language model's.
  const std::string& metric = best_.options().metric;
  const bool classifies = evaluator_->classifies();
  const bool needs_classes = metric == "eval_accuracy" || metric == "eval_f1";
  LOOM_CHECK_AS(ConfigError, !(metric == "eval_perplexity" && classifies),
                train.where("metric_for_best_model"), ": [train] metric_for_best_model '",
                metric, "' is never computed: the evaluation set holds classification labels "
                "(eval_loss, eval_accuracy, eval_f1)");
  LOOM_CHECK_AS(ConfigError, !needs_classes || classifies, train.where("metric_for_best_model"),
                ": [train] metric_for_best_model '", metric, "' is never computed: the "
                "evaluation set holds next-token labels (eval_loss, eval_perplexity)");
}

std::string TrainingEvaluation::describe() const {
  std::string when = strategy_ == "steps"   ? detail::cat("every ", interval_, " steps")
                     : strategy_ == "epoch" ? std::string("at the end of every epoch")
                                            : std::string("never during training");
  if (on_start_) when += ", and before the first step";
  return evaluator_->describe() + "; evaluated " + when;
}

bool TrainingEvaluation::due(int64_t step, const DataSource& data, int64_t epoch_before) const {
  if (!evaluator_) return false;
  if (strategy_ == "steps") return step % interval_ == 0;
  return strategy_ == "epoch" && epoch_of_next_batch(data) > epoch_before;
}

Evaluator::Metrics TrainingEvaluation::run(Model& model, TrainState& state,
                                           const Evaluator::Forward& forward, Comm* comm) const {
  struct TrainAgain {
    Model& model;
    TrainState& state;
    ~TrainAgain() {
      state.evaluating = false;
      model.train();
    }
  } train_again{model, state};
  state.evaluating = true;
  model.eval();
  at::NoGradGuard no_grad;
  return evaluator_->run(forward, comm);
}

void TrainingEvaluation::observe(int64_t step, const Evaluator::Metrics& metrics) {
  best_.observe(step, metrics);
  if (!best_.should_stop() || stopped_early_) return;
  stopped_early_ = true;
  log::info("early stopping after step ", step, ": ", best_.options().metric,
            " has not improved by more than ", best_.options().threshold, " in ",
            best_.patience_count(), " evaluations (best ", best_.best_value(), " at step ",
            best_.best_step(), ")");
}

std::string TrainingEvaluation::report_best(const std::string& output_dir, int64_t step,
                                            RunSummary& summary) const {
  if (best_.best_checkpoint_step() < 0) return "";
  summary.best_checkpoint =
      output_dir + "/checkpoint-" + std::to_string(best_.best_checkpoint_step());
  summary.best_metric = best_.best_value();
  log::info("best checkpoint ", summary.best_checkpoint, " (", best_.options().metric, " ",
            best_.best_value(), " at step ", best_.best_step(), ")");
  // Note [Best model]: the run ends holding the best checkpoint's state, as if resumed from it.
  if (!best_.options().load_at_end || best_.best_checkpoint_step() == step) return "";
  log::info("load_best_model_at_end: loading ", summary.best_checkpoint);
  return summary.best_checkpoint;
}

}  // namespace loom
