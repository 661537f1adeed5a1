// The lora plugin: exact no-op at B = 0, merge/unmerge, only adapters train, model-state bytes
// follow the adapter size, PEFT-format save/load (checked against the peft package), and the
// messages for bad input.
#include <ATen/ATen.h>
#include <dlfcn.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/engine.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

// tiny_gpt_job: n_embd 32, 2 layers, MLP 128, vocab 64, tied embeddings (no lm_head).
std::string lora_job(const TempDir& dir, const std::string& lora_lines) {
  return tiny_gpt_job(dir.str()) + "\n[lora]\n" + lora_lines + "\n";
}

std::unique_ptr<Trainer> make(const std::string& job, const TempDir& dir,
                              std::vector<std::string> set = {}) {
  return Trainer::from_text(job, dir.path(), set);
}

// A fixed batch of token ids (B=2, T=16); the same for every model of a test.
Batch fixed_batch() {
  Batch batch;
  batch.input_ids = (at::arange(32, at::kLong) * 7 % 64).view({2, 16});
  return batch;
}

at::Tensor logits_of(Engine& engine) {
  at::NoGradGuard no_grad;
  return engine.model().forward(fixed_batch()).logits.clone();
}

std::map<std::string, at::Tensor> snapshot(Engine& engine) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : engine.model().named_parameters(true)) out[p.key()] = p.value().detach().clone();
  return out;
}

// The plugin's C entry points (lora.h), from the library the engine loaded.
using MergeFn = int64_t (*)(torch::nn::Module*);
MergeFn lora_function(const char* name) {
  void* library = dlopen(LOOM_LORA_PLUGIN_FILE, RTLD_NOW | RTLD_NOLOAD);
  EXPECT_NE(library, nullptr) << "loom_lora.so is not loaded: " << LOOM_LORA_PLUGIN_FILE;
  if (!library) return nullptr;
  auto* fn = reinterpret_cast<MergeFn>(dlsym(library, name));
  EXPECT_NE(fn, nullptr) << name;
  dlclose(library);  // drops the reference NOLOAD took; the engine's stays
  return fn;
}

int64_t count_params(Engine& engine, const std::string& part) {
  int64_t n = 0;
  for (const auto& p : engine.model().named_parameters(true))
    n += p.key().find(part) != std::string::npos ? 1 : 0;
  return n;
}

const char* kAllFour = R"(target_modules = ["qkv", "proj", "fc_in", "fc_out"])";

TEST(Lora, ZeroBOutputEqualsTheBaseModelExactly) {
  TempDir a, b;
  auto base = make(tiny_gpt_job(a.str()), a);
  auto lora = make(lora_job(b, std::string(kAllFour) + "\nlora_dropout = 0.1"), b);
  base->setup();
  lora->setup();
  ASSERT_EQ(count_params(lora->engine(), ".adapter.lora_B"), 8);
  // Same seed, and the adapters are made after the model: the base weights are identical.
  auto base_params = snapshot(base->engine());
  for (const auto& [name, value] : snapshot(lora->engine())) {
    if (name.find(".adapter.") != std::string::npos) continue;
    ASSERT_TRUE(at::equal(value, base_params.at(name))) << name;
  }
  // In training mode too: dropout on the adapter's input changes nothing while B = 0.
  EXPECT_TRUE(at::equal(logits_of(base->engine()), logits_of(lora->engine())));
  lora->engine().model().eval();
  base->engine().model().eval();
  EXPECT_TRUE(at::equal(logits_of(base->engine()), logits_of(lora->engine())));
}

