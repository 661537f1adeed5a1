// The moe plugin: one expert with no capacity limit is the dense model bit for bit; a layer's
// output and gradients (dropped tokens, auxiliary losses) equal an independent Python
// reference (moe_ref.py); activation checkpointing changes nothing (the auxiliary losses reach
// the router through the recompute); a resumed run is bitwise the uninterrupted one; the
// metrics are written; `loom export` says an MoE GPT has no GPT-2 form; bad [moe] keys are
// clear errors. Expert parallelism over real ranks is
// tests/distributed/moe_test.sh.
#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "loom/engine.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
namespace fs = std::filesystem;

std::string job(const std::string& out, const std::string& moe, int steps = 4) {
  std::string text = test::tiny_gpt_job(out);
  text.replace(text.find("max_steps = 4"), 13, "max_steps = " + std::to_string(steps));
  text += "\n[optimizer]\nname = \"adamw\"\nweight_decay = 0.1\n";
  if (!moe.empty()) text += "\n[moe]\n" + moe + "\n";
  return text;
}

std::map<std::string, at::Tensor> trained(const std::string& text, const fs::path& dir,
                                          std::vector<double>* losses = nullptr) {
  auto trainer = Trainer::from_text(text, dir);
  trainer->setup();
  if (losses) trainer->engine().on(Event::step_end, [losses](Engine& e) {
    losses->push_back(e.state().loss);
  });
  trainer->run();
  std::map<std::string, at::Tensor> out;
  for (const auto& item : trainer->engine().model().named_parameters(true))
    out[item.key()] = item.value().detach().clone();
  return out;
}

TEST(Moe, OneExpertWithoutCapacityLimitIsTheDenseModelBitwise) {
  TempDir dense_dir, moe_dir;
  std::string dense = job(dense_dir.str(), "", 6);
  std::vector<double> dense_losses, moe_losses;
  // No clipping: the router's gradient would change the global norm. (The balancing loss has
  // no gradient with one expert: softmax over one logit is constantly 1; a z-loss would.)
  const std::string no_clip = "max_grad_norm = 0.0\n";
  auto with = [&](std::string text) {
    return text.insert(text.find("[model]"), no_clip);
  };
  const auto a = trained(with(dense), dense_dir.path(), &dense_losses);
  const auto b = trained(with(job(moe_dir.str(),
                                  "num_experts = 1\ntop_k = 1\nmoe_every = 1\ndropless = true\n"
                                  "init = \"upcycle\"",
                                  6)),
                         moe_dir.path(), &moe_losses);
  ASSERT_EQ(dense_losses.size(), 6u);
  EXPECT_EQ(dense_losses, moe_losses);
  int compared = 0;
  for (const auto& [name, tensor] : a) {
    std::string other = name;
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {"ffn.fc_in.weight", "ffn.w_in"}, {"ffn.fc_in.bias", "ffn.b_in"},
             {"ffn.fc_out.weight", "ffn.w_out"}, {"ffn.fc_out.bias", "ffn.b_out"}})
      if (name.size() > from.size() && name.compare(name.size() - from.size(), from.size(), from) == 0)
        other = name.substr(0, name.size() - from.size()) + to;
    ASSERT_TRUE(b.count(other)) << other;
    EXPECT_TRUE(at::equal(tensor, b.at(other).reshape(tensor.sizes()))) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(a.size()));
  EXPECT_TRUE(b.count("h.0.ffn.router") && b.count("h.1.ffn.router"));
}

// Runs block 0's MoE layer of a fresh model on random input, saves what moe_ref.py needs.
struct LayerCase {
  int top_k;
  double capacity_factor;
  bool dropless;
};

TEST(Moe, LayerMatchesIndependentReferenceWithDroppedTokensAndAuxiliaryLosses) {
  for (const LayerCase c : {LayerCase{1, 1.0, false}, LayerCase{2, 0.5, false},
                            LayerCase{2, 1.0, true}, LayerCase{1, 1.0, true}}) {
    SCOPED_TRACE("top_k " + std::to_string(c.top_k) + " capacity " +
                 std::to_string(c.capacity_factor) + (c.dropless ? " dropless" : ""));
    TempDir dir;
    const std::string moe = "num_experts = 4\ntop_k = " + std::to_string(c.top_k) +
                            "\nmoe_every = 1\nmin_capacity = 0\ncapacity_factor = " +
                            std::to_string(c.capacity_factor) +
                            "\naux_loss_coef = 0.01\nz_loss_coef = 0.001\ndropless = " +
                            (c.dropless ? "true" : "false");
    auto trainer = Trainer::from_text(job(dir.str(), moe), dir.path());
    trainer->setup();
    auto& block = dynamic_cast<nn::TransformerBlock&>((*trainer->engine().unit_lists()[0])[0]);
    nn::FeedForwardBase& layer = *block.ffn;
    layer.train();
    std::map<std::string, at::Tensor> params;
    for (const auto& item : layer.named_parameters(true)) params[item.key()] = item.value();
    ASSERT_EQ(params.size(), 5u);
    {
      // A router decisive enough that capacity matters.
      at::NoGradGuard no_grad;
      params.at("router").mul_(20.0);
    }
    at::manual_seed(11);
    at::Tensor x = at::randn({2, 8, 32}).requires_grad_(true);
    at::Tensor g = at::randn({2, 8, 32});
    for (auto& [name, p] : params) p.mutable_grad() = at::Tensor();
    nn::detail::reset_aux_losses();
    nn::detail::set_aux_loss_grad_scale(1.0);
    at::Tensor out = layer.forward(x);
    const at::Tensor aux = nn::detail::collected_aux_losses();
    ASSERT_TRUE(aux.defined());
    (out * g).sum().backward();

    NamedTensors file = {{"x", x.detach()}, {"g", g}, {"out", out.detach()},
                         {"aux", aux.reshape({})}, {"grad_x", x.grad()}};
    for (auto& [name, p] : params) {
      file.emplace_back(name, p.detach());
      file.emplace_back("grad_" + name, p.grad());
    }
    const fs::path saved = dir / "layer.safetensors";
    safetensors::save(saved, file);
    const std::string report = test::run_command(
        std::string(LOOM_TEST_PYTHON) + " " + LOOM_SOURCE_DIR + "/tests/plugins/moe/moe_ref.py " +
        saved.string() + " " + std::to_string(c.top_k) + " " +
        std::to_string(c.capacity_factor) + " 0 " + (c.dropless ? "1" : "0") + " 0.01 0.001");
    if (!c.dropless && c.top_k == 2)
      EXPECT_EQ(report.find("dropped 0 "), std::string::npos) << "nothing was dropped:\n" << report;
    if (c.dropless) EXPECT_NE(report.find("dropped 0 "), std::string::npos) << report;
    nn::detail::reset_aux_losses();
  }
}

