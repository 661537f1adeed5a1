// The bert plugin and transformers' BERT (the reference, bert_hf.py in the venv): a random
// BertForSequenceClassification imported into loom gives its logits (a padded sample
// included); a model trained in loom, exported, loads in transformers with loom's logits; a
// BertForMaskedLM folder starts a classifier whose pooler and head are fresh.
#include <ATen/ATen.h>

#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/data.h"
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
  std::deque<TempDir> dirs;  // the runs live until transformers has read both exports
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<std::string> each_logits;  // transformers' side of both in one Python process
  std::map<std::string, at::Tensor> inputs = {
      {"input_ids", (at::arange(32, at::kLong) * 5 % 120).view({2, 16})},
      {"attention_mask", at::ones({2, 16}, at::kLong)}};
  inputs["attention_mask"][1].slice(0, 9).zero_();
  for (const bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA, merged" : "full");
    const TempDir& dir = dirs.emplace_back();
    auto& trainer = trainers.emplace_back(Trainer::from_text(
        bert_job(dir.str(),
                 "vocab_size = 120\nhidden_size = 32\nnum_hidden_layers = 2\nnum_attention_heads = "
                 "2\nintermediate_size = 64\nmax_position_embeddings = 32\nnum_labels = 3\n"
                 "hidden_dropout_prob = 0.0\nattention_probs_dropout_prob = 0.0",
                 20) +
            (lora ? "\n[lora]\nr = 4\nlora_alpha = 8.0\ninit_lora_weights = false\n"
                    "target_modules = [\"qkv\", \"proj\", \"fc_in\", \"fc_out\", \"pooler\"]\n"
                    "modules_to_save = [\"classifier\"]\n"
                  : ""),
        dir.path()));
    const auto summary = trainer->run();
    const fs::path out = dir / "exported";
    export_checkpoint(summary.last_checkpoint, out, {.merge = lora});
    safetensors::save(dir / "in.safetensors", {inputs.begin(), inputs.end()});
    each_logits.push_back("['logits', '" + out.string() + "', '" +
                          (dir / "in.safetensors").string() + "', '" +
                          (dir / "hf.safetensors").string() + "']");
  }
  test::hf::run_script_each("bert/bert_hf.py", each_logits);
  for (size_t i = 0; i < trainers.size(); ++i) {
    SCOPED_TRACE(i == 0 ? "full" : "LoRA, merged");
    EXPECT_LE(max_difference(logits_of(trainers[i]->engine(), inputs),
                             load(dirs[i] / "hf.safetensors").at("logits")),
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

// A user's classifier (Note [Evaluation], Note [Dataset tasks]): a transformers BERT folder
// with its WordPiece tokenizer and its own label map (positive 0, negative 1: not the sorted
// order) fine-tuned on a JSONL of string labels. eval_accuracy rises from chance to near 1;
// the loss, accuracy and macro F1 of the first and the last evaluation are those of
// transformers' AutoTokenizer + AutoModelForSequenceClassification on the same JSONL, with
// the folder and with the export, whose config.json keeps the folder's id2label and which
// carries the tokenizer.
TEST(BertHf, ClassifierOnLabeledJsonlLearnsAndItsExportAgrees) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  test::hf::run_script_each("bert/bert_hf.py",
                            {"['make', '" + hf.string() + "', 'tokenizer']",
                             "['data', '" + (dir / "train.jsonl").string() + "', '400', '1']",
                             "['data', '" + (dir / "eval.jsonl").string() + "', '60', '2']"});
  std::string job = bert_job(dir.str(), "from_pretrained = \"" + hf.string() +
                                            "\"\nhidden_dropout_prob = 0.0\n"
                                            "attention_probs_dropout_prob = 0.0", 60);
  job = job.substr(0, job.find("[data]")) +
        "[data]\nsource = \"jsonl\"\npath = \"train.jsonl\"\nmax_seq_length = 16\n"
        "\n[eval_data]\nsource = \"jsonl\"\npath = \"eval.jsonl\"\nmax_seq_length = 16\n";
  auto trainer = Trainer::from_text(
      job, dir.path(),
      {"train.eval_strategy=\"steps\"", "train.eval_steps=30", "train.eval_on_start=true",
       "train.per_device_train_batch_size=8", "train.per_device_eval_batch_size=16",
       "train.learning_rate=3e-3", "train.save_final=true"});
  const auto summary = trainer->run();
  std::vector<nlohmann::json> evals;
  std::ifstream metrics(dir / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);)
    if (line.find("\"eval_accuracy\"") != std::string::npos) evals.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(evals.size(), 3u);  // steps 0, 30, 60
  EXPECT_LT(evals.front()["eval_accuracy"].get<double>(), 0.75);  // chance: 0.5
  EXPECT_GE(evals.back()["eval_accuracy"].get<double>(), 0.95) << evals.back().dump();

  const fs::path exported = dir / "exported";
  export_checkpoint(summary.last_checkpoint, exported);
  const auto config = nlohmann::json::parse(test::read_text(exported / "config.json"));
  EXPECT_EQ(config["id2label"], (nlohmann::json{{"0", "positive"}, {"1", "negative"}}));
  EXPECT_EQ(config["label2id"], (nlohmann::json{{"positive", 0}, {"negative", 1}}));
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(exported / file)) << file << " was not exported";
  const std::vector<std::pair<fs::path, nlohmann::json>> checked = {{hf, evals.front()},
                                                                     {exported, evals.back()}};
  std::vector<std::string> classify;  // transformers' side of both in one Python process
  for (const auto& [folder, eval] : checked)
    classify.push_back("['classify', '" + folder.string() + "', '" + (dir / "eval.jsonl").string() +
                       "', '" + (dir / (folder.filename().string() + ".ref.safetensors")).string() +
                       "']");
  test::hf::run_script_each("bert/bert_hf.py", classify);
  for (const auto& [folder, eval] : checked) {
    SCOPED_TRACE(folder.filename().string());
    const auto ref = load(dir / (folder.filename().string() + ".ref.safetensors"));
    ASSERT_GT(ref.at("margin").item<double>(), 1e-4) << "a near tie: the test is not sharp";
    EXPECT_NEAR(eval["eval_loss"].get<double>(), ref.at("loss").item<double>(), 1e-5);
    EXPECT_DOUBLE_EQ(eval["eval_accuracy"].get<double>(), ref.at("accuracy").item<double>());
    EXPECT_NEAR(eval["eval_f1"].get<double>(), ref.at("f1").item<double>(), 1e-12);
  }

  // The example a user copies runs on this folder as written (a tiny model: short samples).
  TempDir example;
  const RunSummary ran = test::hf::run_example(
      "datasets/classify.toml", hf, example.path(), 4,
      {"data.max_seq_length=16", "train.per_device_train_batch_size=4", "train.eval_steps=2",
       "train.save_steps=2"});
  EXPECT_EQ(ran.steps, 4);
  EXPECT_FALSE(ran.best_checkpoint.empty());
}