TEST(Lora, MergedOutputEqualsUnmerged) {
  TempDir dir;
  // init_lora_weights = false: B random, so the merge moves every weight.
  auto trainer = make(lora_job(dir, std::string(kAllFour) + "\ninit_lora_weights = false\n"
                                                              "lora_alpha = 16"),
                      dir);
  trainer->setup();
  Engine& engine = trainer->engine();
  const at::Tensor unmerged = logits_of(engine);
  const auto before = snapshot(engine);
  auto merge = lora_function("loom_lora_merge");
  auto unmerge = lora_function("loom_lora_unmerge");
  ASSERT_TRUE(merge && unmerge);
  EXPECT_EQ(merge(&engine.model()), 8);
  EXPECT_EQ(merge(&engine.model()), 0) << "merging twice must not add the update twice";
  EXPECT_FALSE(at::equal(snapshot(engine).at("h.0.attn.qkv.weight"), before.at("h.0.attn.qkv.weight")));
  const at::Tensor merged = logits_of(engine);
  EXPECT_FALSE(at::equal(merged, unmerged));
  EXPECT_LE((merged - unmerged).abs().max().item<double>(), 1e-6);
  EXPECT_EQ(unmerge(&engine.model()), 8);
  EXPECT_LE((logits_of(engine) - unmerged).abs().max().item<double>(), 1e-6);
  for (const auto& [name, value] : snapshot(engine))
    EXPECT_LE((value - before.at(name)).abs().max().item<double>(), 1e-6) << name;

  // save_merged: the merged file loads into the plain model and gives the adapted model's output.
  TempDir run, plain_dir;
  auto adapted = make(lora_job(run, std::string(kAllFour) + "\nsave_merged = true"), run,
                      {"train.max_steps=3"});
  adapted->run();
  const at::Tensor expected = logits_of(adapted->engine());
  auto plain = make(tiny_gpt_job(plain_dir.str()), plain_dir);
  plain->setup();
  auto file = safetensors::load(run / "merged/model.safetensors").tensors;
  std::map<std::string, at::Tensor> by_name(file.begin(), file.end());
  std::set<std::string> plain_names;
  {
    at::NoGradGuard no_grad;
    for (const auto& p : plain->engine().model().named_parameters(true)) {
      plain_names.insert(p.key());
      ASSERT_TRUE(by_name.count(p.key())) << p.key();
      p.value().copy_(by_name.at(p.key()));
    }
  }
  EXPECT_EQ(plain_names.size(), by_name.size()) << "the merged file holds adapter tensors";
  EXPECT_LE((logits_of(plain->engine()) - expected).abs().max().item<double>(), 1e-6);
}

TEST(Lora, TrainingChangesOnlyAdaptersAndModulesToSave) {
  TempDir dir;
  auto trainer = make(lora_job(dir, R"(target_modules = ["qkv", "fc_out"]
modules_to_save = ["ln_f"])"),
                      dir, {"train.max_steps=3"});
  std::map<std::string, at::Tensor> initial;
  std::set<std::string> with_grad;
  trainer->engine().on(Event::params_ready, [&](Engine& e) { initial = snapshot(e); });
  trainer->engine().on(Event::before_update, [&](Engine& e) {
    for (const auto& p : e.model().named_parameters(true))
      if (p.value().grad().defined()) with_grad.insert(p.key());
  });
  trainer->run();
  std::set<std::string> expected_trainable;
  for (const char* layer : {"0", "1"})
    for (const char* module : {"attn.qkv", "ffn.fc_out"})
      for (const char* m : {"lora_A", "lora_B"})
        expected_trainable.insert(std::string("h.") + layer + "." + module + ".adapter." + m);
  expected_trainable.insert({"ln_f.weight", "ln_f.bias"});
  std::set<std::string> params;
  for (const auto& p : trainer->engine().params()) params.insert(p.name);
  EXPECT_EQ(params, expected_trainable);
  EXPECT_EQ(with_grad, expected_trainable) << "frozen weights must get no .grad at all";

  auto saved = safetensors::load(dir / "checkpoint-3/model.safetensors").tensors;
  ASSERT_EQ(saved.size(), initial.size());
  for (const auto& [name, value] : saved) {
    if (expected_trainable.count(name))
      EXPECT_FALSE(at::equal(value, initial.at(name))) << name << " did not train";
    else
      EXPECT_TRUE(at::equal(value, initial.at(name))) << name << " changed but is frozen";
  }
}

TEST(Lora, ModelStateBytesFollowTheAdapterSize) {
  TempDir a, b;
  auto full = make(tiny_gpt_job(a.str()), a);
  auto lora = make(lora_job(b, std::string(kAllFour) + "\nr = 4"), b);
  full->setup();
  testing::internal::CaptureStderr();
  lora->setup();
  (void)testing::internal::GetCapturedStderr();
  const auto f = full->engine().model_state();
  const auto l = lora->engine().model_state();
  // r·(in + out) per adapted Linear: qkv 32->96, proj 32->32, fc_in 32->128, fc_out 128->32.
  const int64_t adapter_params = 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32));
  EXPECT_EQ(l.trainable_count, adapter_params);
  EXPECT_EQ(l.param_count, f.param_count + adapter_params);
  EXPECT_EQ(l.grad_bytes, adapter_params * 4);
  // Optimizer state per trainable parameter is the same as in the full fine-tune (AdamW: m, v).
  ASSERT_GT(f.optimizer_bytes, 0);
  EXPECT_EQ(l.optimizer_bytes * f.trainable_count, f.optimizer_bytes * l.trainable_count);
  EXPECT_EQ(l.optimizer_bytes, 2 * 4 * adapter_params);
}

