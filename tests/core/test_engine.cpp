// The engine: event order, gradient accumulation with token-level normalisation, bitwise
// resume, and the learning-rate schedules.
#include <ATen/ATen.h>

#include <cmath>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

std::vector<std::string> lines_of(const std::filesystem::path& file) {
  std::vector<std::string> lines;
  std::istringstream in(test::read_text(file));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(Engine, FiresEventsInTheDocumentedOrder) {
  TempDir dir;
  const auto events = dir / "events.txt";
  std::string job = tiny_gpt_job(dir.str()) + "\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR
                    "\"\n[recorder]\nfile = \"" + events.string() + "\"\n";
  auto trainer = Trainer::from_text(job, dir.path(),
                                    {"train.max_steps=2", "train.gradient_accumulation_steps=2"});
  trainer->run();
  const size_t n_params = trainer->engine().params().size();
  // Collapse each run of grad_ready lines into one entry, checking it names every parameter.
  std::vector<std::string> seen;
  size_t grads_in_run = 0;
  for (const auto& line : lines_of(events)) {
    if (line.rfind("grad_ready ", 0) == 0) {
      if (grads_in_run++ == 0) seen.push_back("grad_ready");
      continue;
    }
    if (grads_in_run) EXPECT_EQ(grads_in_run, n_params);
    grads_in_run = 0;
    seen.push_back(line);
  }
  const std::vector<std::string> micro = {"batch", "before_forward", "after_forward",
                                          "before_backward", "grad_ready", "after_backward"};
  std::vector<std::string> expected = {"setup", "model_built", "params_ready"};
  for (int step = 0; step < 2; ++step) {
    for (int k = 0; k < 2; ++k) expected.insert(expected.end(), micro.begin(), micro.end());
    expected.insert(expected.end(), {"before_update", "after_update", "step_end"});
  }
  expected.insert(expected.end(), {"save", "teardown"});
  EXPECT_EQ(seen, expected);

  // Resuming fires load right after params_ready, and plugin values survive the checkpoint.
  std::filesystem::remove(events);
  auto resumed = Trainer::from_text(job, dir.path(), {"train.max_steps=3", "train.resume=latest"});
  resumed->setup();
  const auto after = lines_of(events);
  ASSERT_GE(after.size(), 4u);
  EXPECT_EQ(after[2], "params_ready");
  EXPECT_EQ(after[3], "load");
  EXPECT_EQ(resumed->engine().state().step, 2);
  EXPECT_EQ(resumed->engine().checkpoint().values.at("recorder.saves"), "1");
}

// Gradients after the accumulation window, captured before the update.
std::vector<at::Tensor> window_grads(const TempDir& dir, int64_t batch, int64_t accumulation) {
  auto trainer = Trainer::from_text(
      tiny_gpt_job(dir.str()), dir.path(),
      {"train.max_steps=1", "train.max_grad_norm=0", "data.ignore_label_fraction=0.9",
       "train.per_device_train_batch_size=" + std::to_string(batch),
       "train.gradient_accumulation_steps=" + std::to_string(accumulation),
       "train.save_final=false", "data.shuffle=false"});
  std::vector<at::Tensor> grads;
  std::vector<int64_t> targets;
  trainer->engine().on(Event::after_forward, [&](Engine& e) {
    targets.push_back(e.batch().num_loss_targets());
  });
  trainer->engine().on(Event::before_update, [&](Engine& e) {
    for (const auto& p : e.params()) grads.push_back(p.tensor.grad().clone());
  });
  trainer->run();
  if (accumulation > 1) {
    // The set-up must exercise the normalisation: micro-batches with unequal target counts.
    EXPECT_NE(*std::min_element(targets.begin(), targets.end()),
              *std::max_element(targets.begin(), targets.end()));
  }
  return grads;
}

// Note [Gradients released, not zeroed]: each step's forward starts with no gradient tensor
// (so its peak holds none), every trainable parameter has its gradient again by the update, and
// the tracked memory at the start of each step is the same: weights and optimizer state only.
TEST(Engine, GradientsAreReleasedBetweenSteps) {
  TempDir dir;
  auto trainer = Trainer::from_text(
      tiny_gpt_job(dir.str()), dir.path(),
      {"train.max_steps=3", "train.gradient_accumulation_steps=2", "train.save_final=false"});
  trainer->setup();
  int forwards = 0, updates = 0;
  std::vector<int64_t> at_step_start;
  int64_t grad_bytes = 0;
  trainer->engine().on(Event::before_forward, [&](Engine& e) {
    if (forwards++ % 2 != 0) return;  // the window's first micro-batch only
    at_step_start.push_back(memory::cpu_stats().current_bytes);
    for (const auto& p : e.params())
      EXPECT_FALSE(p.tensor.grad().defined()) << p.name << " holds a gradient at step "
                                              << e.state().step + 1 << "'s start";
  });
  trainer->engine().on(Event::before_update, [&](Engine& e) {
    ++updates;
    grad_bytes = 0;
    for (const auto& p : e.params()) {
      ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
      grad_bytes += p.tensor.grad().numel() * p.tensor.grad().element_size();
    }
  });
  while (trainer->step()) {
  }
  ASSERT_EQ(updates, 3);
  ASSERT_EQ(at_step_start.size(), 3u);
  ASSERT_GT(grad_bytes, 0);
  // Steps 2 and 3 start alike (step 1 starts before the optimizer state exists).
  EXPECT_EQ(at_step_start[1], at_step_start[2]);
}

TEST(Engine, AccumulationNormalisesByTheWindowsTargets) {
  TempDir a, b;
  auto whole = window_grads(a, 8, 1);
  auto accumulated = window_grads(b, 2, 4);
  ASSERT_EQ(whole.size(), accumulated.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    const double diff = (whole[i] - accumulated[i]).norm().item<double>();
    const double norm = whole[i].norm().item<double>();
    EXPECT_LE(diff, 1e-6 * norm + 1e-12) << "parameter " << i;
  }
}

NamedTensors load_tensors(const std::filesystem::path& file) {
  return safetensors::load(file).tensors;
}

TEST(Engine, ResumeIsBitwiseExact) {
  TempDir straight, split;
  // Dropout on (RNG state), shuffling over 2+ epochs, accumulation, a warm-up + cosine schedule.
  const std::vector<std::string> set = {
      "train.max_steps=8", "model.dropout=0.1", "train.gradient_accumulation_steps=2",
      "data.num_samples=24", "train.lr_scheduler_type=cosine", "train.warmup_steps=2"};
  Trainer::from_text(tiny_gpt_job(straight.str()), straight.path(), set)->run();
  {
    auto first = Trainer::from_text(tiny_gpt_job(split.str()), split.path(), set);
    first->setup();
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(first->step());
    first->save_checkpoint();
  }
  auto resume_set = set;
  resume_set.push_back("train.resume=latest");
  auto second = Trainer::from_text(tiny_gpt_job(split.str()), split.path(), resume_set);
  auto summary = second->run();
  EXPECT_EQ(summary.steps, 8);
  for (const char* file : {"model.safetensors", "optimizer-00000-of-00001.safetensors"}) {
    auto want = load_tensors(straight / "checkpoint-8" / file);
    auto got = load_tensors(split / "checkpoint-8" / file);
    ASSERT_EQ(want.size(), got.size()) << file;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(want[i].first, got[i].first);
      EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << file << " " << want[i].first;
    }
  }
  // The metrics of the resumed run continue the file of the first part.
  EXPECT_EQ(lines_of(split / "metrics.jsonl").size(), 8u);
}

