// Tests of [optimizer] master_dtype = "bf16" (Note [bf16 weights as their own masters] in
// core/src/step_driver.cpp): each update is the fp32 update of the widened weights, rounded into
// bf16 with the random bits of the Note's formula (recomputed here from the formula, not from
// the core's code), bit for bit on every kernel path; the rounding is unbiased where nearest
// rounding would never move the weight; a run saves no masters, holds 4 B/param less, resumes
// bitwise, updates in backward as in the step, switches master_dtype at a resume; the update's
// fp32 copies stay bounded; bad jobs are refused by name.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cstdlib>
#include <cstring>
#include <map>

#include "bf16_rounding_reference.h"
#include "loom/config.h"
#include "loom/kernel_isa.h"
#include "loom/memory.h"
#include "loom/safetensors.h"
#include "loom/step_driver.h"
#include "loom/trainer.h"
#include "loom/update_rule.h"
#include "test_util.h"

namespace loom {
namespace {

using test::reference_rounding;
using test::TempDir;
using test::tiny_gpt_job;

std::unique_ptr<UpdateRule> adamw(const std::string& state_dtype = "fp32") {
  Schema schema("optimizer", "adamw");
  schema.key_float("beta1", 0.9, "").key_float("beta2", 0.999, "").key_float("eps", 1e-8, "");
  schema.key_string("state_dtype", "fp32", "");
  ConfigTable table;
  ConfigValue dtype;
  dtype.value = state_dtype;
  table.emplace_back("state_dtype", dtype);
  return make_adamw(ConfigSection("optimizer", table, schema, "test"));
}

std::vector<Param> params_of(const std::vector<at::Tensor>& tensors) {
  std::vector<Param> out;
  for (size_t k = 0; k < tensors.size(); ++k) {
    Param p;
    p.name = "layer." + std::to_string(k) + ".weight";
    p.tensor = tensors[k];
    out.push_back(p);
  }
  return out;
}

constexpr uint64_t kSeed = 4242;

// The core's adamw behind a rule of another type: the driver's generic path (the widened copy,
// the rule, the rounding pass), which every other rule takes, where adamw itself takes the
// fused one (takes_bf16_weights).
class Forwarding final : public UpdateRule {
 public:
  explicit Forwarding(std::unique_ptr<UpdateRule> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  NamedTensors init_state(const Segment& s) const override { return inner_->init_state(s); }
  void update(Segment& s, const UpdateContext& c) const override { inner_->update(s, c); }
  void update_many(const std::vector<Segment*>& s, const UpdateContext& c) const override {
    inner_->update_many(s, c);
  }
  void set_seed(uint64_t seed) override { inner_->set_seed(seed); }

 private:
  std::unique_ptr<UpdateRule> inner_;
};

// bf16 weights (and gradients) of three tensors after three updates without masters, on kernel
// path `isa`, the rule's moments in `state` dtype; `fused`: the core's adamw as it is (its one
// pass), else behind Forwarding (the generic path). With fp32 moments every result is also
// checked against the same rule run on fp32 copies of the widened weights, each step's result
// rounded by the tests' reference of the Note's formula.
std::vector<at::Tensor> run_updates(const char* isa, bool fused, const std::string& state) {
  at::manual_seed(3);
  const std::vector<int64_t> sizes = {1000, 37, 4099};
  std::vector<at::Tensor> weights, copies, grads;
  for (int64_t n : sizes) {
    weights.push_back((at::randn({n}) * 0.2).to(at::kBFloat16).requires_grad_(true));
    copies.push_back(weights.back().detach().to(at::kFloat).requires_grad_(true));
    for (int s = 0; s < 3; ++s) grads.push_back((at::randn({n}) * 0.05).to(at::kBFloat16));
  }
  const at::Tensor start = weights[0].detach().clone();
  setenv("LOOM_KERNEL_ISA", isa, 1);
  std::unique_ptr<UpdateRule> rule = adamw(state);
  if (!fused) rule = std::make_unique<Forwarding>(std::move(rule));
  rule->set_seed(kSeed);
  auto reference_rule = adamw();
  StepDriverOptions options;
  options.params = params_of(weights);
  options.rule = rule.get();
  options.weight_decay = 0.1;
  options.master_dtype = "bf16";
  options.seed = kSeed;
  auto driver = make_default_step_driver(options);
  StepDriverOptions reference = options;
  reference.params = params_of(copies);
  reference.rule = reference_rule.get();
  reference.master_dtype = "fp32";
  auto fp32_driver = make_default_step_driver(reference);
  EXPECT_EQ(driver->master_bytes(), 0);
  bool stochastic = false;
  for (int64_t step = 1; step <= 3; ++step) {
    for (size_t k = 0; k < weights.size(); ++k) {
      weights[k].mutable_grad() = grads[3 * k + step - 1];
      copies[k].mutable_grad() = grads[3 * k + step - 1].to(at::kFloat);
      at::NoGradGuard no_grad;
      copies[k].copy_(weights[k]);  // the widened weights, as the generic path's update sees them
    }
    driver->update(step, 1e-2);
    fp32_driver->update(step, 1e-2);
    if (state != "fp32") continue;
    for (size_t k = 0; k < weights.size(); ++k) {
      const std::string name = "layer." + std::to_string(k) + ".weight";
      const at::Tensor want = reference_rounding(copies[k].detach(), kSeed, name, step);
      EXPECT_TRUE(at::equal(weights[k].detach(), want))
          << isa << (fused ? " fused" : " generic") << " step " << step << " " << name;
      stochastic = stochastic || !at::equal(want, copies[k].detach().to(at::kBFloat16));
    }
  }
  unsetenv("LOOM_KERNEL_ISA");
  EXPECT_TRUE(stochastic || state != "fp32") << "all rounded to nearest: the test could not tell";
  EXPECT_FALSE(at::equal(weights[0].detach(), start));
  std::vector<at::Tensor> out;
  for (const auto& w : weights) out.push_back(w.detach());
  return out;
}

// The update is the fp32 update of the widened weights rounded by the Note's bits, bit for bit:
// the generic path and adamw's fused pass, on the scalar, AVX2 and AVX-512 kernel paths, with
// fp32 moments (against the reference) and bf16 moments (the two paths against each other).
TEST(Bf16Masters, StepIsTheFp32UpdateOfTheWeightsRoundedByTheNote) {
  for (const std::string state : {"fp32", "bf16"}) {
    const auto want = run_updates("scalar", /*fused=*/false, state);
    for (const char* isa : {"scalar", "avx2", "avx512"}) {
      const cpu::KernelIsa wanted = std::string(isa) == "scalar" ? cpu::KernelIsa::scalar
                                    : std::string(isa) == "avx2" ? cpu::KernelIsa::avx2
                                                                 : cpu::KernelIsa::avx512;
      if (cpu::cpu_kernel_isa() < wanted) {
        std::cout << "[ SKIPPED  ] " << isa << ": this CPU lacks it\n";
        continue;
      }
      for (const bool fused : {false, true}) {
        const auto got = run_updates(isa, fused, state);
        for (size_t k = 0; k < got.size(); ++k)
          EXPECT_TRUE(at::equal(got[k], want[k]))
              << state << " moments, " << isa << (fused ? " fused" : " generic") << ", tensor "
              << k;
      }
    }
  }
}

// Note [bf16 gradients read as they are] (core/src/adamw.cpp): full_bf16 with fp32 masters
// hands the core's adamw its bf16 gradients as they are; the weights, masters and moments after
// three updates are those of the generic path's widened copies (Forwarding), bit for bit, on
// every kernel path, with fp32 and bf16 moments, and the update makes no gradient copies.
TEST(Bf16Masters, AdamwReadsBf16GradientsWithTheWidenedCopysBits) {
  memory::install_cpu_tracker();
  for (const std::string state : {"fp32", "bf16"}) {
    auto run = [&state](const char* isa, bool generic, int64_t* copies) {
      at::manual_seed(5);
      std::vector<at::Tensor> weights, grads;
      for (int64_t n : {1000, 37, 4099}) {
        weights.push_back((at::randn({n}) * 0.2).to(at::kBFloat16).requires_grad_(true));
        for (int s = 0; s < 3; ++s) grads.push_back((at::randn({n}) * 0.05).to(at::kBFloat16));
      }
      setenv("LOOM_KERNEL_ISA", isa, 1);
      std::unique_ptr<UpdateRule> rule = adamw(state);
      if (generic) rule = std::make_unique<Forwarding>(std::move(rule));
      rule->set_seed(kSeed);
      StepDriverOptions options;
      options.params = params_of(weights);
      options.rule = rule.get();
      options.weight_decay = 0.1;
      auto driver = make_default_step_driver(options);
      EXPECT_EQ(driver->master_bytes(), 4 * (1000 + 37 + 4099));
      *copies = 0;
      for (int64_t step = 1; step <= 3; ++step) {
        for (size_t k = 0; k < weights.size(); ++k)
          weights[k].mutable_grad() = grads[3 * k + step - 1];
        const int64_t before = memory::cpu_stats().current_bytes;
        memory::reset_cpu_peak();
        driver->update(step, 1e-2);
        *copies = std::max(*copies, memory::cpu_stats().peak_bytes - before);
      }
      unsetenv("LOOM_KERNEL_ISA");
      std::vector<at::Tensor> out;
      for (const auto& w : weights) out.push_back(w.detach().clone());
      for (const auto& piece : driver->state_pieces()) out.push_back(piece.tensor.clone());
      return out;
    };
    int64_t copies = 0;
    const auto want = run("scalar", /*generic=*/true, &copies);
    EXPECT_GE(copies, 4 * 4099);  // the widened gradients: the tracker sees copies when made
    ASSERT_EQ(want.size(), 12u);  // weights; each tensor's exp_avg, exp_avg_sq and master
    for (const char* isa : {"scalar", "avx2", "avx512"}) {
      const cpu::KernelIsa wanted = std::string(isa) == "scalar" ? cpu::KernelIsa::scalar
                                    : std::string(isa) == "avx2" ? cpu::KernelIsa::avx2
                                                                 : cpu::KernelIsa::avx512;
      if (cpu::cpu_kernel_isa() < wanted) continue;
      const auto got = run(isa, /*generic=*/false, &copies);
      EXPECT_EQ(copies, 0) << state << " moments, " << isa;
      ASSERT_EQ(got.size(), want.size());
      for (size_t k = 0; k < got.size(); ++k)
        EXPECT_TRUE(at::equal(got[k], want[k])) << state << " moments, " << isa << ", tensor " << k;
    }
  }
}

// An update of a quarter of a bf16 ulp moves the weights on average by the update, where
// nearest rounding leaves every one where it was: 2^16 weights of 1.0 after one AdamW step of
// lr 0.001 (Adam's first step moves each by lr) hold 0.999 on average.
TEST(Bf16Masters, RoundingIsUnbiasedWhereNearestRoundingWouldNeverMove) {
  constexpr int64_t n = 1 << 16;
  at::Tensor weight = at::ones({n}, at::kBFloat16).requires_grad_(true);
  auto rule = adamw();
  StepDriverOptions options;
  options.params = params_of({weight});
  options.rule = rule.get();
  options.master_dtype = "bf16";
  options.seed = 11;
  auto driver = make_default_step_driver(options);
  weight.mutable_grad() = at::full({n}, 0.5, at::kBFloat16);
  driver->update(1, 1e-3);
  const float exact = 1.0f - 1e-3f;
  ASSERT_EQ(at::scalar_tensor(exact).to(at::kBFloat16).item<float>(), 1.0f)
      << "nearest rounding would keep 1.0";
  const at::Tensor values = weight.detach().to(at::kDouble);
  const double low = values.min().item<double>(), high = values.max().item<double>();
  EXPECT_EQ(high, 1.0);
  EXPECT_EQ(low, 1.0 - 1.0 / 256);  // the bf16 below 1
  const double up_share = (values == high).to(at::kDouble).mean().item<double>();
  const double want = (exact - low) / (high - low);  // 0.744
  EXPECT_NEAR(up_share, want, 0.012);                // six binomial errors
  EXPECT_NEAR(values.mean().item<double>(), exact, 0.012 / 256);
}

// The update's fp32 copies (widened half gradients, widened weights) are made a batch at a
// time, never for the whole model at once (Note [Update copies bounded]): 12 tensors of 4 M
// elements would need 192 MiB of gradient copies at once with masters, 384 MiB with the generic
// path's weight copies too; the update's peak above its start stays within the 128 MiB bound
// and one tensor's copies. adamw's fused pass makes none.
TEST(Bf16Masters, UpdateCopiesStayBounded) {
  memory::install_cpu_tracker();
  constexpr int64_t n = 4 << 20;
  auto peak_of_update = [&](const std::string& masters, bool fused) {
    std::vector<at::Tensor> weights;
    for (int k = 0; k < 12; ++k) {
      weights.push_back(at::zeros({n}, at::kBFloat16).requires_grad_(true));
      weights.back().mutable_grad() = at::full({n}, 0.25, at::kBFloat16);
    }
    std::unique_ptr<UpdateRule> rule = adamw("bf16");
    if (!fused) rule = std::make_unique<Forwarding>(std::move(rule));
    StepDriverOptions options;
    options.params = params_of(weights);
    options.rule = rule.get();
    options.master_dtype = masters;
    auto driver = make_default_step_driver(options);
    const int64_t before = memory::cpu_stats().current_bytes;
    memory::reset_cpu_peak();
    driver->update(1, 1e-3);
    const int64_t grown = memory::cpu_stats().peak_bytes - before;
    std::printf("masters %s, %s: the update's peak %.1f MiB above its start\n", masters.c_str(),
                fused ? "adamw itself" : "generic", grown / 1048576.0);
    EXPECT_NE(weights.back().detach()[0].item<float>(), 0.0f);
    return grown;
  };
  const int64_t bound = int64_t{128} << 20, slack = int64_t{4} << 20;
  const int64_t with_masters = peak_of_update("fp32", false);
  EXPECT_LE(with_masters, bound + 4 * n + slack);
  EXPECT_GT(with_masters, 4 * n);  // one tensor's gradient copy at least: the tracker sees them
  const int64_t generic = peak_of_update("bf16", false);
  EXPECT_LE(generic, bound + 8 * n + slack);
  EXPECT_GT(generic, 8 * n);
  EXPECT_LE(peak_of_update("bf16", true), slack);
}

std::map<std::string, at::Tensor> load(const std::filesystem::path& file) {
  auto tensors = safetensors::load(file).tensors;
  return {tensors.begin(), tensors.end()};
}

std::vector<std::string> full_bf16(const std::string& masters, std::vector<std::string> more = {}) {
  more.push_back("precision.mode=\"full_bf16\"");
  more.push_back("optimizer.master_dtype=\"" + masters + "\"");
  return more;
}

// No clipping, so that an update in backward (which refuses the global norm's clip) compares.
std::string job_with_precision(const std::string& dir) {
  std::string job = tiny_gpt_job(dir);
  job.replace(job.find("[train]\n"), 8, "[train]\nmax_grad_norm = 0.0\n");
  return job + "\n[precision]\nmode = \"fp32\"\n";
}

// A run keeps no masters (none in its checkpoint, none in its model state: 4 B per trainable
// parameter less for the tracker), and a resume from its step 2 ends bitwise where the run
// ended, with the same bits as an update in backward.
TEST(Bf16Masters, RunSavesNoMastersResumesBitwiseAndMatchesTheUpdateInBackward) {
  memory::install_cpu_tracker();
  TempDir whole, resumed, in_backward;
  auto setup_bytes = [](const std::string& masters, int64_t* trainable, int64_t* master_bytes) {
    TempDir dir;
    const int64_t before = memory::cpu_stats().current_bytes;
    auto trainer = Trainer::from_text(job_with_precision(dir.str()), dir.path(),
                                      full_bf16(masters, {"train.max_steps=1"}));
    trainer->setup();
    const int64_t grown = memory::cpu_stats().current_bytes - before;
    *trainable = trainer->engine().model_state().trainable_count;
    *master_bytes = trainer->engine().model_state().master_bytes;
    return grown;
  };
  int64_t trainable = 0, masters = 0;
  setup_bytes("fp32", &trainable, &masters);  // one-time allocations out of the way
  const int64_t with = setup_bytes("fp32", &trainable, &masters);
  EXPECT_EQ(masters, 4 * trainable);
  const int64_t without = setup_bytes("bf16", &trainable, &masters);
  EXPECT_EQ(masters, 0);
  EXPECT_EQ(with - without, 4 * trainable);

  Trainer::from_text(job_with_precision(whole.str()), whole.path(),
                     full_bf16("bf16", {"train.save_steps=2"}))
      ->run();
  for (const auto& [name, tensor] :
       load(whole / "checkpoint-2" / "optimizer-00000-of-00001.safetensors"))
    EXPECT_NE(name.rfind("master/", 0), 0u) << name;
  Trainer::from_text(
      job_with_precision(resumed.str()), resumed.path(),
      full_bf16("bf16", {"train.resume=\"" + (whole / "checkpoint-2").string() + "\""}))
      ->run();
  Trainer::from_text(job_with_precision(in_backward.str()), in_backward.path(),
                     full_bf16("bf16", {"train.optimizer_in_backward=true"}))
      ->run();
  const auto want = load(whole / "checkpoint-4" / "model.safetensors");
  const auto start = load(whole / "checkpoint-2" / "model.safetensors");
  for (const auto* dir : {&resumed, &in_backward}) {
    const auto got = load(*dir / "checkpoint-4" / "model.safetensors");
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, tensor] : want) {
      ASSERT_EQ(tensor.scalar_type(), at::kBFloat16) << name;
      EXPECT_TRUE(at::equal(got.at(name), tensor)) << dir->str() << ": " << name;
    }
  }
  EXPECT_FALSE(at::equal(start.at("wte.weight"), want.at("wte.weight")));
}

// master_dtype may change at a resume: a checkpoint with masters resumed without them drops
// them (said), one without them resumed with masters starts them from the weights (said); both
// go on training.
TEST(Bf16Masters, ResumeMaySwitchMasterDtype) {
  for (const auto& [saved, resumed] :
       std::vector<std::pair<std::string, std::string>>{{"fp32", "bf16"}, {"bf16", "fp32"}}) {
    TempDir first, second;
    Trainer::from_text(job_with_precision(first.str()), first.path(),
                       full_bf16(saved, {"train.max_steps=2"}))
        ->run();
    Trainer::from_text(
        job_with_precision(second.str()), second.path(),
        full_bf16(resumed, {"train.resume=\"" + (first / "checkpoint-2").string() + "\""}))
        ->run();
    const auto start = load(first / "checkpoint-2" / "model.safetensors");
    const auto end = load(second / "checkpoint-4" / "model.safetensors");
    EXPECT_FALSE(at::equal(start.at("wte.weight"), end.at("wte.weight")))
        << saved << " -> " << resumed;
    const auto state = load(second / "checkpoint-4" / "optimizer-00000-of-00001.safetensors");
    EXPECT_EQ(state.count("master/wte.weight"), resumed == "fp32" ? 1u : 0u)
        << saved << " -> " << resumed;
  }
}

// Refused by name before anything is written: an unknown dtype, weights that are not bf16, a
// plugin's driver that does not say it keeps none (when the job is read), one that keeps its
// own masters all the same (once made).
TEST(Bf16Masters, RefusedWhereItCannotApply) {
  TempDir dir;
  auto build = [&](const std::vector<std::string>& set) {
    return Trainer::from_text(job_with_precision(dir.str()), dir.path(), set)->run();
  };
  EXPECT_THROW_WITH(build({"optimizer.master_dtype=\"fp16\""}), ConfigError,
                    "[optimizer] master_dtype 'fp16' is unknown", "\"fp32\"", "\"bf16\"");
  EXPECT_THROW_WITH(build({"optimizer.master_dtype=\"bf16\""}), ConfigError,
                    "[precision] mode = \"fp32\" keeps fp32 weights", "mode = \"full_bf16\"");
  EXPECT_THROW_WITH(build({"precision.mode=\"full_fp16\"", "optimizer.master_dtype=\"bf16\""}),
                    ConfigError, "[precision] mode = \"full_fp16\" keeps fp16 weights");
  // Note [ZeRO without masters]: offload_param's shards are updated by the walk over the
  // offloaded state, which must be there; named before the run.
  const std::string swap = (dir.path() / "swap").string();
  const std::string nvme = "{ device = \"nvme\", nvme_path = \"" + swap + "\" }";
  const std::string zero = job_with_precision(dir.str()) + "\n[zero]\nstage = 3\n";
  EXPECT_THROW_WITH(
      Trainer::from_text(zero + "offload_param = " + nvme + "\n", dir.path(), full_bf16("bf16"))
          ->run(),
      ConfigError, "master_dtype = \"bf16\" keeps no fp32 masters", "offload_param",
      "offload_optimizer is not set");
  // A plugin's step driver that does not say it keeps none (Plugin::keeps_no_masters) is refused
  // when the job is read, as `loom check` reads it; one that says so and keeps masters all the
  // same is refused once made, naming it.
  const std::string counting = job_with_precision(dir.str()) + "\n[plugins]\npath = \"" +
                               LOOM_TEST_PLUGIN_DIR + "\"\n[counting_driver]\n";
  EXPECT_THROW_WITH(Trainer::from_text(counting + "says_no_masters = false\n", dir.path(),
                                       full_bf16("bf16")),
                    ConfigError, "master_dtype = \"bf16\" keeps no fp32 masters",
                    "[counting_driver] gives the job a step driver that does not say it can keep "
                    "none", "Plugin::keeps_no_masters");
  EXPECT_THROW_WITH(Trainer::from_text(counting + "keep_masters = true\n", dir.path(),
                                       full_bf16("bf16"))->run(),
                    ConfigError, "master_dtype = \"bf16\" keeps no fp32 masters",
                    "counting(default)", "[counting_driver]");
  EXPECT_TRUE(test::list_files(dir.path()).empty());
}

}  // namespace
}  // namespace loom