TEST(Lora, LogReportsTrainableParameters) {
  TempDir dir;
  auto trainer = make(lora_job(dir, std::string(kAllFour) + "\nr = 4"), dir,
                      {"train.log_level=info"});
  testing::internal::CaptureStderr();
  testing::internal::CaptureStdout();
  trainer->setup();
  const std::string out =
      testing::internal::GetCapturedStdout() + testing::internal::GetCapturedStderr();
  const auto state = trainer->engine().model_state();
  char share[32];
  std::snprintf(share, sizeof share, "%.4f", 100.0 * state.trainable_count / state.param_count);
  EXPECT_NE(out.find("lora: trainable params: 4,096 || all params: "), std::string::npos) << out;
  EXPECT_NE(out.find(std::string("trainable%: ") + share), std::string::npos) << out;
}

std::set<std::string> keys_of(const std::filesystem::path& file) {
  std::set<std::string> keys;
  for (const auto& [name, value] : safetensors::load(file).tensors) keys.insert(name);
  return keys;
}

TEST(Lora, AdapterSaveLoadRoundTrip) {
  TempDir first, second;
  const std::string lines = R"(target_modules = ["qkv", "fc_in"]
modules_to_save = ["ln_f"]
bias = "lora_only"
lora_alpha = 16
use_rslora = true)";
  auto trained = make(lora_job(first, lines), first, {"train.max_steps=3"});
  trained->run();
  const auto config = nlohmann::json::parse(test::read_text(first / "adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 8);
  EXPECT_EQ(config["lora_alpha"], 16.0);
  EXPECT_EQ(config["use_rslora"], true);
  EXPECT_EQ(config["bias"], "lora_only");
  EXPECT_EQ(config["target_modules"], nlohmann::json({"qkv", "fc_in"}));
  EXPECT_EQ(config["modules_to_save"], nlohmann::json({"ln_f"}));
  EXPECT_EQ(config["fan_in_fan_out"], false);
  EXPECT_EQ(config["init_lora_weights"], true);
  std::set<std::string> expected = {"base_model.model.ln_f.weight", "base_model.model.ln_f.bias"};
  for (const char* layer : {"0", "1"})
    for (const char* module : {"attn.qkv", "ffn.fc_in"}) {
      const std::string path = std::string("base_model.model.h.") + layer + "." + module;
      expected.insert({path + ".lora_A.weight", path + ".lora_B.weight", path + ".base_layer.bias"});
    }
  EXPECT_EQ(keys_of(first / "adapter_model.safetensors"), expected);

  // A new run starts from the adapter. Its base weights come from the same seed and were frozen
  // in the first run, so every tensor, and the output, must be bitwise the trained model's.
  const std::string load = "adapter_path = \"" + first.str() + "\"\nsave_adapter = false";
  auto loaded = make(lora_job(second, load), second, {"train.max_steps=0"});
  loaded->setup();
  auto want = snapshot(trained->engine());
  auto got = snapshot(loaded->engine());
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, value] : got) EXPECT_TRUE(at::equal(value, want.at(name))) << name;
  EXPECT_TRUE(at::equal(logits_of(loaded->engine()), logits_of(trained->engine())));
  EXPECT_EQ(loaded->engine().params().size(), trained->engine().params().size());
}

TEST(Lora, PeftReadsTheAdapter) {
  TempDir dir;
  auto trainer = make(lora_job(dir, R"(target_modules = ["qkv", "fc_in"]
modules_to_save = ["ln_f"]
bias = "lora_only"
r = 4
lora_alpha = 16
use_rslora = true
save_merged = true)"),
                      dir, {"train.max_steps=3"});
  trainer->run();
  Engine& engine = trainer->engine();
  engine.model().eval();
  NamedTensors io;
  at::manual_seed(3);
  at::NoGradGuard no_grad;
  for (const auto& item : engine.model().named_modules("", false)) {
    auto linear = std::dynamic_pointer_cast<nn::Linear>(item.value());
    if (!linear || !linear->adapter()) continue;
    at::Tensor x = at::randn({3, linear->in_features});
    io.emplace_back("x." + item.key(), x);
    io.emplace_back("y." + item.key(), linear->forward(x));
    io.emplace_back("w." + item.key() + ".weight", linear->weight.detach());
    io.emplace_back("w." + item.key() + ".bias", linear->bias.detach());
  }
  ASSERT_EQ(io.size(), 16u);
  for (const auto& p : engine.model().named_parameters(true))
    if (p.key().rfind("ln_f.", 0) == 0) io.emplace_back("w." + p.key(), p.value().detach());
  safetensors::save(dir / "io.safetensors", io);
  const std::string command = std::string(LOOM_TEST_PYTHON) + " " LOOM_SOURCE_DIR
                              "/tests/plugins/lora/peft_check.py " + dir.str() + " " +
                              (dir / "io.safetensors").string() + " " +
                              (dir / "merged/model.safetensors").string();
  const std::string output = test::run_command(command);
  EXPECT_NE(output.find("ok: 4 adapted Linears"), std::string::npos) << output;
  std::printf("%s", output.c_str());  // PEFT's differences, for the log
}

