// Note [Evaluation]: the evaluation set split over ranks covers every sample once; the sums give
// one process's numbers; classification metrics are scikit-learn's; validation_split holds out
// a seeded share; evaluation during training changes no weight; evaluations land in
// metrics.jsonl at the steps eval_strategy names.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "evaluation/best_model.h"
#include "evaluation/evaluator.h"
#include "loom/safetensors.h"
#include "loom/engine.h"
#include "loom/model.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

// Sample i: two tokens (i, i+1) and its label: i % 3 as a class, or next-token labels.
class Numbered final : public Dataset {
 public:
  Numbered(int64_t n, bool classes) : n_(n), classes_(classes) {}
  int64_t size() const override { return n_; }
  Sample get(int64_t index) const override {
    Sample s;
    s.input_ids = at::tensor({index, index + 1}, at::kLong);
    s.labels = classes_ ? at::tensor(index % 3, at::kLong) : at::tensor({index + 1, index + 2}, at::kLong);
    return s;
  }
  std::string describe() const override { return "numbered"; }

 private:
  int64_t n_;
  bool classes_;
};

// A stand-in model: loss_sum = the sum of the counted labels; logits that predict class
// (first id % 2): right for some samples, wrong for others.
Output fake_forward(const Batch& batch) {
  Output out;
  const at::Tensor labels = batch.labels.to(at::kDouble);
  out.loss_sum = (labels * batch.labels.ne(kIgnoreIndex)).sum();
  if (batch.labels.dim() == 1) {
    const at::Tensor predicted = batch.input_ids.select(1, 0).remainder(2);
    out.logits = at::one_hot(predicted, 3).to(at::kFloat);
  }
  return out;
}

