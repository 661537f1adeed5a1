// The gpt plugin and transformers' GPT2LMHeadModel (the reference, gpt_hf.py in the venv):
// a random transformers model imported into loom gives its logits; a model trained in loom,
// exported, loads in transformers with loom's logits; a fine-tune of an imported model follows
// transformers + torch AdamW on the same batches; bad folders are clear errors.
#include <ATen/ATen.h>

#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

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

void python(const std::string& args) { test::hf::run_script("gpt/gpt_hf.py", args); }
namespace fs = std::filesystem;

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

// Runs `job` in `dir`, evaluating before the first step and every `eval_steps` steps (batches
// of 2); the summary and each evaluation's eval_loss from metrics.jsonl, in order.
std::pair<RunSummary, std::vector<double>> run_evaluating(const std::string& job, const TempDir& dir,
                                                          int eval_steps) {
  auto trainer = Trainer::from_text(
      job, dir.path(),
      {"train.eval_strategy=\"steps\"", "train.eval_steps=" + std::to_string(eval_steps),
       "train.eval_on_start=true", "train.per_device_eval_batch_size=2", "train.save_final=true"});
  const RunSummary summary = trainer->run();
  std::vector<double> eval_loss;
  std::ifstream metrics(dir / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);)
    if (const auto at = line.find("\"eval_loss\":"); at != std::string::npos)
      eval_loss.push_back(std::stod(line.substr(at + 12)));
  return {summary, eval_loss};
}

TEST(GptHf, ImportedModelsGiveTransformersLogits) {
  const std::vector<std::string> variants = {"", "'untied'", "'sharded'"};
  TempDir dir;
  std::vector<std::string> makes;
  for (size_t i = 0; i < variants.size(); ++i)
    makes.push_back("['make', '" + (dir / ("hf" + std::to_string(i))).string() + "'" +
                    (variants[i].empty() ? "" : ", " + variants[i]) + "]");
  test::hf::run_script_each("gpt/gpt_hf.py", makes);
  for (size_t i = 0; i < variants.size(); ++i) {
    const std::string& flags = variants[i];
    SCOPED_TRACE(flags.empty() ? "tied" : flags);
    const fs::path hf = dir / ("hf" + std::to_string(i));
    if (flags == "'sharded'") ASSERT_TRUE(fs::exists(hf / "model.safetensors.index.json"));
    TempDir run;
    auto trainer = Trainer::from_text(import_job(run.str(), hf.string()), run.path());
    trainer->setup();
    const auto ref = load(hf / "ref.safetensors");
    expect_close(logits_of(trainer->engine(), ref.at("input_ids")), ref.at("logits"), 1e-5);
  }
}

// Note [Evaluation]: eval_loss of an imported model, before the first step and after a
// fine-tune (exported), is transformers' mean loss over the same evaluation windows.
TEST(GptHf, EvalLossIsTransformersLossBeforeAndAfterFineTuning) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "']");
  {
    std::ofstream tokens(dir / "eval.bin", std::ios::binary);
    for (uint16_t i = 0; i < 5 * 16 + 1; ++i) {  // 5 windows of 16 (+1)
      const uint16_t id = static_cast<uint16_t>((i * 13 + 5) % 96);
      tokens.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
  }
  const std::string job = import_job(
      dir.str(), hf.string(), 4,
      "[eval_data]\nsource = \"tokens\"\npath = \"eval.bin\"\nseq_len = 16\n");
  const auto [summary, eval_loss] = run_evaluating(job, dir, 4);
  ASSERT_EQ(eval_loss.size(), 2u);
  const fs::path exported = dir / "exported";
  export_checkpoint(summary.last_checkpoint, exported);
  python("['eval', '" + hf.string() + "', '" + (dir / "eval.bin").string() + "', '16', '" +
         (dir / "ref_eval.safetensors").string() + "', '" + exported.string() + "']");
  const auto ref = load(dir / "ref_eval.safetensors");
  ASSERT_EQ(ref.at("windows").item<int64_t>(), 5);
  EXPECT_NEAR(eval_loss[0], ref.at("loss.0").item<double>(), 1e-5) << "before the first step";
  EXPECT_NEAR(eval_loss[1], ref.at("loss.1").item<double>(), 1e-5) << "after 4 steps";
  // Four steps at lr 1e-3 moved the model: the second comparison is not the first again.
  EXPECT_GT(std::abs(eval_loss[0] - eval_loss[1]), 1e-3);
}