TEST(Lora, TargetPatterns) {
  TempDir a, b;
  // A string is a regex over the whole name (PEFT's re.fullmatch).
  auto regex = make(lora_job(a, R"(target_modules = "h\\.0\\.attn\\..*")"), a);
  regex->setup();
  EXPECT_EQ(count_params(regex->engine(), ".adapter.lora_A"), 2);
  EXPECT_EQ(count_params(regex->engine(), "h.0.attn.qkv.adapter.lora_A"), 1);
  EXPECT_EQ(count_params(regex->engine(), "h.0.attn.proj.adapter.lora_A"), 1);
  // "all-linear": every Linear but the output layer.
  auto all = make(lora_job(b, R"(target_modules = "all-linear")"), b,
                  {"model.tie_word_embeddings=false"});
  all->setup();
  EXPECT_EQ(count_params(all->engine(), ".adapter.lora_A"), 8);
  EXPECT_EQ(count_params(all->engine(), "lm_head.adapter"), 0);
}

TEST(Lora, TargetsThatMatchNothingListTheLinears) {
  TempDir dir;
  auto trainer = make(lora_job(dir, R"(target_modules = ["q_proj", "v_proj"])"), dir);
  EXPECT_THROW_WITH(trainer->setup(), ConfigError, "job.toml:", "[lora] target_modules",
                    "[\"q_proj\",\"v_proj\"]", "match no loom::nn::Linear of model 'gpt'",
                    "h.0.attn.qkv, h.0.attn.proj, h.0.ffn.fc_in, h.0.ffn.fc_out");
  TempDir other;
  auto save = make(lora_job(other, std::string(kAllFour) + "\nmodules_to_save = [\"score\"]"), other);
  EXPECT_THROW_WITH(save->setup(), ConfigError, "[lora] modules_to_save entry 'score'",
                    "matches no module", "ln_f");
  TempDir missing;
  EXPECT_THROW_WITH(make(lora_job(missing, "r = 4"), missing), ConfigError,
                    "[lora] needs target_modules");
}

TEST(Lora, RankMustBePositive) {
  for (const char* r : {"0", "-2"}) {
    TempDir dir;
    auto build = [&] { return make(lora_job(dir, std::string(kAllFour) + "\nr = " + r), dir); };
    EXPECT_THROW_WITH(build(), ConfigError, "job.toml:", "[lora] r must be a positive rank",
                      std::string("got ") + r);
  }
  TempDir dir;
  auto build = [&] {
    return make(lora_job(dir, std::string(kAllFour) + "\ninit_lora_weights = \"pissa\""), dir);
  };
  EXPECT_THROW_WITH(build(), ConfigError, "[lora] init_lora_weights \"pissa\"",
                    "use true, false or \"gaussian\"");
}

TEST(Lora, AdapterForAnotherModelShapeNamesTheTensor) {
  TempDir source;
  make(lora_job(source, kAllFour), source, {"train.max_steps=1"})->run();
  const std::string load = "adapter_path = \"" + source.str() + "\"";
  {
    TempDir dir;  // wider model: every tensor's shape differs
    auto trainer = make(lora_job(dir, load), dir, {"model.n_embd=64"});
    EXPECT_THROW_WITH(trainer->setup(), CheckpointError, "adapter_model.safetensors",
                      "tensor 'base_model.model.h.0.attn.qkv.lora_A.weight' is [8, 32]",
                      "needs [8, 64]", "another model shape");
  }
  {
    TempDir dir;  // fewer layers: the file holds tensors the model lacks
    auto trainer = make(lora_job(dir, load), dir, {"model.n_layer=1"});
    EXPECT_THROW_WITH(trainer->setup(), CheckpointError,
                      "holds tensor 'base_model.model.h.1.attn.proj.lora_A.weight'",
                      "another model");
  }
  {
    TempDir dir;  // the job contradicts the adapter's config
    auto trainer = make(lora_job(dir, load + "\nr = 16"), dir);
    EXPECT_THROW_WITH(trainer->setup(), ConfigError, "[lora] r = 16 but the adapter in",
                      "has r = 8", "remove r from [lora]");
  }
  {
    TempDir dir;  // refused while the job is prepared (Note [One resolved job])
    EXPECT_THROW_WITH(make(lora_job(dir, "adapter_path = \"no/such/folder\""), dir), ConfigError,
                      "[lora] adapter_path", "holds no adapter_model.safetensors");
  }
}

}  // namespace
}  // namespace loom