TEST(Engine, LearningRateSchedulesFollowHuggingFace) {
  TempDir dir;
  auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                    {"train.max_steps=6", "train.warmup_steps=2",
                                     "train.lr_scheduler_type=linear", "train.learning_rate=1.0",
                                     "train.save_final=false"});
  std::vector<double> lrs;
  trainer->engine().on(Event::step_end, [&](Engine& e) { lrs.push_back(e.state().lr); });
  trainer->run();
  // warm-up 0, 1/2; then linear decay over the remaining 4 steps: 1, 3/4, 1/2, 1/4.
  const std::vector<double> expected = {0.0, 0.5, 1.0, 0.75, 0.5, 0.25};
  ASSERT_EQ(lrs.size(), expected.size());
  for (size_t i = 0; i < lrs.size(); ++i) EXPECT_DOUBLE_EQ(lrs[i], expected[i]) << i;
}

TEST(Engine, ClipsTheGlobalGradientNorm) {
  TempDir dir;
  auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                    {"train.max_steps=1", "train.max_grad_norm=0.01",
                                     "train.save_final=false"});
  double clipped_norm = -1;
  trainer->engine().on(Event::after_update, [&](Engine& e) {
    double sq = 0;
    for (const auto& p : e.params()) sq += p.tensor.grad().pow(2).sum().item<double>();
    clipped_norm = std::sqrt(sq);
  });
  trainer->run();
  EXPECT_GT(trainer->engine().state().grad_norm, 0.01);
  EXPECT_NEAR(clipped_norm, 0.01, 1e-5);
}

