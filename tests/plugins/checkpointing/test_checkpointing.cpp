// The checkpointing plugin: gradients equal those of the plain run (bitwise on CPU, dropout on,
// with accumulation, frozen inputs, bf16 autocast), the policy picks the right units, the peak
// of the tracked allocator drops, and bad policies and models without a UnitList are errors.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <map>
#include <mutex>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

// Counts how often each unit runs; added inside the checkpointing interceptor, it sees the
// recompute too.
class RunCounter final : public nn::UnitInterceptor {
 public:
  std::string name() const override { return "test_counter"; }
  at::Tensor intercept(int64_t index, nn::Unit&, const at::Tensor& x,
                       const nn::UnitFn& next) override {
    ++runs[index];
    return next(x);
  }
  std::map<int64_t, int> runs;
};

struct StepResult {
  std::vector<std::string> names;
  std::vector<at::Tensor> grads;
  std::vector<double> losses;
  int64_t activation_peak = 0;  // most bytes above the forward's start, over the micro-steps
  std::map<int64_t, int> unit_runs;
};

struct Options {
  std::string policy;  // the [checkpointing] table's body; empty = no table
  std::vector<std::string> set;
  bool autocast_bf16 = false;
  bool freeze_embeddings = false;
};

StepResult train_one_step(const Options& options) {
  TempDir dir;
  std::string job = tiny_gpt_job(dir.str());
  if (!options.policy.empty())
    job += "\n[checkpointing]\n" + options.policy + "\n";
  std::vector<std::string> set = {"train.max_steps=1", "train.max_grad_norm=0",
                                  "train.save_final=false", "model.dropout=0.1",
                                  "model.n_layer=4", "train.gradient_accumulation_steps=2"};
  set.insert(set.end(), options.set.begin(), options.set.end());
  auto trainer = Trainer::from_text(job, dir.path(), set);
  Engine& engine = trainer->engine();
  StepResult run;
  auto counter = std::make_shared<RunCounter>();
  engine.on(Event::setup, [&](Engine& e) { e.add_unit_interceptor(counter); });
  engine.on(Event::model_built, [&](Engine& e) {
    if (!options.freeze_embeddings) return;
    for (auto& item : e.model().named_parameters())
      if (item.key().rfind("wte", 0) == 0 || item.key().rfind("wpe", 0) == 0)
        item.value().requires_grad_(false);
  });
  int64_t start = 0;
  engine.on(Event::before_forward, [&](Engine&) {
    memory::reset_cpu_peak();
    start = memory::cpu_stats().current_bytes;
    if (options.autocast_bf16) {
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCPU, true);
    }
  });
  engine.on(Event::after_forward, [&](Engine& e) {
    if (options.autocast_bf16) {
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    run.losses.push_back(e.output().loss_sum.item<double>());
  });
  engine.on(Event::after_backward, [&](Engine&) {
    run.activation_peak = std::max(run.activation_peak, memory::cpu_stats().peak_bytes - start);
  });
  engine.on(Event::before_update, [&](Engine& e) {
    for (const auto& p : e.params()) {
      run.names.push_back(p.name);
      run.grads.push_back(p.tensor.grad().defined() ? p.tensor.grad().clone() : at::Tensor());
    }
  });
  trainer->run();
  run.unit_runs = counter->runs;
  return run;
}

void expect_bitwise_equal(const StepResult& want, const StepResult& got) {
  ASSERT_EQ(want.names, got.names);
  EXPECT_EQ(want.losses, got.losses);
  for (size_t i = 0; i < want.grads.size(); ++i) {
    ASSERT_TRUE(want.grads[i].defined()) << want.names[i];
    ASSERT_TRUE(got.grads[i].defined()) << "no gradient for " << got.names[i];
    EXPECT_TRUE(at::equal(want.grads[i], got.grads[i]))
        << want.names[i] << " max diff "
        << (want.grads[i] - got.grads[i]).abs().max().item<double>();
  }
}

TEST(Checkpointing, GradientsEqualThePlainRunBitwiseWithDropout) {
  const StepResult plain = train_one_step({});
  // Two micro-batches of 4 units each: every unit runs once per micro-batch.
  EXPECT_EQ(plain.unit_runs, (std::map<int64_t, int>{{0, 2}, {1, 2}, {2, 2}, {3, 2}}));
  const StepResult every = train_one_step({"every = 1"});
  expect_bitwise_equal(plain, every);
  // Checkpointed units run again in backward.
  EXPECT_EQ(every.unit_runs, (std::map<int64_t, int>{{0, 4}, {1, 4}, {2, 4}, {3, 4}}));
  const StepResult second = train_one_step({"every = 2"});
  expect_bitwise_equal(plain, second);
  EXPECT_EQ(second.unit_runs, (std::map<int64_t, int>{{0, 4}, {1, 2}, {2, 4}, {3, 2}}));
  const StepResult listed = train_one_step({"units = [1, 3]"});
  expect_bitwise_equal(plain, listed);
  EXPECT_EQ(listed.unit_runs, (std::map<int64_t, int>{{0, 2}, {1, 4}, {2, 2}, {3, 4}}));
}

