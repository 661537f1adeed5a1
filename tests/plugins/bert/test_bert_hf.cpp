// The bert plugin and transformers' BERT (the reference, bert_hf.py in the venv): a random
// BertForSequenceClassification imported into loom gives its logits (a padded sample
// included); a model trained in loom, exported, loads in transformers with loom's logits; a
// BertForMaskedLM folder starts a classifier whose pooler and head are fresh.
#include <ATen/ATen.h>

#include <filesystem>

#include "loom/engine.h"
#include "loom/model.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "hf_test.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::hf::load;
namespace fs = std::filesystem;

void python(const std::string& args) { test::hf::run_script("bert/bert_hf.py", args); }

std::string bert_job(const std::string& out, const std::string& model_lines, int steps = 0) {
  return R"([train]
model = "bert"
max_steps = )" + std::to_string(steps) + R"(
per_device_train_batch_size = 4
learning_rate = 1e-3
seed = 5
output_dir = ")" + out + R"("
progress_bar = false
log_level = "warn"

[model]
)" + model_lines + R"(

[data]
source = "random_tokens"
task = "classification"
num_labels = 3
num_samples = 64
seq_len = 16
vocab_low = 0
vocab_high = 120
)";
}

at::Tensor logits_of(Engine& engine, const std::map<std::string, at::Tensor>& inputs) {
  at::NoGradGuard no_grad;
  engine.model().eval();
  Batch batch;
  batch.input_ids = inputs.at("input_ids");
  batch.attention_mask = inputs.at("attention_mask");
  return engine.model().forward(batch).logits.clone();
}

double max_difference(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(BertHf, ImportedClassifierGivesTransformersLogitsWithPadding) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "']");
  auto trainer = Trainer::from_text(
      bert_job(dir.str(), "from_pretrained = \"" + hf.string() +
                              "\"\nhidden_dropout_prob = 0.0\nattention_probs_dropout_prob = 0.0"),
      dir.path());
  trainer->setup();
  const auto ref = load(hf / "ref.safetensors");
  EXPECT_LE(max_difference(logits_of(trainer->engine(), ref), ref.at("logits")), 1e-5);
}

// Also a LoRA run (every Linear but the classifier adapted, the classifier trained in full as
// PEFT's modules_to_save), exported with --merge (Note [Merged export]).
TEST(BertHf, TrainedInLoomExportedLoadsInTransformersWithLoomsLogits) {
  for (const bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA, merged" : "full");
    TempDir dir;
    auto trainer = Trainer::from_text(
        bert_job(dir.str(),
                 "vocab_size = 120\nhidden_size = 32\nnum_hidden_layers = 2\nnum_attention_heads = "
                 "2\nintermediate_size = 64\nmax_position_embeddings = 32\nnum_labels = 3\n"
                 "hidden_dropout_prob = 0.0\nattention_probs_dropout_prob = 0.0",
                 20) +
            (lora ? "\n[lora]\nr = 4\nlora_alpha = 8.0\ninit_lora_weights = false\n"
                    "target_modules = [\"qkv\", \"proj\", \"fc_in\", \"fc_out\", \"pooler\"]\n"
                    "modules_to_save = [\"classifier\"]\n"
                  : ""),
        dir.path());
    const auto summary = trainer->run();
    const fs::path out = dir / "exported";
    export_checkpoint(summary.last_checkpoint, out, {.merge = lora});
    std::map<std::string, at::Tensor> inputs = {
        {"input_ids", (at::arange(32, at::kLong) * 5 % 120).view({2, 16})},
        {"attention_mask", at::ones({2, 16}, at::kLong)}};
    inputs["attention_mask"][1].slice(0, 9).zero_();
    safetensors::save(dir / "in.safetensors", {inputs.begin(), inputs.end()});
    python("['logits', '" + out.string() + "', '" + (dir / "in.safetensors").string() + "', '" +
           (dir / "hf.safetensors").string() + "']");
    EXPECT_LE(max_difference(logits_of(trainer->engine(), inputs),
                             load(dir / "hf.safetensors").at("logits")),
              1e-5);
  }
}

