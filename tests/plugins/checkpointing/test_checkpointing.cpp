// The checkpointing plugin: gradients equal those of the plain run (bitwise on CPU, dropout on,
// with accumulation, frozen inputs, bf16 autocast), for each recompute policy (full, attention,
// mlp, every_n, and whole units with a region of the others) on gpt and llama; the keys pick
// the right units and regions, the peak of the tracked allocator drops by each policy's share
// (and by the sum of the parts' shares for full on some units and attention on the others),
// and bad policies, selective policies on units without regions and models without a UnitList
// are errors.
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

// Counts how often each unit and each region (Note [Recompute regions]) runs; added inside
// the checkpointing interceptor, it sees the recompute too.
class RunCounter final : public nn::UnitInterceptor {
 public:
  std::string name() const override { return "test_counter"; }
  at::Tensor intercept(int64_t index, nn::Unit&, const at::Tensor& x,
                       const nn::UnitFn& next) override {
    ++runs[index];
    return next(x);
  }
  at::Tensor intercept_region(int64_t index, const nn::RegionCall& call,
                              const nn::RegionFn& next) override {
    ++(call.region == nn::Region::attention ? attention_runs : mlp_runs)[index];
    return next(call.inputs);
  }
  std::map<int64_t, int> runs, attention_runs, mlp_runs;
};

struct StepResult {
  std::vector<std::string> names;
  std::vector<at::Tensor> grads;
  std::vector<double> losses;
  int64_t activation_peak = 0;  // most bytes above the forward's start, over the micro-steps
  std::map<int64_t, int> unit_runs, attention_runs, mlp_runs;
  std::vector<at::Tensor> final_weights;  // after the last update
};

struct Options {
  std::string policy;  // the [checkpointing] table's body; empty = no table
  std::vector<std::string> set;
  bool autocast_bf16 = false;
  bool freeze_embeddings = false;
  bool llama = false;  // a tiny llama (grouped-query attention, SwiGLU) instead of the gpt
  int64_t steps = 1;
};

// A llama as small as tiny_gpt_job's gpt, with attention dropout (its only dropout).
std::string tiny_llama_job(const std::string& dir) {
  std::string job = tiny_gpt_job(dir);
  job.replace(job.find("model = \"gpt\""), 13, "model = \"llama\"");
  const auto from = job.find("[model]"), to = job.find("[data]");
  job.replace(from, to - from,
              "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 48\n"
              "num_hidden_layers = 4\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
              "max_position_embeddings = 16\nattention_dropout = 0.1\n\n");
  return job;
}

StepResult train_one_step(const Options& options) {
  TempDir dir;
  std::string job = options.llama ? tiny_llama_job(dir.str()) : tiny_gpt_job(dir.str());
  if (!options.policy.empty())
    job += "\n[checkpointing]\n" + options.policy + "\n";
  std::vector<std::string> set = {"train.max_steps=" + std::to_string(options.steps),
                                  "train.max_grad_norm=0", "train.save_final=false",
                                  "train.gradient_accumulation_steps=2"};
  if (!options.llama) {
    set.push_back("model.dropout=0.1");
    set.push_back("model.n_layer=4");
  }
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
    // The last update's gradients.
    run.names.clear();
    run.grads.clear();
    for (const auto& p : e.params()) {
      run.names.push_back(p.name);
      run.grads.push_back(p.tensor.grad().defined() ? p.tensor.grad().clone() : at::Tensor());
    }
  });
  trainer->run();
  for (const auto& p : engine.params()) run.final_weights.push_back(p.tensor.detach().clone());
  run.unit_runs = counter->runs;
  run.attention_runs = counter->attention_runs;
  run.mlp_runs = counter->mlp_runs;
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
  ASSERT_EQ(want.final_weights.size(), got.final_weights.size());
  for (size_t i = 0; i < want.final_weights.size(); ++i)
    EXPECT_TRUE(at::equal(want.final_weights[i], got.final_weights[i])) << want.names[i];
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

