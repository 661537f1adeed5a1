// The llama plugin and transformers' LlamaForCausalLM (the reference, llama_hf.py in the venv):
// random transformers models (grouped-query or not, tied or not, with biases, every rope type
// loom has, sharded) imported into loom give their logits; a model trained in loom, exported,
// loads in transformers with loom's logits; a fine-tune of an imported model follows
// transformers + torch AdamW; `loom generate`'s greedy tokens are transformers' generate();
// PEFT loads a loom LoRA adapter onto the exported model; bad folders are clear errors.
#include <ATen/ATen.h>

#include <deque>
#include <filesystem>
#include <fstream>

#include "loom/engine.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "hf_test.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::hf::expect_close;
using test::hf::load;
using test::hf::logits_of;

void python(const std::string& args) { test::hf::run_script("llama/llama_hf.py", args); }
namespace fs = std::filesystem;

// A job that starts from `folder`; random tokens below the models' vocabulary of 96.
std::string import_job(const std::string& out, const std::string& folder, int steps = 0,
                       const std::string& extra = "", const std::string& tables = "") {
  return R"([train]
model = "llama"
max_steps = )" + std::to_string(steps) + R"(
per_device_train_batch_size = 2
learning_rate = 1e-3
max_grad_norm = 0.0
seed = 3
output_dir = ")" + out + R"("
progress_bar = false
log_level = "warn"
save_final = )" + (steps > 0 ? "true" : "false") + R"(

[optimizer]
name = "adamw"
weight_decay = 0.0

[model]
from_pretrained = ")" + folder + R"("
)" + extra + R"(
[data]
source = "random_tokens"
task = "lm"
num_samples = 64
seq_len = 16
vocab_low = 0
vocab_high = 96
)" + tables;
}

// A llama trained from scratch (no pretrained folder).
std::string scratch_job(const std::string& out, const std::string& extra = "") {
  return R"([train]
model = "llama"
max_steps = 20
per_device_train_batch_size = 4
learning_rate = 1e-2
seed = 7
output_dir = ")" + out + R"("
progress_bar = false
log_level = "warn"

[model]
vocab_size = 64
hidden_size = 32
intermediate_size = 48
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 16
)" + extra + R"(
[data]
source = "random_tokens"
task = "lm"
num_samples = 64
seq_len = 16
vocab_low = 0
vocab_high = 64
)";
}

TEST(LlamaHf, ImportedModelsGiveTransformersLogits) {
  const std::vector<std::string> variants = {"",           "'tied'",        "'mha', 'bias'", "'sharded'",
                                            "'rope=linear'", "'rope=dynamic'", "'rope=llama3'"};
  TempDir dir;
  std::vector<std::string> makes;
  for (size_t i = 0; i < variants.size(); ++i)
    makes.push_back("['make', '" + (dir / ("hf" + std::to_string(i))).string() + "'" +
                    (variants[i].empty() ? "" : ", " + variants[i]) + "]");
  test::hf::run_script_each("llama/llama_hf.py", makes);
  for (size_t i = 0; i < variants.size(); ++i) {
    const std::string& flags = variants[i];
    SCOPED_TRACE(flags.empty() ? "grouped-query, untied" : flags);
    const fs::path hf = dir / ("hf" + std::to_string(i));
    if (flags == "'sharded'") ASSERT_TRUE(fs::exists(hf / "model.safetensors.index.json"));
    TempDir run;
    auto trainer = Trainer::from_text(import_job(run.str(), hf.string()), run.path());
    trainer->setup();
    const auto ref = load(hf / "ref.safetensors");
    expect_close(logits_of(trainer->engine(), ref.at("input_ids")), ref.at("logits"), 1e-5);
  }
}

TEST(LlamaHf, TrainedInLoomExportedLoadsInTransformersWithLoomsLogits) {
  std::deque<TempDir> dirs;  // the runs live until transformers has read the three exports
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<test::hf::ExportedModel> exports;
  for (const std::string extra : {"", "tie_word_embeddings = true\nrope_theta = 300.0\n",
                                  "rope_type = \"llama3\"\nrope_factor = 2.0\n"
                                  "rope_original_max_position_embeddings = 8\n"}) {
    SCOPED_TRACE(extra.empty() ? "untied" : extra);
    const TempDir& dir = dirs.emplace_back();
    auto& trainer = trainers.emplace_back(Trainer::from_text(scratch_job(dir.str(), extra), dir.path()));
    const auto summary = trainer->run();
    const fs::path out = dir / "exported";
    // --merge on a run without adapters: an error naming the flag, and no folder.
    EXPECT_THROW_WITH(export_checkpoint(summary.last_checkpoint, out, {.merge = true}),
                      ConfigError, "--merge", "no [lora] adapters");
    EXPECT_FALSE(fs::exists(out));
    export_checkpoint(summary.last_checkpoint, out);
    ASSERT_TRUE(fs::exists(out / "config.json") && fs::exists(out / "model.safetensors"));
    exports.push_back({&trainer->engine(), out, dir.path(), extra.empty() ? "untied" : extra});
  }
  test::hf::expect_exports_give_looms_logits("llama/llama_hf.py", exports);  // one Python process
}