// Note [Evaluation]: a classifier's eval_loss, eval_accuracy and macro eval_f1 are those of
// transformers' predictions on the same evaluation samples (13 in batches of 4), with the
// metrics computed in Python class by class.
TEST(BertHf, EvalMetricsAreThoseOfTransformersPredictions) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "']");
  const std::string job =
      bert_job(dir.str(), "from_pretrained = \"" + hf.string() +
                              "\"\nhidden_dropout_prob = 0.0\nattention_probs_dropout_prob = 0.0") +
      "\n[eval_data]\ntask = \"classification\"\nnum_labels = 3\nnum_samples = 13\nseq_len = 16\n"
      "vocab_low = 0\nvocab_high = 120\n";
  auto trainer = Trainer::from_text(job, dir.path(), {"train.per_device_eval_batch_size=4"});
  std::vector<at::Tensor> ids, labels;
  trainer->engine().on(Event::before_forward, [&](Engine& e) {
    if (!e.state().evaluating) return;
    ids.push_back(e.batch().input_ids.clone());
    labels.push_back(e.batch().labels.clone());
  });
  std::map<std::string, double> metrics;
  for (const auto& [name, value] : trainer->evaluate()) metrics[name] = value;
  ASSERT_EQ(ids.size(), 4u);
  safetensors::save(dir / "eval.safetensors",
                    {{"input_ids", at::cat(ids)}, {"labels", at::cat(labels)}});
  python("['metrics', '" + hf.string() + "', '" + (dir / "eval.safetensors").string() + "', '" +
         (dir / "ref_metrics.safetensors").string() + "']");
  const auto ref = load(dir / "ref_metrics.safetensors");
  ASSERT_GT(ref.at("margin").item<double>(), 1e-4) << "a near tie: the test is not sharp";
  EXPECT_EQ(metrics.at("eval_samples"), 13);
  EXPECT_NEAR(metrics.at("eval_loss"), ref.at("loss").item<double>(), 1e-5);
  EXPECT_DOUBLE_EQ(metrics.at("eval_accuracy"), ref.at("accuracy").item<double>());
  EXPECT_NEAR(metrics.at("eval_f1"), ref.at("f1").item<double>(), 1e-12);
}

TEST(BertHf, MaskedLmFolderStartsAClassifierWithFreshHeads) {
  TempDir dir;
  const fs::path hf = dir / "mlm";
  python("['make', '" + hf.string() + "', 'mlm']");
  auto trainer = Trainer::from_text(
      bert_job(dir.str(), "from_pretrained = \"" + hf.string() + "\"\nnum_labels = 3", 3),
      dir.path());
  trainer->setup();
  // The encoder comes from the folder (q, k, v stacked into qkv); the heads are fresh.
  const auto folder = load(hf / "model.safetensors");
  std::map<std::string, at::Tensor> params;
  for (const auto& p : trainer->engine().model().named_parameters()) params[p.key()] = p.value();
  EXPECT_TRUE(at::equal(params.at("encoder.1.ffn.fc_in.weight"),
                        folder.at("bert.encoder.layer.1.intermediate.dense.weight")));
  EXPECT_TRUE(at::equal(params.at("encoder.0.attn.qkv.weight").narrow(0, 48, 48),
                        folder.at("bert.encoder.layer.0.attention.self.key.weight")));
  EXPECT_EQ(params.at("classifier.weight").size(0), 3);
  EXPECT_EQ(folder.count("bert.pooler.dense.weight"), 0u);  // BertForMaskedLM has no pooler
  trainer->run();  // and it trains
  TempDir other;  // a fresh output_dir: `dir` now holds the run's checkpoints
  EXPECT_THROW_WITH(
      Trainer::from_text(bert_job(other.str(), "from_pretrained = \"" + hf.string() +
                                                   "\"\nhidden_size = 64"),
                         other.path())
          ->setup(),
      ConfigError, "hidden_size = 64 but the pretrained model's", "has 48");
}

}  // namespace
}  // namespace loom