// Each unit of the 4 runs once per micro-batch (2 micro-batches a step) in the plain run.
std::map<int64_t, int> each_unit(int plain_steps_runs, std::map<int64_t, int> extra = {}) {
  std::map<int64_t, int> runs;
  for (int64_t i = 0; i < 4; ++i) runs[i] = plain_steps_runs + extra[i];
  return runs;
}

TEST(Checkpointing, EveryPolicyTrainsBitwiseLikeThePlainRunOnGptAndLlama) {
  // Three steps of two micro-batches, dropout on (the gpt's everywhere, the llama's in
  // attention): losses, last gradients and final weights are the plain run's, bit for bit.
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt");
    const StepResult plain = train_one_step({.llama = llama, .steps = 3});
    ASSERT_EQ(plain.losses.size(), 6u);
    EXPECT_EQ(plain.unit_runs, each_unit(6));
    EXPECT_EQ(plain.attention_runs, each_unit(6));
    EXPECT_EQ(plain.mlp_runs, each_unit(6));
    // What each policy runs again in backward: the whole unit, or just one region of it.
    const StepResult full = train_one_step({"policy = \"full\"", {}, false, false, llama, 3});
    expect_bitwise_equal(plain, full);
    EXPECT_EQ(full.unit_runs, each_unit(12));
    EXPECT_EQ(full.attention_runs, each_unit(12));
    const StepResult attention =
        train_one_step({"policy = \"attention\"", {}, false, false, llama, 3});
    expect_bitwise_equal(plain, attention);
    EXPECT_EQ(attention.unit_runs, each_unit(6));
    EXPECT_EQ(attention.attention_runs, each_unit(12));
    EXPECT_EQ(attention.mlp_runs, each_unit(6));
    const StepResult mlp = train_one_step({"policy = \"mlp\"", {}, false, false, llama, 3});
    expect_bitwise_equal(plain, mlp);
    EXPECT_EQ(mlp.unit_runs, each_unit(6));
    EXPECT_EQ(mlp.attention_runs, each_unit(6));
    EXPECT_EQ(mlp.mlp_runs, each_unit(12));
    const StepResult every_n =
        train_one_step({"policy = \"every_n\"\nevery = 2", {}, false, false, llama, 3});
    expect_bitwise_equal(plain, every_n);
    EXPECT_EQ(every_n.unit_runs, each_unit(6, {{0, 6}, {2, 6}}));
    // A selective policy on chosen units only.
    const StepResult listed =
        train_one_step({"policy = \"attention\"\nunits = [1, 2]", {}, false, false, llama, 3});
    expect_bitwise_equal(plain, listed);
    EXPECT_EQ(listed.attention_runs, each_unit(6, {{1, 6}, {2, 6}}));
    // Whole units and a region of the others (Note [Recompute policies]): units 0-1 run
    // again whole (their regions with them), units 2-3 run their attention (or MLP) again.
    const StepResult combined = train_one_step(
        {"policy = \"full\"\nfirst = 2\nothers = \"attention\"", {}, false, false, llama, 3});
    expect_bitwise_equal(plain, combined);
    EXPECT_EQ(combined.unit_runs, each_unit(6, {{0, 6}, {1, 6}}));
    EXPECT_EQ(combined.attention_runs, each_unit(12));
    EXPECT_EQ(combined.mlp_runs, each_unit(6, {{0, 6}, {1, 6}}));
    const StepResult every_n_mlp = train_one_step(
        {"policy = \"every_n\"\nevery = 2\nothers = \"mlp\"", {}, false, false, llama, 3});
    expect_bitwise_equal(plain, every_n_mlp);
    EXPECT_EQ(every_n_mlp.unit_runs, each_unit(6, {{0, 6}, {2, 6}}));
    EXPECT_EQ(every_n_mlp.attention_runs, each_unit(6, {{0, 6}, {2, 6}}));
    EXPECT_EQ(every_n_mlp.mlp_runs, each_unit(12));
  }
}

