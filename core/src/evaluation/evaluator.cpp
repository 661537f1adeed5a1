// Note [Evaluation] (evaluator.h): the evaluation set's shares, the sums, the metrics.
#include "evaluation/evaluator.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "loom/comm.h"
#include "loom/error.h"

namespace loom {
namespace {

// A subset of a dataset's samples, by index, in the order given.
class IndexSubset final : public Dataset {
 public:
  IndexSubset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices, std::string what)
      : base_(std::move(base)), indices_(std::move(indices)), what_(std::move(what)) {}
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Sample get(int64_t index) const override {
    LOOM_INTERNAL_ASSERT(index >= 0 && index < size(), "sample ", index, " of ", size());
    return base_->get(indices_[static_cast<size_t>(index)]);
  }
  std::string describe() const override {
    return detail::cat(what_, " (", indices_.size(), " of the ", base_->size(), " samples of ",
                       base_->describe(), ")");
  }
  std::vector<std::string> label_names() const override { return base_->label_names(); }

 private:
  std::shared_ptr<const Dataset> base_;
  std::vector<int64_t> indices_;
  std::string what_;
};

}  // namespace

SplitDatasets split_for_validation(std::shared_ptr<const Dataset> dataset, double fraction,
                                   uint64_t seed) {
  const int64_t n = dataset->size();
  LOOM_CHECK_AS(DataError, n >= 2, "[data] validation_split needs at least 2 samples to hold "
                "some out, but ", dataset->describe(), " has ", n);
  const int64_t held = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil(fraction * static_cast<double>(n) - 1e-9)), 1, n - 1);
  // Its own stream, apart from the sampler's epoch orders (Sampler::order).
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed * 0x9E3779B97F4A7C15ull + 0xE7A1);
  const at::Tensor perm = at::randperm(n, generator, at::kLong);
  const int64_t* p = perm.data_ptr<int64_t>();
  std::vector<int64_t> eval(p, p + held), train(p + held, p + n);
  std::sort(eval.begin(), eval.end());
  std::sort(train.begin(), train.end());
  SplitDatasets out;
  out.train = std::make_shared<IndexSubset>(dataset, std::move(train), "the training share");
  out.eval = std::make_shared<IndexSubset>(std::move(dataset), std::move(eval),
                                           "the held-out share (validation_split)");
  return out;
}

Evaluator::Evaluator(std::shared_ptr<const Dataset> dataset, Options options)
    : dataset_(std::move(dataset)), options_(options) {
  LOOM_CHECK_AS(DataError, dataset_->size() > 0, "the evaluation set ", dataset_->describe(),
                " is empty; give [eval_data] a source with samples");
  const int64_t world = options_.world_size;
  const int64_t most_per_rank = (dataset_->size() + world - 1) / world;
  batches_ = (most_per_rank + options_.batch_size - 1) / options_.batch_size;
}

std::string Evaluator::describe() const {
  return detail::cat(dataset_->describe(), ", ", batches_, " batch(es) of ", options_.batch_size,
                     " per rank");
}

bool Evaluator::classifies() const { return dataset_->get(0).labels.dim() == 0; }

Batch Evaluator::batch(int64_t k) const {
  const int64_t n = dataset_->size(), rank = options_.rank, world = options_.world_size;
  const int64_t share = n > rank ? (n - rank + world - 1) / world : 0;
  const int64_t begin = k * options_.batch_size;
  const int64_t end = std::min(share, begin + options_.batch_size);
  auto fetch = [this](int64_t index) {
    try {
      Sample sample = dataset_->get(index);
      sample.index = index;
      return sample;
    } catch (const std::exception& error) {
      throw DataError(detail::cat("evaluation sample ", index, " of ", dataset_->describe(),
                                  " failed: ", error.what()));
    }
  };
  std::vector<Sample> samples;
  for (int64_t j = begin; j < end; ++j) samples.push_back(fetch(rank + j * world));
  Batch out;
  if (samples.empty()) {
    // This rank's share ran out: one sample that counts nothing keeps the forwards in step.
    Sample filler = fetch(0);
    filler.labels = at::full_like(filler.labels, kIgnoreIndex);
    out = collate({filler});
    out.sample_indices = {-1};
  } else {
    out = collate(samples);
  }
  out.compute_host_stats();
  return out;
}

