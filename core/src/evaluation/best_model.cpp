// Note [Best model] (best_model.h).
#include "evaluation/best_model.h"

#include <cmath>
#include <cstdio>

#include "loom/config.h"
#include "loom/error.h"

namespace loom {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Exact text of a double (the manifest keeps strings).
std::string exact(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

}  // namespace

BestModel::Options BestModel::options_from(const ConfigSection& train) {
  Options o;
  o.load_at_end = train.get_bool("load_best_model_at_end");
  o.patience = train.get_int("early_stopping_patience");
  o.threshold = train.get_float("early_stopping_threshold");
  o.metric = train.get_string("metric_for_best_model");
  if (o.metric.empty() && (o.load_at_end || o.patience > 0)) o.metric = "loss";
  if (!o.metric.empty() && o.metric.rfind("eval_", 0) != 0) o.metric = "eval_" + o.metric;
  if (const ConfigValue* greater = train.get("greater_is_better"))
    o.greater_is_better = std::get<bool>(greater->value);
  else
    o.greater_is_better = !(ends_with(o.metric, "loss") || ends_with(o.metric, "perplexity"));
  return o;
}

void BestModel::observe(int64_t step, const Metrics& metrics) {
  if (!tracking()) return;
  const double* value = nullptr;
  std::string computed;
  for (const auto& [name, v] : metrics) {
    if (name == options_.metric) value = &v;
    computed += (computed.empty() ? "" : ", ") + name;
  }
  LOOM_CHECK_AS(ConfigError, value, "[train] metric_for_best_model '", options_.metric,
                "' is not among the evaluation's metrics (", computed, ")");
  // Early stopping against the best before this evaluation, with the threshold.
  if (!has_best() ||
      (better(*value, best_value_) && std::fabs(*value - best_value_) > options_.threshold))
    patience_count_ = 0;
  else
    ++patience_count_;
  if (!has_best() || better(*value, best_value_)) {
    best_value_ = *value;
    best_step_ = step;
  }
}

void BestModel::saving(int64_t step) {
  if (tracking() && step == best_step_) best_checkpoint_step_ = step;
}

void BestModel::save(std::map<std::string, std::string>& values) const {
  if (!tracking() || !has_best()) return;
  values["best.metric"] = options_.metric;
  values["best.value"] = exact(best_value_);
  values["best.step"] = std::to_string(best_step_);
  values["best.checkpoint_step"] = std::to_string(best_checkpoint_step_);
  values["best.patience_count"] = std::to_string(patience_count_);
}

void BestModel::load(const std::map<std::string, std::string>& values) {
  const auto metric = values.find("best.metric");
  if (!tracking() || metric == values.end()) return;
  // Another metric's best says nothing about this one: start afresh.
  if (metric->second != options_.metric) return;
  try {
    best_value_ = std::stod(values.at("best.value"));
    best_step_ = std::stoll(values.at("best.step"));
    best_checkpoint_step_ = std::stoll(values.at("best.checkpoint_step"));
    patience_count_ = std::stoll(values.at("best.patience_count"));
  } catch (const std::exception& error) {
    throw CheckpointError(detail::cat("the checkpoint's best-model record is corrupt (",
                                      error.what(), "); resume from another checkpoint"));
  }
}

}  // namespace loom