// A user's whole job (Note [Evaluation], Note [Dataset tasks], Note [Generation]): a
// transformers GPT-2 folder with its own tokenizer.json fine-tuned on a JSONL corpus (packed,
// EOS after each document) and evaluated every 3 steps on a JSONL of its own. eval_loss is
// transformers' loss over the same packed windows, made by transformers' tokenizer, before
// the first step and after the last; the export carries the tokenizer; `loom generate` with a
// text prompt (encoded and decoded by the folder's tokenizer) is transformers' greedy
// generate() on the export, ids and text.
TEST(GptHf, FineTuneOnJsonlWithTheFoldersTokenizerMatchesTransformers) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "', 'peaked', 'tokenizer']");
  const std::vector<std::string> words = {"the", "cat", "sat", "on", "mat", "why", "is", "42",
                                          "hello", "world", "réponse", "東京", "naïve", "don't",
                                          "😀", "print(x)", "model", "loss"};
  auto write_jsonl = [&](const fs::path& file, int documents, int salt) {
    std::ofstream out(file);
    for (int d = 0; d < documents; ++d) {
      std::string text;
      for (int w = 0; w < 4 + (d * 7 + salt) % 9; ++w)
        text += (w ? " " : "") + words[static_cast<size_t>((d * 31 + w * 17 + salt) % 18)];
      out << nlohmann::json{{"text", text}, {"id", d}}.dump() << "\n";
    }
  };
  write_jsonl(dir / "train.jsonl", 40, 1);
  write_jsonl(dir / "eval.jsonl", 8, 5);
  std::string job = import_job(dir.str(), hf.string(), 6);
  job = job.substr(0, job.find("[data]")) +
        "[data]\nsource = \"jsonl\"\npath = \"train.jsonl\"\npacking = true\nmax_seq_length = 16\n"
        "\n[eval_data]\nsource = \"jsonl\"\npath = \"eval.jsonl\"\npacking = true\n"
        "max_seq_length = 16\n";
  const auto [summary, eval_loss] = run_evaluating(job, dir, 3);
  ASSERT_EQ(eval_loss.size(), 3u);  // steps 0, 3, 6
  const fs::path exported = dir / "exported";
  export_checkpoint(summary.last_checkpoint, exported);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(exported / file)) << file << " was not exported";
  GenerateOptions options;
  options.prompt = "the cat 東京";
  options.max_new_tokens = 10;
  const Generation out = generate(summary.last_checkpoint, options);
  // transformers' evaluation and generation in one Python process.
  test::hf::run_script_each(
      "gpt/gpt_hf.py",
      {"['evaljsonl', '" + hf.string() + "', '" + (dir / "eval.jsonl").string() + "', '16', '" +
           (dir / "ref_eval.safetensors").string() + "', '" + exported.string() + "']",
       "['generate_text', '" + exported.string() + "', '" + options.prompt + "', '10', '" +
           (dir / "generated.json").string() + "']"});
  const auto ref = load(dir / "ref_eval.safetensors");
  ASSERT_GE(ref.at("windows").item<int64_t>(), 4);
  EXPECT_NEAR(eval_loss.front(), ref.at("loss.0").item<double>(), 1e-5) << "before the first step";
  EXPECT_NEAR(eval_loss.back(), ref.at("loss.1").item<double>(), 1e-5) << "after 6 steps";
  EXPECT_LT(eval_loss.back(), eval_loss.front() - 1e-2) << "the fine-tune did not learn";

  const auto expected = nlohmann::json::parse(test::read_text(dir / "generated.json"));
  EXPECT_EQ(out.ids, expected["ids"].get<std::vector<int64_t>>());
  EXPECT_EQ(out.text, expected["text"].get<std::string>());
  EXPECT_EQ(out.text.rfind(options.prompt, 0), 0u) << out.text;
  EXPECT_NE(out.tokenizer.find("byte-level BPE"), std::string::npos) << out.tokenizer;

  // The example a user copies runs on this folder as written (a tiny model: short windows).
  TempDir example;
  const RunSummary ran = test::hf::run_example("datasets/finetune_lm.toml", hf, example.path(), 3,
                                               {"data.max_seq_length=16", "train.eval_steps=3", "train.save_steps=3"});
  EXPECT_EQ(ran.steps, 3);
  EXPECT_FALSE(ran.best_checkpoint.empty());
}

TEST(GptHf, TrainedInLoomExportedLoadsInTransformersWithLoomsLogits) {
  std::deque<TempDir> dirs;  // the runs live until transformers has read both exports
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<test::hf::ExportedModel> exports;
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const TempDir& dir = dirs.emplace_back();
    std::string job = test::tiny_gpt_job(dir.str());
    job.replace(job.find("max_steps = 4"), 13, "max_steps = 20");
    if (!tied)
      job.replace(job.find("dropout = 0.0"), 13, "dropout = 0.0\ntie_word_embeddings = false");
    auto& trainer = trainers.emplace_back(Trainer::from_text(job, dir.path()));
    const auto summary = trainer->run();
    const fs::path out = dir / "exported";
    export_checkpoint(summary.last_checkpoint, out);
    ASSERT_TRUE(fs::exists(out / "config.json") && fs::exists(out / "model.safetensors"));
    exports.push_back({&trainer->engine(), out, dir.path(), tied ? "tied" : "untied"});
    // An export never overwrites.
    EXPECT_THROW_WITH(export_checkpoint(summary.last_checkpoint, out), CheckpointError,
                      "exists and is not an empty folder");
  }
  test::hf::expect_exports_give_looms_logits("gpt/gpt_hf.py", exports);  // one Python process
}