TEST(Moe, CheckpointingAndResumeChangeNothingAndMetricsAreWritten) {
  const std::string moe = "num_experts = 4\ntop_k = 2\nmoe_every = 1\nz_loss_coef = 0.001";
  TempDir plain_dir, recompute_dir, resumed_dir;
  auto saving = [](std::string text) { return text.insert(text.find("[model]"), "save_steps = 3\n"); };
  const auto plain = trained(saving(job(plain_dir.str(), moe, 6)), plain_dir.path());
  // Every unit recomputed in backward: the router's auxiliary-loss gradient must still arrive.
  const auto recompute =
      trained(job(recompute_dir.str(), moe, 6) + "\n[checkpointing]\n", recompute_dir.path());
  for (const auto& [name, tensor] : plain)
    EXPECT_TRUE(at::equal(tensor, recompute.at(name))) << name;

  // From the plain run's step-3 checkpoint to step 6: the uninterrupted run's weights.
  std::string resumed = job(resumed_dir.str(), moe, 6);
  resumed.insert(resumed.find("[model]"),
                 "resume = \"" + (plain_dir / "checkpoint-3").string() + "\"\n");
  const auto after = trained(resumed, resumed_dir.path());
  for (const auto& [name, tensor] : plain) EXPECT_TRUE(at::equal(tensor, after.at(name))) << name;

  // transformers' GPT-2 has no experts: exporting says so, and writes nothing.
  EXPECT_THROW_WITH(export_checkpoint(plain_dir / "checkpoint-6", resumed_dir / "hf"),
                    CheckpointError, "Mixture-of-Experts", "loom consolidate");
  EXPECT_FALSE(fs::exists(resumed_dir / "hf"));

  std::ifstream metrics(plain_dir / "metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    for (const char* key : {"aux_loss", "moe_load_max_over_mean", "moe_dropped_fraction",
                            "moe_balance_loss", "moe_z_loss"})
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
    EXPECT_GE(j["moe_load_max_over_mean"].get<double>(), 1.0);
    EXPECT_GE(j["moe_balance_loss"].get<double>(), 0.99);  // α·E·Σf·P >= α at balance
    ++lines;
  }
  EXPECT_EQ(lines, 6);
}

TEST(Moe, BadKeysAreErrorsNamingTheKey) {
  TempDir dir;
  auto setup = [&](const std::string& moe, const std::string& extra = "") {
    Trainer::from_text(job(dir.str(), moe) + extra, dir.path())->setup();
  };
  EXPECT_THROW_WITH(setup("num_experts = 6\nexpert_parallel_size = 4"), ConfigError,
                    "expert_parallel_size", "divide num_experts");
  EXPECT_THROW_WITH(setup("num_experts = 4\nexpert_parallel_size = 2"), ConfigError,
                    "expert_parallel_size", "world size");
  EXPECT_THROW_WITH(setup("num_experts = 2\ntop_k = 3"), ConfigError, "top_k", "num_experts");
  EXPECT_THROW_WITH(setup("capacity_factor = 0.0"), ConfigError, "capacity_factor", "positive");
  EXPECT_THROW_WITH(setup("capacity_factor = -1.0"), ConfigError, "capacity_factor");
  EXPECT_THROW_WITH(setup("moe_every = 3"), ConfigError, "moe_every", "fewer than");
  EXPECT_THROW_WITH(setup("init = \"copy\""), ConfigError, "init", "upcycle");
  std::string plain = job(dir.str(), "");
  plain.replace(plain.find("model = \"gpt\""), 13, "model = \"plain_lm\"");
  plain.replace(plain.find("[model]"), plain.find("[data]") - plain.find("[model]"),
                "[model]\nvocab_size = 64\n\n");
  plain += "\n[moe]\n\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR "\"\n";
  EXPECT_THROW_WITH(Trainer::from_text(plain, dir.path())->setup(), ConfigError, "[moe]",
                    "no loom::nn::TransformerBlock with a FeedForward", "plain_lm");
}

}  // namespace
}  // namespace loom
