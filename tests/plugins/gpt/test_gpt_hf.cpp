// The gpt plugin and transformers' GPT2LMHeadModel (the reference, gpt_hf.py in the venv):
// a random transformers model imported into loom gives its logits; a model trained in loom,
// exported, loads in transformers with loom's logits; a fine-tune of an imported model follows
// transformers + torch AdamW on the same batches; bad folders are clear errors.
#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>

#include "loom/engine.h"
#include "loom/model.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
namespace fs = std::filesystem;

const std::string kScript = std::string(LOOM_SOURCE_DIR) + "/tests/plugins/gpt/gpt_hf.py";

void python(const std::string& args) {
  test::run_python("import runpy, sys\nsys.argv = ['gpt_hf.py'] + " + args +
                   "\nrunpy.run_path('" + kScript + "', run_name='__main__')\n");
}

std::map<std::string, at::Tensor> load(const fs::path& file) {
  auto contents = safetensors::load(file);
  return {contents.tensors.begin(), contents.tensors.end()};
}

// A job that starts from `folder`; random tokens below the models' vocabulary of 96.
std::string import_job(const std::string& out, const std::string& folder, int steps = 0,
                       const std::string& extra = "") {
  return R"([train]
model = "gpt"
max_steps = )" + std::to_string(steps) + R"(
per_device_train_batch_size = 2
learning_rate = 1e-3
max_grad_norm = 0.0
seed = 3
output_dir = ")" + out + R"("
progress_bar = false
log_level = "warn"
save_final = false

[optimizer]
name = "adamw"
weight_decay = 0.0

[model]
from_pretrained = ")" + folder + R"("
dropout = 0.0
)" + extra + R"(
[data]
source = "random_tokens"
task = "lm"
num_samples = 64
seq_len = 16
vocab_low = 0
vocab_high = 96
)";
}

at::Tensor logits_of(Engine& engine, const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  engine.model().eval();
  Batch batch;
  batch.input_ids = ids;
  return engine.model().forward(batch).logits.clone();
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double tol) {
  ASSERT_EQ(a.sizes(), b.sizes());
  const double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(diff, tol) << "max |difference| " << diff;
}

TEST(GptHf, ImportedModelsGiveTransformersLogits) {
  for (const std::string flags : {"", "'untied'", "'sharded'"}) {
    SCOPED_TRACE(flags.empty() ? "tied" : flags);
    TempDir dir;
    const fs::path hf = dir / "hf";
    python("['make', '" + hf.string() + "'" + (flags.empty() ? "" : ", " + flags) + "]");
    if (flags == "'sharded'") ASSERT_TRUE(fs::exists(hf / "model.safetensors.index.json"));
    auto trainer = Trainer::from_text(import_job(dir.str(), hf.string()), dir.path());
    trainer->setup();
    const auto ref = load(hf / "ref.safetensors");
    expect_close(logits_of(trainer->engine(), ref.at("input_ids")), ref.at("logits"), 1e-5);
  }
}

TEST(GptHf, TrainedInLoomExportedLoadsInTransformersWithLoomsLogits) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    TempDir dir;
    std::string job = test::tiny_gpt_job(dir.str());
    job.replace(job.find("max_steps = 4"), 13, "max_steps = 20");
    if (!tied)
      job.replace(job.find("dropout = 0.0"), 13, "dropout = 0.0\ntie_word_embeddings = false");
    auto trainer = Trainer::from_text(job, dir.path());
    const auto summary = trainer->run();
    const fs::path out = dir / "exported";
    export_checkpoint(summary.last_checkpoint, out);
    ASSERT_TRUE(fs::exists(out / "config.json") && fs::exists(out / "model.safetensors"));
    const at::Tensor ids = (at::arange(32, at::kLong) * 5 % 64).view({2, 16});
    safetensors::save(dir / "ids.safetensors", {{"input_ids", ids}});
    python("['logits', '" + out.string() + "', '" + (dir / "ids.safetensors").string() + "', '" +
           (dir / "hf_logits.safetensors").string() + "']");
    expect_close(logits_of(trainer->engine(), ids),
                 load(dir / "hf_logits.safetensors").at("logits"), 1e-5);
    // An export never overwrites.
    EXPECT_THROW_WITH(export_checkpoint(summary.last_checkpoint, out), CheckpointError,
                      "exists and is not an empty folder");
  }
}

TEST(GptHf, FineTuneOfAnImportedModelFollowsTransformersAndTorchAdamW) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "']");
  auto trainer = Trainer::from_text(import_job(dir.str(), hf.string(), 5), dir.path());
  // The batches loom trains on, for the reference to train on too.
  NamedTensors batches;
  int step = 0;
  trainer->engine().on(Event::before_forward, [&](Engine& engine) {
    batches.emplace_back("input_ids." + std::to_string(step), engine.batch().input_ids.clone());
    batches.emplace_back("labels." + std::to_string(step), engine.batch().labels.clone());
    ++step;
  });
  trainer->run();
  ASSERT_EQ(step, 5);
  safetensors::save(dir / "batches.safetensors", batches);
  python("['train', '" + hf.string() + "', '" + (dir / "batches.safetensors").string() + "', '" +
         (dir / "losses.safetensors").string() + "']");
  const at::Tensor expected = load(dir / "losses.safetensors").at("losses");
  std::ifstream metrics(dir / "metrics.jsonl");
  int i = 0;
  for (std::string line; std::getline(metrics, line); ++i) {
    const auto at = line.find("\"loss\":");
    ASSERT_NE(at, std::string::npos);
    const double loss = std::stod(line.substr(at + 7));
    EXPECT_NEAR(loss, expected[i].item<double>(), 1e-5) << "step " << i;
  }
  EXPECT_EQ(i, 5);
}

TEST(GptHf, BadPretrainedFoldersAreClearErrors) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "', 'sharded']");
  auto setup_of = [&](const std::string& folder, const std::string& extra = "") {
    Trainer::from_text(import_job(dir.str(), folder, 0, extra), dir.path())->setup();
  };
  EXPECT_THROW_WITH(setup_of((dir / "none").string()), CheckpointError, "does not exist");
  EXPECT_THROW_WITH(setup_of(hf.string(), "n_embd = 64"), ConfigError,
                    "n_embd = 64 but the pretrained model's", "has 48");
  // Another architecture: named, and what loom imports listed.
  const fs::path bert = dir / "bert";
  fs::copy(hf, bert);
  {
    std::ofstream(bert / "config.json") << R"({"model_type": "bert", "hidden_size": 48})";
  }
  EXPECT_THROW_WITH(setup_of(bert.string()), ConfigError, "model of type 'bert'",
                    "loom imports: gpt2");
  // A shard file the index names is gone.
  const fs::path broken = dir / "broken";
  fs::copy(hf, broken);
  for (const auto& entry : fs::directory_iterator(broken))
    if (entry.path().filename().string().rfind("model-00002", 0) == 0) fs::remove(entry.path());
  EXPECT_THROW_WITH(setup_of(broken.string()), CheckpointError, "names the shard file",
                    "which is missing");
  // A tensor of another shape.
  const fs::path wide = dir / "wide";
  fs::copy(hf, wide);
  {
    std::string config = test::read_text(wide / "config.json");
    config.replace(config.find("\"n_positions\": 32"), 17, "\"n_positions\": 64");
    std::ofstream(wide / "config.json") << config;
  }
  EXPECT_THROW_WITH(setup_of(wide.string()), CheckpointError, "tensor 'wpe.weight' has shape [32, 48]",
                    "the model's is [64, 48]");
}

}  // namespace
}  // namespace loom