// Note [Merged export]: a LoRA run (every Linear adapted, the fused qkv included, rsLoRA's
// scaling) exported with --merge is a plain GPT-2 whose transformers logits are loom's with its
// adapters; without --merge the export is refused with a message naming --merge. A run that
// went on from the first one's adapter (adapter_path, whose saved lora_alpha 16 is not the
// job's default 8) merges with the saved scaling.
TEST(GptHf, LoraRunExportedMergedGivesLoomsLogits) {
  TempDir dir;
  std::string job = test::tiny_gpt_job(dir.str());
  job.replace(job.find("max_steps = 4"), 13, "max_steps = 6");
  job += "\n[lora]\nr = 4\nlora_alpha = 16.0\nuse_rslora = true\ninit_lora_weights = false\n"
         "target_modules = \"all-linear\"\n";
  auto trainer = Trainer::from_text(job, dir.path());
  const auto summary = trainer->run();
  EXPECT_THROW_WITH(export_checkpoint(summary.last_checkpoint, dir / "plain"), CheckpointError,
                    "adapter.lora_", "--merge");
  const fs::path out = dir / "merged";
  export_checkpoint(summary.last_checkpoint, out, {.merge = true});

  TempDir next;
  std::string more = test::tiny_gpt_job(next.str());
  more.replace(more.find("max_steps = 4"), 13, "max_steps = 3");
  more += "\n[lora]\nadapter_path = \"" + dir.str() + "\"\n";
  auto continued = Trainer::from_text(more, next.path());
  const auto continued_summary = continued->run();
  export_checkpoint(continued_summary.last_checkpoint, next / "merged", {.merge = true});
  // Both exports against transformers in one Python process.
  test::hf::expect_exports_give_looms_logits(
      "gpt/gpt_hf.py", {{&trainer->engine(), out, dir.path()},
                        {&continued->engine(), next / "merged", next.path()}});
}

TEST(GptHf, FineTuneOfAnImportedModelFollowsTransformersAndTorchAdamW) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  python("['make', '" + hf.string() + "']");
  auto trainer = Trainer::from_text(import_job(dir.str(), hf.string(), 5), dir.path());
  test::hf::expect_fine_tune_follows_reference(*trainer, "gpt/gpt_hf.py", hf, dir.path());
}

TEST(GptHf, GenerateGreedyEqualsTransformersGenerate) {
  TempDir dir;
  const fs::path hf = dir / "hf";
  const std::vector<int64_t> prompt = {5, 17, 42, 3, 88};
  safetensors::save(dir / "prompt.safetensors",
                    {{"input_ids", at::tensor(prompt, at::kLong).view({1, -1})}});
  test::hf::run_script_each("gpt/gpt_hf.py",
                            {"['make', '" + hf.string() + "', 'peaked']",
                             "['generate', '" + hf.string() + "', '" +
                                 (dir / "prompt.safetensors").string() + "', '20', '" +
                                 (dir / "hf_ids.safetensors").string() + "']"});
  // A checkpoint of the imported model, unchanged (learning rate 0).
  std::string job = import_job((dir / "run").string(), hf.string(), 1);
  job.replace(job.find("save_final = false"), 18, "save_final = true");
  const std::string checkpoint =
      Trainer::from_text(job, dir.path(), {"train.learning_rate=0.0"})->run().last_checkpoint;
  GenerateOptions options;
  options.prompt_ids = prompt;
  options.max_new_tokens = 20;
  const Generation out = generate(checkpoint, options);
  const at::Tensor expected = load(dir / "hf_ids.safetensors").at("ids");
  test::hf::expect_same_ids(out.ids, expected);
  // top-k 1 is greedy whatever the temperature; a seed repeats its draw; another seed may not.
  options.temperature = 5.0;
  options.top_k = 1;
  EXPECT_EQ(generate(checkpoint, options).ids, out.ids);
  options.top_k = 0;
  options.top_p = 1e-6;  // only the most likely token is left
  EXPECT_EQ(generate(checkpoint, options).ids, out.ids);
  options.top_p = 1.0;
  options.seed = 11;
  const auto sampled = generate(checkpoint, options).ids;
  EXPECT_EQ(generate(checkpoint, options).ids, sampled);
  EXPECT_NE(sampled, out.ids);  // temperature 5 over 96 tokens: 20 argmaxes by chance ~ never
  // The prompt and the new tokens must fit the 32 positions.
  options.max_new_tokens = 28;
  EXPECT_THROW_WITH(generate(checkpoint, options), ConfigError, "the prompt's 5 tokens",
                    "--max-new-tokens 28", "exceed the 32 positions");
}

// Note [KV cache]: decoding a sequence in pieces (one, then several, then one token) gives the
// logits one forward over the whole sequence gives.
TEST(GptHf, DecodingInPiecesEqualsOneForward) {
  TempDir dir;
  auto trainer = Trainer::from_text(test::tiny_gpt_job(dir.str()), dir.path());
  trainer->run();
  const at::Tensor ids = (at::arange(24, at::kLong) * 7 % 64).view({2, 12});
  test::hf::expect_decoding_in_pieces_equals_one_forward(trainer->engine(), ids);
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