TEST(LlamaHf, FineTuneOfAnImportedModelFollowsTransformersAndTorchAdamW) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "']");
  auto trainer = Trainer::from_text(import_job(dir.str(), hf.string(), 5), dir.path());
  test::hf::expect_fine_tune_follows_reference(*trainer, "llama/llama_hf.py", hf, dir.path());
}

// The checkpoint of a job that starts from `hf` and changes nothing (learning rate 0).
std::string unchanged_checkpoint(const TempDir& dir, const fs::path& hf, const std::string& model,
                                 const std::string& extra = "") {
  std::string job = import_job((dir / "run").string(), hf.string(), 1, extra);
  job.replace(job.find("model = \"llama\""), 15, "model = \"" + model + "\"");
  return Trainer::from_text(job, dir.path(), {"train.learning_rate=0.0"})->run().last_checkpoint;
}

TEST(LlamaHf, GenerateGreedyEqualsTransformersGenerate) {
  const std::vector<std::string> variants = {"", "'tied'", "'rope=dynamic'"};
  const std::vector<int64_t> prompt = {5, 17, 42, 3, 88};
  TempDir dir;
  safetensors::save(dir / "prompt.safetensors",
                    {{"input_ids", at::tensor(prompt, at::kLong).view({1, -1})}});
  // transformers' side of every variant in one Python process (run_script_each).
  std::vector<std::string> calls;
  for (size_t i = 0; i < variants.size(); ++i) {
    const fs::path hf = dir / ("hf" + std::to_string(i));
    calls.push_back("['make', '" + hf.string() + "'" +
                    (variants[i].empty() ? "" : ", " + variants[i]) + "]");
    calls.push_back("['generate', '" + hf.string() + "', '" +
                    (dir / "prompt.safetensors").string() + "', '12', '" +
                    (hf / "hf_ids.safetensors").string() + "']");
  }
  test::hf::run_script_each("llama/llama_hf.py", calls);
  for (size_t i = 0; i < variants.size(); ++i) {
    SCOPED_TRACE(variants[i].empty() ? "grouped-query, untied" : variants[i]);
    const fs::path hf = dir / ("hf" + std::to_string(i));
    TempDir run;
    const std::string checkpoint = unchanged_checkpoint(run, hf, "llama");
    GenerateOptions options;
    options.prompt_ids = prompt;
    options.max_new_tokens = 12;
    const Generation out = generate(checkpoint, options);
    test::hf::expect_same_ids(out.ids, load(hf / "hf_ids.safetensors").at("ids"));
  }
}

// Note [KV cache]: decoding in pieces (grouped-query attention, rotary positions offset by
// what the cache holds) gives the logits of one forward over the whole sequence.
TEST(LlamaHf, DecodingInPiecesEqualsOneForward) {
  TempDir dir;
  auto trainer = Trainer::from_text(scratch_job(dir.str()), dir.path(), {"train.max_steps=3"});
  trainer->run();
  const at::Tensor ids = (at::arange(24, at::kLong) * 7 % 64).view({2, 12});
  test::hf::expect_decoding_in_pieces_equals_one_forward(trainer->engine(), ids);
}

TEST(LlamaHf, PeftLoadsLoomsAdapterOntoTheExportedModel) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "']");
  // Random B (init_lora_weights = false) and a few steps, so the adapter changes the logits.
  const std::string lora = R"(
