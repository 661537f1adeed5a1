// The conformance kits (loom/conformance.h) on every in-tree plugin: the update rules (core
// adamw; optim's adafactor, adam8bit, sgd, lion, muon), the data sources (random_tokens, text,
// tokens), the models (gpt, gpt with MoE layers, gpt with LoRA adapters, bert, llama) and the
// checkpointing interceptor; and each kit catching a plugin that breaks its contract.
#include "loom/conformance.h"

#include <gtest/gtest.h>

#include <array>
#include <fstream>

#include "loom/engine.h"
#include "loom/trainer.h"
#include "test_util.h"
#include "update_rules.h"

namespace loom {
namespace {

using test::TempDir;

TEST(Conformance, EveryInTreeUpdateRuleConforms) {
  const std::vector<std::pair<std::string, std::map<std::string, test::RuleValue>>> rules = {
      {"adamw", {}},
      {"adafactor", {}},
      {"adafactor", {{"beta1", 0.9}}},
      {"adam8bit", {{"block_size", int64_t{64}}, {"min_8bit_size", int64_t{256}}}},
      {"sgd", {{"momentum", 0.9}}},
      {"lion", {}},
      {"muon", {}}};
  for (const auto& [name, values] : rules) {
    const auto report = conformance::check_update_rule(*test::make_rule(name, values));
    EXPECT_TRUE(report.ok()) << report.text();
  }
}

// A tiny job of `model` whose engine is set up: its model, data and first batch.
std::unique_ptr<Trainer> set_up(const TempDir& dir, const std::string& model,
                                const std::string& model_lines, const std::string& data_lines,
                                const std::string& tables = "") {
  auto trainer = Trainer::from_text(R"([train]
model = ")" + model + R"("
max_steps = 1
per_device_train_batch_size = 4
seed = 3
output_dir = ")" + dir.str() + R"("
progress_bar = false
log_level = "warn"
[model]
)" + model_lines + "\n[data]\n" + data_lines + "\n" + tables,
                                    dir.path());
  trainer->setup();
  return trainer;
}

const char* kGpt = "vocab_size = 64\nn_positions = 16\nn_embd = 32\nn_layer = 2\nn_head = 2\n"
                   "dropout = 0.1";
const char* kLmData = "source = \"random_tokens\"\ntask = \"lm\"\nnum_samples = 64\nseq_len = 16\n"
                      "vocab_low = 0\nvocab_high = 64";

TEST(Conformance, EveryInTreeDataSourceConforms) {
  TempDir dir;
  {
    std::ofstream text(dir / "corpus.txt");
    // Digits, spaces and newlines: bytes below the model's 64 ids (the text source's ids are
    // its bytes, and data beyond the vocabulary is refused before the run).
    for (int i = 0; i < 400; ++i) text << i << " " << i * 37 << " " << i % 7 << "\n";
    std::ofstream tokens(dir / "tokens.bin", std::ios::binary);
    for (uint16_t i = 0; i < 4000; ++i) {
      const uint16_t id = static_cast<uint16_t>((i * 37) % 64);
      tokens.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
  }
  for (const std::string data : std::vector<std::string>{
           kLmData,
        "source = \"random_tokens\"\ntask = \"classification\"\nnum_samples = 40\nseq_len = 16\n"
        "vocab_low = 0\nvocab_high = 64",
        "source = \"text\"\npath = \"corpus.txt\"\nseq_len = 16",
        "source = \"tokens\"\npath = \"tokens.bin\"\nseq_len = 16"}) {
    SCOPED_TRACE(data);
    const bool classification = data.find("classification") != std::string::npos;
    auto trainer = set_up(dir, classification ? "bert" : "gpt",
                          classification ? "vocab_size = 64\nhidden_size = 32\nnum_hidden_layers = 1\n"
                                           "num_attention_heads = 2\nintermediate_size = 64\n"
                                           "max_position_embeddings = 16"
                                         : kGpt,
                          data);
    auto* source = dynamic_cast<SampledSource*>(&trainer->engine().data());
    ASSERT_NE(source, nullptr);
    const auto report = conformance::check_dataset(source->dataset());
    EXPECT_TRUE(report.ok()) << report.text();
  }
}

TEST(Conformance, EveryInTreeModelConforms) {
  const std::vector<std::array<std::string, 4>> models = {
      {"gpt", "gpt", kGpt, ""},
      {"gpt with MoE layers", "gpt", kGpt, "[moe]\nnum_experts = 4\nmoe_every = 1\n"},
      {"gpt with LoRA adapters", "gpt", kGpt,
       "[lora]\ntarget_modules = \"all-linear\"\ninit_lora_weights = false\n"},
      {"llama", "llama",
       "vocab_size = 64\nhidden_size = 32\nintermediate_size = 48\nnum_hidden_layers = 2\n"
       "num_attention_heads = 4\nnum_key_value_heads = 2\nmax_position_embeddings = 16",
       ""},
  };
  for (const auto& [label, model, lines, tables] : models) {
    TempDir dir;
    auto trainer = set_up(dir, model, lines, kLmData, tables);
    const Batch batch = trainer->engine().data().next();
    const auto report = conformance::check_model(trainer->engine().model(), batch, label);
    EXPECT_TRUE(report.ok()) << report.text();
  }
  TempDir dir;
  auto bert = set_up(dir, "bert",
                     "vocab_size = 64\nhidden_size = 32\nnum_hidden_layers = 1\n"
                     "num_attention_heads = 2\nintermediate_size = 64\nmax_position_embeddings = 16",
                     "source = \"random_tokens\"\ntask = \"classification\"\nnum_samples = 40\n"
                     "seq_len = 16\nvocab_low = 0\nvocab_high = 64");
  const auto report = conformance::check_model(bert->engine().model(),
                                               bert->engine().data().next(), "bert");
  EXPECT_TRUE(report.ok()) << report.text();
}

TEST(Conformance, TheCheckpointingInterceptorConforms) {
  for (const std::string model : {"gpt", "llama"}) {
    TempDir dir;
    auto trainer = set_up(
        dir, model,
        model == "gpt" ? kGpt
                       : "vocab_size = 64\nhidden_size = 32\nintermediate_size = 48\n"
                         "num_hidden_layers = 2\nnum_attention_heads = 4\n"
                         "max_position_embeddings = 16\nattention_dropout = 0.1",
        kLmData, "[checkpointing]\n");
    auto lists = trainer->engine().unit_lists();
    ASSERT_FALSE(lists.empty());
    ASSERT_EQ(lists[0]->interceptors().size(), 1u);
    const auto interceptor = lists[0]->interceptors().front();
    for (auto* list : lists) list->set_interceptors({});
    const auto report = conformance::check_interceptor(trainer->engine().model(), interceptor,
                                                       trainer->engine().data().next());
    EXPECT_TRUE(report.ok()) << report.text();
  }
}

// The kits catch what they check: a rule whose split update differs, a model with an
// unreachable parameter, an interceptor that changes the result.
class SplitSensitiveRule final : public UpdateRule {  // scales by the segment's own mean
 public:
  std::string name() const override { return "split-sensitive"; }
  NamedTensors init_state(const Segment&) const override { return {}; }
  void update(Segment& s, const UpdateContext& c) const override {
    s.param.sub_(s.grad * (c.lr / (s.grad.abs().mean().item<double>() + 1e-12)));
  }
};

class DroppingInterceptor final : public nn::UnitInterceptor {  // skips its unit
 public:
  std::string name() const override { return "dropping"; }
  at::Tensor intercept(int64_t, nn::Unit&, const at::Tensor& x, const nn::UnitFn&) override {
    return x * 1.0;
  }
};

TEST(Conformance, TheKitsCatchBrokenPlugins) {
  const auto rule = conformance::check_update_rule(SplitSensitiveRule());
  EXPECT_FALSE(rule.ok());
  EXPECT_NE(rule.text().find("differs from the unsplit update"), std::string::npos) << rule.text();
  TempDir dir;
  auto trainer = set_up(dir, "gpt", kGpt, kLmData);
  const Batch batch = trainer->engine().data().next();
  const auto intercepted = conformance::check_interceptor(
      trainer->engine().model(), std::make_shared<DroppingInterceptor>(), batch);
  EXPECT_FALSE(intercepted.ok());
  EXPECT_NE(intercepted.text().find("differs with the interceptor"), std::string::npos)
      << intercepted.text();
  // A parameter the loss never reaches.
  trainer->engine().model().register_parameter("unused", at::zeros({3}));
  const auto model = conformance::check_model(trainer->engine().model(), batch, "gpt+unused");
  EXPECT_FALSE(model.ok());
  EXPECT_NE(model.text().find("parameter 'unused' gets no gradient"), std::string::npos)
      << model.text();
}

}  // namespace
}  // namespace loom