TEST(Engine, LossFallsOnLearnableData) {
  TempDir dir;
  auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                    {"train.max_steps=30", "data.num_samples=8",
                                     "train.save_final=false"});
  std::vector<double> losses;
  trainer->engine().on(Event::step_end, [&](Engine& e) { losses.push_back(e.state().loss); });
  trainer->run();
  // 8 random sequences can be memorised: the loss must drop well below log(64) = 4.16.
  EXPECT_GT(losses.front(), 3.9);
  EXPECT_LT(losses.back(), 3.0);
}

TEST(Engine, RefusesToOverwriteAnEarlierRun) {
  TempDir dir;
  Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=1"})->run();
  EXPECT_THROW_WITH(
      Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=1"}),
      ConfigError, "already holds checkpoints", "resume = \"latest\"");
  EXPECT_TRUE(std::filesystem::exists(dir / "checkpoint-1" / "manifest.json"));
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

TEST(Engine, ParamGroupsSetLearningRateAndWeightDecayByName) {
  TempDir dir;
  // The embeddings do not move (lr x 0); the blocks' weights decay hard; the rest train.
  auto trainer = Trainer::from_text(
      tiny_gpt_job(dir.str()) +
          "\n[optimizer]\nparam_groups = [{match = \"w[tp]e\\\\..*\", lr_scale = 0.0},\n"
          "  {match = \"h\\\\..*weight\", weight_decay = 0.5}, {match = \"h\\\\..*\", lr_scale = 9.0}]\n",
      dir.path(), {"train.max_steps=3", "train.save_final=false"});
  trainer->setup();
  std::map<std::string, at::Tensor> before;
  for (const auto& p : trainer->engine().params()) before[p.name] = p.tensor.detach().clone();
  for (const auto& p : trainer->engine().params()) {
    if (p.name.rfind("wte.", 0) == 0 || p.name.rfind("wpe.", 0) == 0) {
      EXPECT_EQ(p.lr_scale, 0.0) << p.name;
    } else if (p.name.rfind("h.", 0) == 0 && p.name.find("weight") != std::string::npos) {
      EXPECT_EQ(p.weight_decay, 0.5) << p.name;  // the first matching entry wins
      EXPECT_EQ(p.lr_scale, 1.0) << p.name;
    } else if (p.name.rfind("h.", 0) == 0) {
      EXPECT_EQ(p.lr_scale, 9.0) << p.name;
    }
  }
  while (trainer->step()) {
  }
  for (const auto& p : trainer->engine().params()) {
    const bool frozen_by_lr = p.name.rfind("wte.", 0) == 0 || p.name.rfind("wpe.", 0) == 0;
    EXPECT_EQ(at::equal(p.tensor, before[p.name]), frozen_by_lr) << p.name;
  }
}

TEST(Engine, BadParamGroupsAreNamedErrors) {
  TempDir dir;
  auto job = [&](const std::string& groups) {
    return Trainer::from_text(tiny_gpt_job(dir.str()) + "\n[optimizer]\nparam_groups = " + groups + "\n",
                              dir.path());
  };
  EXPECT_THROW_WITH(job("[{match = \"nothing.*\"}]")->setup(), ConfigError,
                    "param_groups[0] match \"nothing.*\" matches no trainable parameter");
  EXPECT_THROW_WITH(job("[{match = \"(\"}]")->setup(), ConfigError, "is not a valid regex");
  EXPECT_THROW_WITH(job("[{match = \"wte.*\", lr = 0.1}]")->setup(), ConfigError,
                    "unknown key 'lr' in [optimizer] param_groups[0]");
  EXPECT_THROW_WITH(job("[{match = \"wte.*\", lr_scale = -1}]")->setup(), ConfigError,
                    "lr_scale must be a number >= 0");
}

// A plugin in Slot::step_driver replaces the core's driver: the engine drives it once per step
// (zero_grad, norm, update), and a driver that delegates to the default trains bitwise alike.
TEST(Engine, APluginsStepDriverReplacesTheDefault) {
  TempDir plain_dir, counted_dir;
  const std::string plugins = "\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR "\"\n";
  auto plain = Trainer::from_text(tiny_gpt_job(plain_dir.str()), plain_dir.path());
  auto counted = Trainer::from_text(tiny_gpt_job(counted_dir.str()) + plugins +
                                        "\n[counting_driver]\n",
                                    counted_dir.path());
  const auto a = plain->run(), b = counted->run();
  EXPECT_EQ(a.final_loss, b.final_loss);
  const auto lines = lines_of(counted_dir / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string n = std::to_string(i + 1) + ".0";
    for (const char* key : {"driver_zero_grad", "driver_norms", "driver_updates"})
      EXPECT_NE(lines[i].find(std::string("\"") + key + "\":" + n), std::string::npos)
          << key << " at step " << i + 1 << ": " << lines[i];
  }
  const auto& p = plain->engine().params();
  const auto& q = counted->engine().params();
  ASSERT_EQ(p.size(), q.size());
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::equal(p[i].tensor, q[i].tensor)) << p[i].name;
}