TEST(Evaluation, RanksShareEverySampleOnceAndTheirSumsAreOneProcesses) {
  for (const bool classes : {false, true}) {
    SCOPED_TRACE(classes ? "classification" : "lm");
    const auto data = std::make_shared<Numbered>(10, classes);
    const Evaluator one(data, {3, 0, 1});
    EvalTotals whole;
    // One process: every sample, in order.
    std::vector<int64_t> seen_one;
    one.run(
        [&](const Batch& b) {
          Output out = fake_forward(b);
          whole.add(out, b);
          for (int64_t i : b.sample_indices) seen_one.push_back(i);
          return out;
        },
        nullptr);
    EXPECT_EQ(seen_one, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
    // Four ranks (10 samples: 3, 3, 2, 2): every rank runs one batch count; the ranks whose
    // share ran out run a filler that counts nothing.
    EvalTotals summed;
    std::multiset<int64_t> seen;
    for (int rank = 0; rank < 4; ++rank) {
      const Evaluator shard(data, {2, rank, 4});
      EXPECT_EQ(shard.batches(), 2);
      int64_t forwards = 0;
      shard.run(
          [&](const Batch& b) {
            ++forwards;
            Output out = fake_forward(b);
            summed.add(out, b);
            for (int64_t i : b.sample_indices)
              if (i >= 0) seen.insert(i);
            return out;
          },
          nullptr);
      EXPECT_EQ(forwards, 2);
    }
    EXPECT_EQ(seen, std::multiset<int64_t>(seen_one.begin(), seen_one.end()));
    EXPECT_EQ(summed.samples, 10);
    EXPECT_EQ(summed.targets, whole.targets);
    EXPECT_EQ(summed.loss_sum, whole.loss_sum);
    EXPECT_EQ(summed.correct, whole.correct);
    EXPECT_EQ(summed.true_positive, whole.true_positive);
    EXPECT_EQ(summed.predicted, whole.predicted);
    EXPECT_EQ(summed.actual, whole.actual);
  }
}

// Accuracy and macro F1 as scikit-learn defines them (f1_score(average="macro"): the classes
// among the labels or the predictions, each F1 = 2PR / (P + R)), computed here the long way.
TEST(Evaluation, ClassificationMetricsAreScikitLearnsMacroF1AndAccuracy) {
  const std::vector<int64_t> labels = {0, 0, 1, 1, 2, kIgnoreIndex, 2, 2, 1};
  const std::vector<int64_t> guesses = {0, 1, 1, 1, 0, 2, 2, 4, 1};  // class 3 never occurs
  Batch batch;
  batch.input_ids = at::zeros({9, 2}, at::kLong);
  batch.labels = at::tensor(labels, at::kLong);
  batch.sample_indices = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  Output out;
  out.loss_sum = at::tensor(4.0, at::kDouble);
  out.logits = at::one_hot(at::tensor(guesses, at::kLong), 5).to(at::kFloat);
  EvalTotals totals;
  totals.add(out, batch);
  std::map<std::string, double> m;
  for (const auto& [k, v] : totals.metrics(1.0, 1)) m[k] = v;
  // Long way: per class precision and recall over the counted rows.
  double f1_sum = 0;
  int classes = 0, right = 0, counted = 0;
  for (int64_t c = 0; c < 5; ++c) {
    int tp = 0, fp = 0, fn = 0;
    bool occurs = false;
    for (size_t i = 0; i < labels.size(); ++i) {
      if (labels[i] == kIgnoreIndex) continue;
      occurs |= labels[i] == c || guesses[i] == c;
      tp += labels[i] == c && guesses[i] == c;
      fp += labels[i] != c && guesses[i] == c;
      fn += labels[i] == c && guesses[i] != c;
    }
    if (!occurs) continue;
    ++classes;
    const double p = tp + fp ? static_cast<double>(tp) / (tp + fp) : 0.0;
    const double r = tp + fn ? static_cast<double>(tp) / (tp + fn) : 0.0;
    f1_sum += p + r > 0 ? 2 * p * r / (p + r) : 0.0;
  }
  for (size_t i = 0; i < labels.size(); ++i)
    if (labels[i] != kIgnoreIndex) {
      ++counted;
      right += labels[i] == guesses[i];
    }
  EXPECT_EQ(classes, 4);  // 0, 1, 2 and the predicted-only 4
  EXPECT_DOUBLE_EQ(m.at("eval_accuracy"), static_cast<double>(right) / counted);
  EXPECT_NEAR(m.at("eval_f1"), f1_sum / classes, 1e-15);
  EXPECT_DOUBLE_EQ(m.at("eval_loss"), 4.0 / 8);
  EXPECT_EQ(m.count("eval_perplexity"), 0u);
  EXPECT_EQ(m.at("eval_samples"), 9);
}

TEST(Evaluation, ValidationSplitHoldsOutASeededShareInOrder) {
  const auto data = std::make_shared<Numbered>(10, true);
  const auto a = split_for_validation(data, 0.25, 7), b = split_for_validation(data, 0.25, 7),
             c = split_for_validation(data, 0.25, 8);
  ASSERT_EQ(a.eval->size(), 3);  // ceil(2.5)
  ASSERT_EQ(a.train->size(), 7);
  auto ids = [](const Dataset& d) {
    std::vector<int64_t> out;
    for (int64_t i = 0; i < d.size(); ++i) out.push_back(d.get(i).input_ids[0].item<int64_t>());
    return out;
  };
  const auto held = ids(*a.eval), kept = ids(*a.train);
  EXPECT_TRUE(std::is_sorted(held.begin(), held.end()));
  EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
  std::set<int64_t> all(held.begin(), held.end());
  all.insert(kept.begin(), kept.end());
  EXPECT_EQ(all.size(), 10u);  // disjoint, and together every sample
  EXPECT_EQ(held, ids(*b.eval));
  EXPECT_NE(held, ids(*c.eval));
  EXPECT_THROW_WITH(split_for_validation(std::make_shared<Numbered>(1, true), 0.5, 7), DataError,
                    "validation_split needs at least 2 samples");
}

// The tiny GPT with dropout (so a stray random draw would show) and an evaluation set.
std::string eval_job(const std::string& out, const std::string& train_extra) {
  std::string job = tiny_gpt_job(out);
  job.replace(job.find("max_steps = 4"), 13, "max_steps = 6\n" + train_extra);
  job.replace(job.find("dropout = 0.0"), 13, "dropout = 0.1");
  return job + R"(
[eval_data]
num_samples = 10
seq_len = 16
vocab_low = 0
vocab_high = 64
task = "lm"
)";
}

std::vector<nlohmann::json> eval_lines(const std::filesystem::path& metrics) {
  std::vector<nlohmann::json> out;
  std::istringstream in(test::read_text(metrics));
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("eval_loss")) out.push_back(j);
  }
  return out;
}