Evaluator::Metrics Evaluator::run(const Forward& forward, Comm* comm) const {
  const auto start = std::chrono::steady_clock::now();
  EvalTotals totals;
  for (int64_t k = 0; k < batches_; ++k) {
    const Batch host = batch(k);
    totals.add(forward(host), host);
  }
  if (comm && comm->world_size() > 1) {
    // One all-reduce of every sum; integers travel as doubles, exact below 2^53.
    const int64_t classes = static_cast<int64_t>(totals.actual.size());
    std::vector<double> flat = {totals.loss_sum, static_cast<double>(totals.targets),
                                static_cast<double>(totals.samples),
                                static_cast<double>(totals.correct)};
    for (const auto* counts : {&totals.true_positive, &totals.predicted, &totals.actual})
      for (int64_t v : *counts) flat.push_back(static_cast<double>(v));
    at::Tensor sums = at::tensor(flat, at::kDouble).to(comm->device());
    comm->all_reduce(sums, ReduceOp::sum)->wait();
    sums = sums.cpu();
    const double* s = sums.data_ptr<double>();
    totals.loss_sum = s[0];
    totals.targets = static_cast<int64_t>(s[1]);
    totals.samples = static_cast<int64_t>(s[2]);
    totals.correct = static_cast<int64_t>(s[3]);
    int64_t at = 4;
    for (auto* counts : {&totals.true_positive, &totals.predicted, &totals.actual})
      for (int64_t c = 0; c < classes; ++c) (*counts)[c] = static_cast<int64_t>(s[at++]);
  }
  LOOM_CHECK_AS(DataError, totals.targets > 0, "the evaluation set ", dataset_->describe(),
                " has no loss targets (every label is ", kIgnoreIndex, ")");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return totals.metrics(seconds, batches_);
}

void EvalTotals::add(const Output& output, const Batch& batch) {
  LOOM_CHECK(output.loss_sum.defined(), "the model returned no loss for an evaluation batch");
  loss_sum += output.loss_sum.detach().to(at::kDouble).cpu().item<double>();
  targets += batch.num_loss_targets();
  for (int64_t index : batch.sample_indices) samples += index >= 0 ? 1 : 0;
  if (batch.labels.dim() != 1) return;  // language modelling: the loss says it all
  classification = true;
  const int64_t rows = batch.labels.size(0);
  LOOM_CHECK(output.logits.defined() && output.logits.dim() == 2 && output.logits.size(0) == rows,
             "a classifier's evaluation needs its (batch, classes) logits, but the model gave ",
             output.logits.defined() ? detail::cat(output.logits.sizes()) : std::string("none"));
  const auto classes = static_cast<size_t>(output.logits.size(1));
  if (actual.empty()) true_positive = predicted = actual = std::vector<int64_t>(classes, 0);
  LOOM_INTERNAL_ASSERT(actual.size() == classes, "the logits' width changed between batches");
  const at::Tensor guesses = output.logits.detach().argmax(-1).to(at::kCPU, at::kLong).contiguous();
  const at::Tensor truth = batch.labels.to(at::kCPU, at::kLong).contiguous();
  const int64_t* guess = guesses.data_ptr<int64_t>();
  const int64_t* label = truth.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    if (label[i] == kIgnoreIndex) continue;
    LOOM_CHECK_AS(DataError, label[i] >= 0 && label[i] < static_cast<int64_t>(classes),
                  "evaluation label ", label[i], " is outside the model's ", classes, " classes");
    ++actual[static_cast<size_t>(label[i])];
    ++predicted[static_cast<size_t>(guess[i])];
    if (guess[i] == label[i]) {
      ++correct;
      ++true_positive[static_cast<size_t>(label[i])];
    }
  }
}

Evaluator::Metrics EvalTotals::metrics(double seconds, int64_t batches) const {
  Evaluator::Metrics m;
  const double loss = loss_sum / static_cast<double>(std::max<int64_t>(1, targets));
  m.emplace_back("eval_loss", loss);
  if (!classification) {
    m.emplace_back("eval_perplexity", std::exp(loss));
  } else {
    m.emplace_back("eval_accuracy",
                   static_cast<double>(correct) / static_cast<double>(std::max<int64_t>(1, targets)));
    // Macro F1 over the classes seen among labels or predictions; 2TP + FP + FN is the class's
    // predictions plus its labels.
    double f1_sum = 0;
    int64_t seen = 0;
    for (size_t c = 0; c < actual.size(); ++c) {
      const int64_t both = predicted[c] + actual[c];
      if (both == 0) continue;
      f1_sum += 2.0 * static_cast<double>(true_positive[c]) / static_cast<double>(both);
      ++seen;
    }
    m.emplace_back("eval_f1", seen > 0 ? f1_sum / static_cast<double>(seen) : 0.0);
  }
  const double s = std::max(seconds, 1e-9);
  m.emplace_back("eval_runtime", seconds);
  m.emplace_back("eval_samples_per_second", static_cast<double>(samples) / s);
  m.emplace_back("eval_steps_per_second", static_cast<double>(batches) / s);
  m.emplace_back("eval_samples", static_cast<double>(samples));
  return m;
}

}  // namespace loom