// A grad_ready handler registered in params_ready fires like one registered in attach().
TEST(Engine, GradReadyHandlersRegisteredInParamsReadyFire) {
  TempDir dir;
  auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=2"});
  Engine& engine = trainer->engine();
  int64_t calls = 0;
  engine.on(Event::params_ready, [&](Engine& e) {
    e.on_grad_ready([&](Engine&, const Param&) { ++calls; });
  });
  trainer->run();
  EXPECT_EQ(calls, 2 * static_cast<int64_t>(engine.params().size()));
  EXPECT_THROW_WITH(engine.on_grad_ready([](Engine&, const Param&) {}), Error,
                    "on_grad_ready must be called during setup");
}

// mpirun and srun set no MASTER_ADDR: ranks on several hosts would each look for rank 0's
// store on their own loopback. The engine says what to set, before anything connects.
TEST(Engine, RanksOnSeveralHostsWithoutMasterAddrAreTold) {
  TempDir dir;
  const std::string job = test::tiny_gpt_job(dir.str()) +
                          "\n[distributed]\nbackend = \"gloo\"\ntimeout_seconds = 5\n";
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"})
    unsetenv(name);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  EXPECT_THROW_WITH(Trainer::from_text(job, dir.path())->setup(), ConfigError,
                    "4 ranks span several hosts (2 on this one)", "MASTER_ADDR is not set",
                    "mpirun -x MASTER_ADDR=");
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                           "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    unsetenv(name);
}

}  // namespace
}  // namespace loom