[lora]
r = 4
lora_alpha = 8.0
init_lora_weights = false
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
)";
  auto trainer =
      Trainer::from_text(import_job((dir / "run").string(), hf.string(), 3, "", lora), dir.path());
  const auto summary = trainer->run();
  ASSERT_TRUE(fs::exists(dir / "run" / "adapter_model.safetensors"));
  // The export of a LoRA run is its base model; the adapter goes on top.
  const fs::path base = dir / "base";
  export_checkpoint(summary.last_checkpoint, base);
  const at::Tensor ids = (at::arange(32, at::kLong) * 5 % 96).view({2, 16});
  safetensors::save(dir / "ids.safetensors", {{"input_ids", ids}});
  // Note [Merged export]: with --merge the folder is one plain model (no adapter tensors) whose
  // transformers logits are loom's with the adapter, as PEFT's merge_and_unload gives them.
  const fs::path merged = dir / "merged";
  export_checkpoint(summary.last_checkpoint, merged, {.merge = true});
  for (const auto& [name, tensor] : load(merged / "model.safetensors"))
    EXPECT_EQ(name.find("lora"), std::string::npos) << name;
  const std::string ids_file = (dir / "ids.safetensors").string();
  test::hf::run_script_each(  // PEFT's and transformers' side in one Python process
      "llama/llama_hf.py",
      {"['peft', '" + base.string() + "', '" + (dir / "run").string() + "', '" + ids_file +
           "', '" + (dir / "peft.safetensors").string() + "']",
       "['logits', '" + base.string() + "', '" + ids_file + "', '" +
           (dir / "base.safetensors").string() + "']",
       "['logits', '" + merged.string() + "', '" + ids_file + "', '" +
           (dir / "merged.safetensors").string() + "']"});
  const at::Tensor loom_logits = logits_of(trainer->engine(), ids);
  expect_close(loom_logits, load(dir / "peft.safetensors").at("logits"), 1e-5);
  // The base alone differs: the adapter mattered.
  const at::Tensor base_logits = load(dir / "base.safetensors").at("logits");
  EXPECT_GT((loom_logits - base_logits).abs().max().item<double>(), 1e-3);
  expect_close(loom_logits, load(dir / "merged.safetensors").at("logits"), 1e-5);
}

TEST(LlamaHf, BadPretrainedFoldersAndJobsAreClearErrors) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "', 'sharded']");
  auto setup_of = [&](const std::string& folder, const std::string& extra = "") {
    Trainer::from_text(import_job(dir.str(), folder, 0, extra), dir.path())->setup();
  };
  EXPECT_THROW_WITH(setup_of((dir / "none").string()), CheckpointError, "does not exist");
  EXPECT_THROW_WITH(setup_of(hf.string(), "hidden_size = 64"), ConfigError,
                    "hidden_size = 64 but the pretrained model's", "has 48");
  auto rewrite = [&](const std::string& name, const std::string& from, const std::string& to) {
    const fs::path copy = dir / name;
    fs::copy(hf, copy);
    std::string config = test::read_text(copy / "config.json");
    const auto at = config.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    config.replace(at, from.size(), to);
    std::ofstream(copy / "config.json") << config;
    return copy.string();
  };
  EXPECT_THROW_WITH(setup_of(rewrite("gpt2", "\"model_type\": \"llama\"", "\"model_type\": \"gpt2\"")),
                    ConfigError, "model of type 'gpt2'", "loom imports: gpt2", "llama");
  EXPECT_THROW_WITH(setup_of(rewrite("yarn", "\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"")),
                    ConfigError, "rope_type 'yarn' is not supported", "default, linear, dynamic and llama3");
  EXPECT_THROW_WITH(setup_of(rewrite("gelu", "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"")),
                    ConfigError, "hidden_act 'gelu' is not supported");
  EXPECT_THROW_WITH(
      setup_of(rewrite("wide", "\"intermediate_size\": 80", "\"intermediate_size\": 96")),
      CheckpointError, "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [80, 48]",
      "the model's is [96, 48]");
  // A shard file the index names is gone.
  const fs::path broken = dir / "broken";
  fs::copy(hf, broken);
  for (const auto& entry : fs::directory_iterator(broken))
    if (entry.path().filename().string().rfind("model-00002", 0) == 0) fs::remove(entry.path());
  EXPECT_THROW_WITH(setup_of(broken.string()), CheckpointError, "names the shard file",
                    "which is missing");
  // Jobs that build from scratch: heads that do not divide, a sequence beyond the positions.
  EXPECT_THROW_WITH(Trainer::from_text(scratch_job(dir.str()), dir.path(),
                                       {"model.num_key_value_heads=3"}),
                    ConfigError, "num_attention_heads 4 must be a multiple of num_key_value_heads 3");
  EXPECT_THROW_WITH(Trainer::from_text(scratch_job(dir.str()), dir.path(),
                                       {"model.max_position_embeddings=8"}),
                    ConfigError, "[data] seq_len 16 exceeds [model] max_position_embeddings 8");
}

}  // namespace
}  // namespace loom