// String labels follow the model folder's label map (positive 0, negative 1) unless the job
// names its own; a name outside the map, or an [eval_data] whose map differs from [data]'s,
// is refused before anything runs.
TEST(BertHf, LabelMapsComeFromTheFolderAndMustAgree) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "', 'tokenizer']");
  std::ofstream(dir / "train.jsonl") << "{\"text\": \"bad day\", \"label\": \"negative\"}\n";
  std::ofstream(dir / "eval.jsonl") << "{\"text\": \"good day\", \"label\": \"positive\"}\n";
  std::ofstream(dir / "other.jsonl") << "{\"text\": \"a day\", \"label\": \"neutral\"}\n";
  fs::path out = dir / "accepted";
  auto job_of = [&](const std::string& data_extra, const std::string& eval_extra,
                    const std::string& eval_file = "eval.jsonl") {
    std::string job = bert_job(out.string(), "from_pretrained = \"" + hf.string() + "\"");
    return job.substr(0, job.find("[data]")) + "[data]\nsource = \"jsonl\"\npath = \"train.jsonl\"\n" +
           data_extra + "\n[eval_data]\nsource = \"jsonl\"\npath = \"" + eval_file + "\"\n" + eval_extra;
  };
  const std::vector<std::string> one = {"train.per_device_train_batch_size=1"};
  auto trainer = Trainer::from_text(job_of("", ""), dir.path(), one);
  trainer->setup();
  // The one sample's label: 1 by the folder's map (sorted names would make it 0).
  EXPECT_EQ(trainer->engine().data().next().labels.view({-1})[0].item<int64_t>(), 1);
  out = dir / "refused";
  // Refused when the job is read (`loom check`), before anything is built.
  EXPECT_THROW_WITH(
      Trainer::from_text(job_of("label_names = [\"negative\", \"positive\"]\n", ""), dir.path(), one),
      ConfigError, "[eval_data]'s label map (positive, negative)",
      "differs from [data]'s (negative, positive)", "same label_names");
  EXPECT_THROW_WITH(Trainer::from_text(job_of("", "", "other.jsonl"), dir.path(), one),
                    DataError, "other.jsonl:1", "label 'neutral' is not in the label map of",
                    "config.json's id2label (positive, negative)");
  EXPECT_FALSE(fs::exists(out / "metrics.jsonl"));
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