TEST(Evaluation, EvaluatingDuringTrainingChangesNoWeightAndLandsInMetrics) {
  TempDir plain_dir, eval_dir;
  auto plain = Trainer::from_text(eval_job(plain_dir.str(), ""), plain_dir.path());
  plain->run();
  auto evaluated = Trainer::from_text(
      eval_job(eval_dir.str(), "eval_strategy = \"steps\"\neval_steps = 2\neval_on_start = true\n"
                               "per_device_eval_batch_size = 3"),
      eval_dir.path());
  std::vector<int64_t> evaluate_events;
  evaluated->engine().on(Event::evaluate, [&](Engine& e) {
    evaluate_events.push_back(e.state().step);
    EXPECT_FALSE(e.state().evaluating);
    EXPECT_EQ(e.state().eval_metrics.front().first, "eval_loss");
  });
  evaluated->run();
  const auto& p = plain->engine().params();
  const auto& q = evaluated->engine().params();
  ASSERT_EQ(p.size(), q.size());
  for (size_t i = 0; i < p.size(); ++i)
    EXPECT_TRUE(at::equal(p[i].tensor, q[i].tensor)) << p[i].name;
  EXPECT_EQ(evaluate_events, (std::vector<int64_t>{0, 2, 4, 6}));
  const auto lines = eval_lines(eval_dir / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i]["step"], 2 * static_cast<int>(i));
    EXPECT_NEAR(lines[i]["eval_perplexity"].get<double>(),
                std::exp(lines[i]["eval_loss"].get<double>()), 1e-9);
    EXPECT_EQ(lines[i]["eval_samples"], 10);
  }
  // The evaluation set is evaluated alone too, and the numbers are the last evaluation's: the
  // same weights, the same samples, no dropout.
  const auto again = evaluated->evaluate();
  EXPECT_EQ(again.front().second, lines.back()["eval_loss"].get<double>());
  // An evaluation set and eval_strategy "no": nothing evaluated during training.
  EXPECT_EQ(eval_lines(plain_dir / "metrics.jsonl").size(), 0u);
  TempDir none_dir;
  EXPECT_THROW_WITH(Trainer::from_text(tiny_gpt_job(none_dir.str()), none_dir.path())->evaluate(),
                    ConfigError, "this job has no evaluation set");
}

// eval_strategy = "epoch": after the step that took an epoch's last batch (64 samples of the
// held-out split's 48 + 16: 12 steps of 4 per epoch here).
TEST(Evaluation, EpochStrategyEvaluatesWhenAnEpochEnds) {
  TempDir dir;
  std::string job = tiny_gpt_job(dir.str());
  job.replace(job.find("max_steps = 4"), 13, "max_steps = 25\neval_strategy = \"epoch\"");
  job.replace(job.find("source = \"random_tokens\""), 24,
              "source = \"random_tokens\"\nvalidation_split = 0.25");
  Trainer::from_text(job, dir.path())->run();
  std::vector<int64_t> steps;
  for (const auto& line : eval_lines(dir / "metrics.jsonl")) {
    steps.push_back(line["step"]);
    EXPECT_EQ(line["eval_samples"], 16);
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{12, 24}));
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// Note [Best model]: early stopping as transformers' EarlyStoppingCallback (the threshold
// against the best before this evaluation), the best updated by any margin.
TEST(BestModel, PatienceCountsEvaluationsWithoutAnImprovementAboveTheThreshold) {
  BestModel best({"eval_loss", /*greater_is_better=*/false, /*patience=*/2, /*threshold=*/0.05,
                  /*load_at_end=*/false});
  const std::vector<std::pair<double, int64_t>> seen = {
      {3.0, 0}, {2.5, 0}, {2.6, 1}, {2.49, 2}};  // value, the patience count after it
  int64_t step = 0;
  for (const auto& [value, count] : seen) {
    best.observe(step += 10, {{"eval_runtime", 1.0}, {"eval_loss", value}});
    EXPECT_EQ(best.patience_count(), count) << value;
  }
  EXPECT_TRUE(best.should_stop());
  EXPECT_EQ(best.best_value(), 2.49);  // better by less than the threshold: still the best
  EXPECT_EQ(best.best_step(), 40);
  best.saving(30);
  EXPECT_EQ(best.best_checkpoint_step(), -1);  // step 30 holds no best evaluation
  best.saving(40);
  EXPECT_EQ(best.best_checkpoint_step(), 40);
  // The manifest's record brings it all back, exactly.
  std::map<std::string, std::string> values;
  best.save(values);
  BestModel resumed({"eval_loss", false, 2, 0.05, false});
  resumed.load(values);
  EXPECT_EQ(resumed.best_value(), 2.49);
  EXPECT_EQ(resumed.best_step(), 40);
  EXPECT_EQ(resumed.best_checkpoint_step(), 40);
  EXPECT_EQ(resumed.patience_count(), 2);
  // Another metric's record is not this one's.
  BestModel other({"eval_accuracy", true, 2, 0.0, false});
  other.load(values);
  EXPECT_FALSE(other.has_best());
  EXPECT_THROW_WITH(other.observe(50, {{"eval_loss", 1.0}}), ConfigError,
                    "metric_for_best_model 'eval_accuracy' is not among the evaluation's metrics");
}