TEST(Checkpointing, EachPolicyCutsThePeakByWhatItDoesNotKeep) {
  // 4 gpt units, B 8, T 64, C 64, H 4, dropout 0.1 (SDPA's math kernel: it keeps the (B,H,T,T)
  // probabilities, its dropout mask and their product). What each policy stops keeping per
  // unit, in fp32 bytes (torch.autograd.graph.saved_tensors_hooks counts the same on this
  // shape):
  //   attention: the 3 (B,H,T,T) tensors; its scaled q and k copies and v's contiguous copy
  //              (3 BTC) trade for the region's input, qkv's (B,T,3C) output.
  //   mlp:       fc_in's (B,T,4C) output, the activation's (B,T,4C) output and the (B,T,C)
  //              dropout mask; its input, norm2's output, fc_in kept anyway.
  const int64_t B = 8, T = 64, C = 64, H = 4, units = 4;
  const double attention_bytes = 4.0 * 3 * B * H * T * T, mlp_bytes = 4.0 * 9 * B * T * C;
  const std::vector<std::string> shape = {
      "data.seq_len=64", "model.n_positions=64", "model.n_embd=64", "model.n_head=4",
      "train.per_device_train_batch_size=8"};
  auto peak = [&](const std::string& policy) {
    return static_cast<double>(train_one_step({.policy = policy, .set = shape}).activation_peak);
  };
  const double plain = peak(""), full = peak("policy = \"full\"");
  const double attention = peak("policy = \"attention\""), mlp = peak("policy = \"mlp\"");
  const double every_n = peak("policy = \"every_n\"\nevery = 2");
  // The peak is at the start of backward, when the last unit recomputes its region: the
  // cut is between (units - 1) and units times the per-unit share, less the recompute's
  // transients (measured: attention 3.4, mlp 2.9 shares). Cutting nothing, or both regions'
  // share, falls outside.
  const auto in_band = [&](double got, double per_unit) {
    const double cut = plain - got;
    return cut >= 0.9 * (units - 1) * per_unit && cut <= 1.05 * units * per_unit;
  };
  EXPECT_TRUE(in_band(attention, attention_bytes))
      << "attention cut " << plain - attention << " of " << plain << "; per unit "
      << attention_bytes;
  EXPECT_TRUE(in_band(mlp, mlp_bytes))
      << "mlp cut " << plain - mlp << " of " << plain << "; per unit " << mlp_bytes;
  // Whole units keep only their inputs: more than either region alone, and every_n (half the
  // units) lies between full and the plain run.
  EXPECT_LT(full, attention);
  EXPECT_LT(full, mlp);
  EXPECT_LT(full, every_n);
  EXPECT_LT(every_n, plain);
  EXPECT_LT(full, plain / 2) << full << " vs " << plain;
  // Full on units 0-1 and attention on units 2-3 (others, Note [Recompute policies]): the
  // cut is the full units' cut plus the attention units' cut, to the byte (the parts keep
  // disjoint tensors, and the peak stays where it was). The attention part alone cuts 1-2
  // units' share, as the band above says for 2 units.
  const double first_two = peak("policy = \"full\"\nfirst = 2");
  const double last_two_attention = peak("policy = \"attention\"\nunits = [2, 3]");
  const double combined = peak("policy = \"full\"\nfirst = 2\nothers = \"attention\"");
  EXPECT_GE(plain - last_two_attention, 0.9 * attention_bytes) << last_two_attention;
  EXPECT_LE(plain - last_two_attention, 1.05 * 2 * attention_bytes) << last_two_attention;
  EXPECT_GT(plain - first_two, 0.0);
  EXPECT_EQ(plain - combined, (plain - first_two) + (plain - last_two_attention))
      << "plain " << plain << ", full on 0-1 " << first_two << ", attention on 2-3 "
      << last_two_attention << ", both " << combined;
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
  EXPECT_THROW_WITH(setup_with("policy = \"selective\""), ConfigError, "job.toml:",
                    "[checkpointing] policy 'selective' is unknown",
                    "the policies are full, attention, mlp, every_n");
  EXPECT_THROW_WITH(setup_with("policy = \"every_n\""), ConfigError, "job.toml:",
                    "policy = \"every_n\" needs every = N >= 2", "every is not set");
  EXPECT_THROW_WITH(setup_with("policy = \"every_n\"\nevery = 1"), ConfigError,
                    "policy = \"every_n\" needs every = N >= 2", "got every = 1");
  EXPECT_THROW_WITH(setup_with("policy = \"every_n\"\nunits = [1]"), ConfigError, "job.toml:",
                    "policy = \"every_n\" picks units by every; drop units");
  // first = N and others (Note [Recompute policies]).
  EXPECT_THROW_WITH(setup_with("first = 0"), ConfigError, "job.toml:",
                    "[checkpointing] first must be >= 1", "got 0");
  EXPECT_THROW_WITH(setup_with("first = 1\nevery = 2"), ConfigError, "job.toml:",
                    "[checkpointing] set either first or every, not both");
  EXPECT_THROW_WITH(setup_with("first = 1\nunits = [0]"), ConfigError, "job.toml:",
                    "[checkpointing] set either first or units, not both");
  EXPECT_THROW_WITH(setup_with("policy = \"every_n\"\nfirst = 1"), ConfigError, "job.toml:",
                    "policy = \"every_n\" picks units by every; drop first, or use policy = "
                    "\"full\" to recompute the first units");
  EXPECT_THROW_WITH(setup_with("first = 3"), ConfigError, "job.toml:",
                    "[checkpointing] first = 3 but model 'gpt' has 2 units; first must be at "
                    "most 2");
  EXPECT_THROW_WITH(setup_with("first = 1\nothers = \"selective\""), ConfigError, "job.toml:",
                    "[checkpointing] others 'selective' is unknown; the choices are none, "
                    "attention, mlp");
  EXPECT_THROW_WITH(setup_with("policy = \"attention\"\nfirst = 1\nothers = \"mlp\""),
                    ConfigError, "job.toml:",
                    "[checkpointing] others = \"mlp\" is for the whole-unit policies (full, "
                    "every_n)",
                    "with policy = \"attention\" the units not chosen recompute nothing. Use "
                    "policy = \"full\", or drop others");
  EXPECT_THROW_WITH(setup_with("others = \"attention\""), ConfigError, "job.toml:",
                    "[checkpointing] others = \"attention\" applies to the units policy = "
                    "\"full\" does not choose, but every = 1 chooses every unit; choose fewer "
                    "with first = N, units = [...] or every = N");
  EXPECT_THROW_WITH(setup_with("first = 2\nothers = \"attention\""), ConfigError, "job.toml:",
                    "[checkpointing] others = \"attention\" applies to the units that policy = "
                    "\"full\" does not choose, but first chooses all 2 units of model 'gpt'; "
                    "choose fewer, or drop others");
  EXPECT_THROW_WITH(setup_with("units = [0, 1]\nothers = \"mlp\""), ConfigError,
                    "but units chooses all 2 units of model 'gpt'");
}