TEST(Checkpointing, FrozenInputsStillGiveTheUnitsTheirGradients) {
  // Frozen embeddings (as under LoRA): the first unit's input requires no grad, the case in
  // which a reentrant checkpoint drops the unit's parameter gradients.
  const StepResult plain = train_one_step({.freeze_embeddings = true});
  const StepResult every = train_one_step({.policy = "every = 1", .freeze_embeddings = true});
  ASSERT_EQ(plain.names, every.names);
  for (const auto& name : every.names) EXPECT_EQ(name.rfind("wte", 0), std::string::npos);
  expect_bitwise_equal(plain, every);
  for (size_t i = 0; i < every.names.size(); ++i)
    if (every.names[i].rfind("h.0.", 0) == 0)
      EXPECT_GT(every.grads[i].abs().sum().item<double>(), 0.0) << every.names[i];
}

double max_relative_diff(const StepResult& a, const StepResult& b) {
  double worst = 0;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    const double scale = a.grads[i].abs().max().item<double>();
    worst = std::max(worst, (a.grads[i] - b.grads[i]).abs().max().item<double>() /
                                std::max(scale, 1e-12));
  }
  return worst;
}

TEST(Checkpointing, RecomputeRunsUnderTheForwardsBf16Autocast) {
  const StepResult fp32 = train_one_step({});
  const StepResult plain = train_one_step({.autocast_bf16 = true});
  const StepResult every = train_one_step({.policy = "every = 1", .autocast_bf16 = true});
  // The set-up exercises bf16: its gradients are visibly not fp32's ...
  EXPECT_GT(max_relative_diff(fp32, plain), 1e-3);
  // ... and the recompute repeats the same bf16 computation (its forward under the forward's
  // autocast, its backward under the backward's): on CPU the tolerance is zero, bitwise.
  expect_bitwise_equal(plain, every);
  // The autocast state the test switched off stays off after the backward's recompute.
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
}

TEST(Checkpointing, PeakActivationMemoryDrops) {
  const std::vector<std::string> big = {"data.seq_len=64", "model.n_positions=64",
                                        "model.n_embd=64", "train.per_device_train_batch_size=8",
                                        "model.dropout=0.0"};
  const StepResult plain = train_one_step({.set = big});
  const StepResult every = train_one_step({.policy = "every = 1", .set = big});
  const StepResult second = train_one_step({.policy = "every = 2", .set = big});
  ASSERT_GT(plain.activation_peak, 0);
  // 4 units: keeping only the units' inputs (plus one unit's recompute at a time) must cut
  // the forward+backward peak by more than half.
  EXPECT_LT(every.activation_peak, plain.activation_peak / 2)
      << every.activation_peak << " vs " << plain.activation_peak;
  EXPECT_LT(every.activation_peak, second.activation_peak);
  EXPECT_LT(second.activation_peak, plain.activation_peak);
}

TEST(Checkpointing, BadPoliciesAreClearErrors) {
  TempDir dir;
  auto setup_with = [&](const std::string& policy) {
    Trainer::from_text(tiny_gpt_job(dir.str()) + "\n[checkpointing]\n" + policy + "\n",
                       dir.path(), {"train.save_final=false"})
        ->setup();
  };
  EXPECT_THROW_WITH(setup_with("every = 0"), ConfigError, "job.toml:",
                    "[checkpointing] every must be >= 1", "got 0");
  EXPECT_THROW_WITH(setup_with("every = -3"), ConfigError, "every must be >= 1", "got -3");
  EXPECT_THROW_WITH(setup_with("units = [0, 2]"), ConfigError, "job.toml:",
                    "units names unit 2 but model 'gpt' has 2 units (0..1)");
  EXPECT_THROW_WITH(setup_with("units = [-1]"), ConfigError, "integers >= 0", "got -1");
  EXPECT_THROW_WITH(setup_with("units = [1, 1]"), ConfigError, "lists unit 1 twice");
  EXPECT_THROW_WITH(setup_with("units = []"), ConfigError, "units is empty");
  EXPECT_THROW_WITH(setup_with("units = [0]\nevery = 2"), ConfigError,
                    "either units or every, not both");
}

TEST(Checkpointing, AModelWithoutUnitListIsAnError) {
  TempDir dir;
  std::string job = tiny_gpt_job(dir.str());
  job.replace(job.find("model = \"gpt\""), 13, "model = \"plain_lm\"");
  job = job.substr(0, job.find("[model]")) + "[model]\nvocab_size = 64\n" +
        job.substr(job.find("[data]")) + "\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR
        "\"\n[checkpointing]\n";
  // Without [checkpointing] the model trains ...
  {
    TempDir plain_dir;
    std::string plain = job.substr(0, job.find("[checkpointing]"));
    plain.replace(plain.find(dir.str()), dir.str().size(), plain_dir.str());
    EXPECT_EQ(Trainer::from_text(plain, plain_dir.path(), {"train.max_steps=1"})->run().steps, 1);
  }
  // ... with it, the plugin says it has nothing to wrap.
  EXPECT_THROW_WITH(Trainer::from_text(job, dir.path(), {})->setup(), ConfigError,
                    "model 'plain_lm' has no loom::nn::UnitList", "nothing to checkpoint",
                    "remove [checkpointing]");
}

}  // namespace
}  // namespace loom