// A job that evaluates a held-out share every 2 steps and saves with every evaluation, at a
// learning rate under which this tiny model's eval_loss rises (so the best checkpoint is an
// early one), with a threshold no change reaches: every evaluation after the first counts for
// patience.
std::string best_job(const std::string& out, int64_t max_steps, int64_t patience) {
  std::string job = tiny_gpt_job(out);
  job.replace(job.find("max_steps = 4"), 13,
              "max_steps = " + std::to_string(max_steps) +
                  "\neval_strategy = \"steps\"\neval_steps = 2\nsave_steps = 2\n"
                  "save_total_limit = 1\nload_best_model_at_end = true\n"
                  "metric_for_best_model = \"loss\"\n"
                  "early_stopping_threshold = 10.0\nearly_stopping_patience = " +
                  std::to_string(patience));
  job.replace(job.find("source = \"random_tokens\""), 24,
              "source = \"random_tokens\"\nvalidation_split = 0.25");
  return job;
}

std::map<int64_t, double> eval_losses(const std::filesystem::path& metrics) {
  std::map<int64_t, double> out;
  for (const auto& line : eval_lines(metrics)) out[line["step"]] = line["eval_loss"];
  return out;
}

int64_t smallest(const std::map<int64_t, double>& losses) {
  int64_t best = -1;
  for (const auto& [step, loss] : losses)
    if (best < 0 || loss < losses.at(best)) best = step;
  return best;
}

std::vector<std::string> checkpoint_names(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename().string().rfind("checkpoint-", 0) == 0)
      names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(BestModel, EarlyStoppingKeepsAndLoadsTheBestCheckpointAndResumesItsCount) {
  TempDir dir;
  // Patience 3: evaluations at 2 (the first: count 0), 4, 6 (count 2); the run ends at its
  // max_steps 6 without stopping early.
  auto first = Trainer::from_text(best_job(dir.str(), 6, 3), dir.path());
  const auto one = first->run();
  EXPECT_EQ(one.steps, 6);
  const auto losses = eval_losses(dir / "metrics.jsonl");
  ASSERT_EQ(losses.size(), 3u);
  const int64_t best_step = smallest(losses);
  ASSERT_LT(best_step, 6) << "the test needs a best checkpoint older than the last";
  const std::string best_name = "checkpoint-" + std::to_string(best_step);
  EXPECT_EQ(one.best_checkpoint, (dir / best_name).string());
  EXPECT_EQ(one.best_metric, losses.at(best_step));
  // save_total_limit = 1 keeps the best and the newest.
  EXPECT_EQ(checkpoint_names(dir.path()), (std::vector<std::string>{best_name, "checkpoint-6"}));
  // load_best_model_at_end: the run ends with the best checkpoint's weights.
  const auto saved = safetensors::load(dir / best_name / "model.safetensors").tensors;
  for (const auto& p : first->engine().params()) {
    const auto it = std::find_if(saved.begin(), saved.end(),
                                 [&](const auto& named) { return named.first == p.name; });
    ASSERT_NE(it, saved.end()) << p.name;
    EXPECT_TRUE(at::equal(p.tensor, it->second)) << p.name;
  }
  // Resumed (from the newest, step 6) with room for 14 more steps: the count (2) carried over,
  // so the next evaluation (step 8) reaches the patience of 3 and the run stops there; the best
  // is the best of all four evaluations, the first run's included.
  auto second = Trainer::from_text(best_job(dir.str(), 20, 3), dir.path(),
                                   {"train.resume=\"latest\""});
  const auto two = second->run();
  EXPECT_EQ(two.steps, 8);
  const auto all = eval_losses(dir / "metrics.jsonl");
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(two.best_checkpoint, (dir / ("checkpoint-" + std::to_string(smallest(all)))).string());
}

}  // namespace
}  // namespace loom