TEST(Checkpointing, ASelectivePolicyOnUnitsWithoutRegionsIsAnError) {
  // A model whose units mark no regions (a Unit of plain ATen pieces) must not silently save
  // nothing. An interceptor that runs the gpt's units without the region runner stands in.
  class Unmark final : public nn::UnitInterceptor {
   public:
    std::string name() const override { return "test_unmark"; }
    at::Tensor intercept(int64_t, nn::Unit& unit, const at::Tensor& x,
                         const nn::UnitFn&) override {
      return unit.forward(x, nn::UnitArgs{});  // args without the region runner
    }
  };
  auto run_unmarked = [](const std::string& policy) {
    TempDir dir;
    auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()) + "\n[checkpointing]\n" + policy,
                                      dir.path(), {"train.save_final=false", "train.max_steps=1"});
    trainer->engine().on(Event::setup, [](Engine& e) {
      e.add_unit_interceptor(std::make_shared<Unmark>());
    });
    trainer->run();
  };
  EXPECT_THROW_WITH(run_unmarked("policy = \"mlp\"\n"), ConfigError, "job.toml:",
                    "policy = \"mlp\" found no mlp region in the chosen units of model 'gpt'",
                    "use policy = \"full\"");
  // The same for the units a whole-unit policy leaves to others.
  EXPECT_THROW_WITH(run_unmarked("first = 1\nothers = \"attention\"\n"), ConfigError,
                    "job.toml:",
                    "[checkpointing] others = \"attention\" found no attention region in the "
                    "units not chosen of model 'gpt'",
                    "use others = \"none\"");
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
