// Tests of the `precision` plugin: the fp16 loss scaler against torch.amp.GradScaler, an injected
// overflow, the fallback from fp16 after an overflow storm, bf16 against fp32, bitwise fp16
// resume, pure-half weights, and the bad-input errors.
// Overflows are injected by an after_backward handler the test registers, not by a config key.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <ATen/cpu/Utils.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string_view>
#include <cstdio>
#include <optional>
#include <nlohmann/json.hpp>

#include "../../../plugins/precision/cpu_support.h"
#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::run_python;
using test::TempDir;

// The aten::_to_copy calls a RecordFunction callback has counted on this thread.
int* counter_of_this_thread() {
  static thread_local int count = 0;
  return &count;
}

std::string with_precision(const std::string& job, const std::string& precision) {
  return job + "\n[precision]\n" + precision + "\n";
}

// Writes +inf into one gradient element on the micro-batches of the given steps (0-based
// step index = state.step before the update), as an fp16 overflow in backward would.
void poison_steps(Engine& engine, std::vector<int64_t> steps) {
  engine.on(Event::after_backward, [steps](Engine& e) {
    if (std::find(steps.begin(), steps.end(), e.state().step) == steps.end()) return;
    at::NoGradGuard no_grad;
    e.params()[1].tensor.mutable_grad().view(-1)[3].fill_(INFINITY);
  });
}

std::vector<at::Tensor> snapshot(Engine& engine) {
  std::vector<at::Tensor> out;
  for (const auto& param : engine.params()) out.push_back(param.tensor.detach().clone());
  return out;
}

bool all_bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].scalar_type() != b[i].scalar_type() || !at::equal(a[i], b[i])) return false;
  return true;
}

std::vector<nlohmann::json> metrics(const std::filesystem::path& dir) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

// A small byte-level GPT on English text: its loss falls from 5.5, so "follows" means something.
std::string text_job(const std::string& output_dir, int steps) {
  return R"([train]
model = "gpt"
max_steps = )" + std::to_string(steps) + R"(
per_device_train_batch_size = 4
learning_rate = 2e-3
warmup_steps = 5
seed = 11
output_dir = ")" + output_dir + R"("
progress_bar = false
log_level = "warn"
save_final = false

[model]
vocab_size = 256
n_positions = 64
n_embd = 64
n_layer = 2
n_head = 4
dropout = 0.0

[data]
source = "text"
path = "/usr/share/games/fortunes/literature"
seq_len = 64
)";
}

// ---- the fp16 loss scaler ----

TEST(Precision, InjectedOverflowSkipsExactlyThatUpdateAndKeepsEveryParameter) {
  TempDir dir;
  auto trainer = Trainer::from_text(
      with_precision(test::tiny_gpt_job(dir.str()), "mode = \"fp16\""), dir.path());
  trainer->setup();
  Engine& engine = trainer->engine();
  EXPECT_EQ(engine.state().loss_scale, 65536.0);  // GradScaler's init_scale
  poison_steps(engine, {2});
  ASSERT_TRUE(trainer->step());
  ASSERT_TRUE(trainer->step());
  const auto before = snapshot(engine);
  ASSERT_TRUE(trainer->step());  // the poisoned one
  EXPECT_EQ(engine.state().step, 3);
  EXPECT_EQ(engine.state().skipped_updates, 1);
  EXPECT_FALSE(engine.state().grads_scaled);
  EXPECT_TRUE(all_bitwise_equal(before, snapshot(engine)))
      << "a skipped update changed a parameter";
  EXPECT_EQ(engine.state().loss_scale, 32768.0);  // backed off by 0.5
  ASSERT_TRUE(trainer->step());                   // clean again: this one updates
  EXPECT_FALSE(all_bitwise_equal(before, snapshot(engine)));
  EXPECT_EQ(engine.state().skipped_updates, 1);
  EXPECT_EQ(engine.state().loss_scale, 32768.0);

  const auto lines = metrics(dir.path());
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[1]["skipped_updates"], 0);
  EXPECT_EQ(lines[2]["skipped_updates"], 1);
  EXPECT_EQ(lines[2]["loss_scale"], 32768.0);
  EXPECT_EQ(lines[3]["skipped_updates"], 1);
}

// The scale's whole trajectory — growth after growth_interval clean steps, backoff and tracker
// reset on overflow — equals torch.amp.GradScaler's on the same overflow pattern.
TEST(Precision, ScaleGrowsAndBacksOffExactlyAsGradScaler) {
  const std::vector<int64_t> overflow_steps = {4, 5, 9};
  const int steps = 12;
  TempDir dir;
  std::string job = test::tiny_gpt_job(dir.str());
  job.replace(job.find("max_steps = 4"), 13, "max_steps = " + std::to_string(steps));
  auto trainer = Trainer::from_text(
      with_precision(job, "mode = \"fp16\"\ninit_scale = 1024\ngrowth_factor = 4.0\n"
                          "backoff_factor = 0.25\ngrowth_interval = 3"),
      dir.path());
  trainer->setup();
  poison_steps(trainer->engine(), overflow_steps);
  std::vector<double> loom_scales;
  while (trainer->step()) loom_scales.push_back(trainer->engine().state().loss_scale);

  std::string pattern;
  for (int64_t s : overflow_steps) pattern += std::to_string(s) + ",";
  const std::string out = run_python(R"(
import torch
p = torch.nn.Parameter(torch.ones(8))
opt = torch.optim.SGD([p], lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25,
                              growth_interval=3)
for step in range()" + std::to_string(steps) + R"():
    opt.zero_grad()
    scaler.scale((p * 0.5).sum()).backward()
    if step in ()" + pattern + R"():
        with torch.no_grad():
            p.grad[3] = float("inf")
    scaler.step(opt)
    scaler.update()
    print(repr(scaler.get_scale()))
)");
  std::istringstream lines(out);
  std::vector<double> torch_scales;
  for (double value; lines >> value;) torch_scales.push_back(value);
  ASSERT_EQ(torch_scales.size(), static_cast<size_t>(steps)) << out;
  EXPECT_EQ(loom_scales, torch_scales);
  EXPECT_EQ(trainer->engine().state().skipped_updates, 3);
}

// DeepSpeed's scaler knobs (a ds_config.json's fp16 section): `hysteresis` overflows skipped at
// one scale before it backs off, restored when the scale grows (or after every clean step with
// consecutive_hysteresis), and a floor. The trajectory equals DeepSpeed's DynamicLossScaler
// rule, written out in Python; an overflow at the floor is a divergence, named.
TEST(Precision, HysteresisAndTheFloorFollowDeepSpeedsScaler) {
  const std::vector<int64_t> overflow_steps = {1, 2, 3, 6, 8, 9, 10, 11};
  const int steps = 14;
  for (const bool consecutive : {false, true}) {
    SCOPED_TRACE(consecutive ? "consecutive_hysteresis" : "hysteresis");
    TempDir dir;
    std::string job = test::tiny_gpt_job(dir.str());
    job.replace(job.find("max_steps = 4"), 13, "max_steps = " + std::to_string(steps));
    auto trainer = Trainer::from_text(
        with_precision(job, std::string("mode = \"fp16\"\ninit_scale = 1024\ngrowth_interval = 2\n"
                                        "hysteresis = 2\nmin_scale = 256\nconsecutive_hysteresis = ") +
                                (consecutive ? "true" : "false")),
        dir.path());
    trainer->setup();
    poison_steps(trainer->engine(), overflow_steps);
    std::vector<double> loom_scales;
    std::string error;
    try {
      while (trainer->step()) loom_scales.push_back(trainer->engine().state().loss_scale);
    } catch (const Error& e) {
      error = e.what();
    }
    std::string pattern;
    for (int64_t s : overflow_steps) pattern += std::to_string(s) + ",";
    // DeepSpeed's rule: on overflow, back off (to the floor at least) only when the hysteresis
    // is spent, else spend one; on a clean step restore it (consecutive) and grow after
    // scale_window steps since the last overflow, restoring it then too. An overflow that
    // cannot back off (at the floor) ends the run.
    const std::string out = run_python(R"(
scale, window, floor, delayed, consecutive = 1024.0, 2, 256.0, 2, )" +
                                       std::string(consecutive ? "True" : "False") + R"(
left, last_overflow = delayed, -1
for it in range()" + std::to_string(steps) + R"():
    if it in ()" + pattern + R"():
        if left == 1:
            if scale <= floor:
                print('floor'); break
            scale = max(scale / 2, floor)
        else:
            left -= 1
        last_overflow = it
    else:
        if consecutive:
            left = delayed
        if (it - last_overflow) % window == 0:
            left = delayed
            scale *= 2
    print(repr(scale))
)");
    std::istringstream lines(out);
    std::vector<double> reference;
    bool floor_reached = false;
    for (std::string word; lines >> word;) {
      if (word == "floor") floor_reached = true;
      else reference.push_back(std::stod(word));
    }
    EXPECT_EQ(loom_scales, reference) << out;
    EXPECT_EQ(!error.empty(), floor_reached) << error;
    if (floor_reached)
      EXPECT_NE(error.find("inf/NaN at the loss scale's floor 256 ([precision] min_scale"),
                std::string::npos) << error;
  }
}

TEST(Precision, GradientsReachTheUpdateUnscaled) {
  // With clipping off and lr 0 nothing moves, so fp16 (scale 2^16) and fp32 see the same batch:
  // the grad norm the core reports must be the unscaled one.
  TempDir a, b;
  auto job = [](const std::string& dir) {
    std::string text = test::tiny_gpt_job(dir);
    return text.replace(text.find("learning_rate = 1e-2"), 20, "learning_rate = 0.0");
  };
  auto fp32 = Trainer::from_text(with_precision(job(a.str()), "mode = \"fp32\""), a.path());
  auto fp16 = Trainer::from_text(with_precision(job(b.str()), "mode = \"fp16\""), b.path());
  ASSERT_TRUE(fp32->step());
  ASSERT_TRUE(fp16->step());
  const double reference = fp32->engine().state().grad_norm;
  EXPECT_GT(reference, 0.0);
  EXPECT_NEAR(fp16->engine().state().grad_norm, reference, 0.02 * reference);
  EXPECT_EQ(fp16->engine().state().skipped_updates, 0);
}

TEST(Precision, Fp16ResumeContinuesBitwise) {
  // growth_interval 3 with an overflow at step index 1: the checkpoint at step 3 holds a growth
  // tracker of 1, so a resume that lost the tracker would grow the scale one step late.
  TempDir straight_dir, resumed_dir;
  auto job = [](const std::string& dir, int steps, const std::string& resume) {
    std::string text = test::tiny_gpt_job(dir);
    text.replace(text.find("max_steps = 4"), 13, "max_steps = " + std::to_string(steps));
    text.replace(text.find("[model]"), 7,
                 "save_steps = 3\nresume = \"" + resume + "\"\n\n[model]");
    return with_precision(text, "mode = \"fp16\"\ninit_scale = 256\ngrowth_interval = 3");
  };
  auto straight = Trainer::from_text(job(straight_dir.str(), 7, ""), straight_dir.path());
  straight->setup();
  poison_steps(straight->engine(), {1});
  straight->run();

  auto first = Trainer::from_text(job(resumed_dir.str(), 3, ""), resumed_dir.path());
  first->setup();
  poison_steps(first->engine(), {1});
  first->run();
  first.reset();
  auto second = Trainer::from_text(job(resumed_dir.str(), 7, "latest"), resumed_dir.path());
  second->setup();
  EXPECT_EQ(second->engine().state().step, 3);
  EXPECT_EQ(second->engine().state().loss_scale, 128.0);
  second->run();

  Engine& a = straight->engine();
  Engine& b = second->engine();
  EXPECT_TRUE(all_bitwise_equal(snapshot(a), snapshot(b)));
  EXPECT_EQ(a.state().loss_scale, b.state().loss_scale);
  EXPECT_EQ(a.state().loss_scale, 256.0);  // 256 -> 128 (overflow) -> 256 after 3 clean steps
  EXPECT_EQ(a.state().skipped_updates, 1);
  EXPECT_EQ(b.state().skipped_updates, 1);
  const auto la = metrics(straight_dir.path()), lb = metrics(resumed_dir.path());
  ASSERT_EQ(la.size(), 7u);
  ASSERT_EQ(lb.size(), 7u);
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_EQ(la[i]["loss"], lb[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(la[i]["loss_scale"], lb[i]["loss_scale"]) << "step " << i + 1;
  }
}

// ---- falling back from fp16 (Note [Falling back from fp16]) ----

// An overflow storm only fp16 suffers (weights or activations beyond 65504): +inf in one
// gradient element on every step from `from` (0-based) for as long as the loss is scaled, i.e.
// while the run is in fp16 (the scaler never reaches 1 in these jobs).
void poison_while_fp16(Engine& engine, int64_t from) {
  engine.on(Event::after_backward, [from](Engine& e) {
    if (e.state().step < from || e.state().loss_scale == 1.0) return;
    at::NoGradGuard no_grad;
    e.params()[1].tensor.mutable_grad().view(-1)[3].fill_(INFINITY);
  });
}

// Records the autocast dtype each training forward runs under ("fp32" without autocast). The
// precision plugin runs first in before_forward, so this handler sees what it set.
void record_forward_dtype(Engine& engine, std::vector<std::string>& dtypes) {
  engine.on(Event::before_forward, [&dtypes](Engine&) {
    dtypes.push_back(at::autocast::is_autocast_enabled(at::kCPU)
                         ? c10::toString(at::autocast::get_autocast_dtype(at::kCPU))
                         : "fp32");
  });
}

bool all_finite(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (!at::isfinite(t).all().item<bool>()) return false;
  return true;
}

// fp16 over a scale floor: 1024 -> 512 -> 256, then an overflow at 256 (step 5) is the floor.
std::string storm_job(const std::string& dir, int steps, const std::string& precision,
                      const std::string& resume = "") {
  std::string job = test::tiny_gpt_job(dir);
  job.replace(job.find("max_steps = 4"), 13, "max_steps = " + std::to_string(steps));
  if (!resume.empty())
    job.replace(job.find("[model]"), 7, "resume = \"" + resume + "\"\n\n[model]");
  return with_precision(job, "mode = \"fp16\"\ninit_scale = 1024\nmin_scale = 256\n" + precision);
}

// What fallback_mode = "auto" picks on this machine.
std::string auto_fallback_mode() {
  return precision::cpu_half_gap(at::kBFloat16, at::cpu::get_cpu_capabilities()).empty()
             ? "bf16"
             : "fp32";
}

// The storm that ends an fp16 run at the scale's floor today: with on_overflow = "fallback" the
// run switches at that step (5) to the mode fallback_mode = "auto" picks on this CPU, from the
// weights of step 2 (the last clean update) bit for bit, says so once in a warning, marks the
// step in metrics.jsonl and the switch in the checkpoint (read back by Python), and trains on
// with finite weights. Resumed from a checkpoint written after the switch, with the same job
// (still mode = "fp16"), the run continues in the fallback mode and ends bitwise where the
// straight run ends; in fp16 it would have met the storm again.
TEST(Precision, OverflowStormAtTheFloorFallsBackAndAResumeStaysFallenBack) {
  const std::string target = auto_fallback_mode();
  const std::string target_dtype = target == "bf16" ? "BFloat16" : "fp32";
  TempDir straight_dir, resumed_dir;
  auto straight = Trainer::from_text(
      storm_job(straight_dir.str(), 8, "on_overflow = \"fallback\""), straight_dir.path(),
      {"train.log_level=info"});
  straight->setup();
  Engine& engine = straight->engine();
  poison_while_fp16(engine, 2);
  std::vector<std::string> dtypes;
  record_forward_dtype(engine, dtypes);
  testing::internal::CaptureStderr();
  ASSERT_TRUE(straight->step());
  ASSERT_TRUE(straight->step());
  const auto last_clean = snapshot(engine);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(straight->step());  // steps 3, 4: backoff; 5: floor
  const auto at_switch = snapshot(engine);
  EXPECT_EQ(engine.state().loss_scale, 1.0);
  EXPECT_EQ(engine.state().skipped_updates, 3);
  EXPECT_TRUE(all_bitwise_equal(last_clean, at_switch))
      << "the fallback did not go on from the last clean update's weights";
  straight->run();
  const std::string log = testing::internal::GetCapturedStderr();
  const auto trained = snapshot(engine);
  EXPECT_EQ(engine.state().step, 8);
  EXPECT_EQ(engine.state().skipped_updates, 3);
  EXPECT_TRUE(all_finite(trained));
  EXPECT_FALSE(all_bitwise_equal(at_switch, trained)) << "nothing trained after the switch";

  const std::vector<std::string> expected_dtypes = {"Half", "Half", "Half", "Half", "Half",
                                                    target_dtype, target_dtype, target_dtype};
  EXPECT_EQ(dtypes, expected_dtypes);
  const std::string warning =
      "[precision] step 5: fp16 overflowed at the loss scale's floor 256 ([precision] "
      "min_scale) (loss ";
  const size_t first = log.find(warning);
  ASSERT_NE(first, std::string::npos) << log;
  EXPECT_EQ(log.find("[precision] step", first + 1), std::string::npos) << "warned twice: " << log;
  EXPECT_NE(log.find("switching from fp16 to " +
                         std::string(target == "bf16" ? "bf16 autocast" : "fp32") +
                         " for the rest of the run (",
                     first),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("from the weights and optimizer state of step 2, the last clean update",
                     first),
            std::string::npos)
      << log;

  // Python reads what the run wrote: the metrics line of the switch, and the final checkpoint.
  const std::string read = R"(
import json
lines = [json.loads(l) for l in open(d + "/metrics.jsonl")]
print([l["step"] for l in lines if l.get("precision_fallback_to_)" + target + R"(") == 1])
print([l["loss_scale"] for l in lines])
print(sum(1 for l in lines for k in l if k.startswith("precision_fallback")))
values = json.load(open(d + "/checkpoint-8/manifest.json"))["values"]
print(*(values["precision." + k] for k in ("mode", "fallback_from", "fallback_step")))
print("precision.growth_tracker" in values)
)";
  EXPECT_EQ(run_python("d = '" + straight_dir.str() + "'\n" + read),
            "[5]\n[1024.0, 1024.0, 512.0, 256.0, 1.0, 1.0, 1.0, 1.0]\n1\n" + target +
                " fp16 5\nFalse\n");

  // Resume from step 6, after the switch.
  auto first_part = Trainer::from_text(
      storm_job(resumed_dir.str(), 6, "on_overflow = \"fallback\""), resumed_dir.path());
  first_part->setup();
  poison_while_fp16(first_part->engine(), 2);
  first_part->run();
  first_part.reset();
  auto second = Trainer::from_text(
      storm_job(resumed_dir.str(), 8, "on_overflow = \"fallback\"", "latest"),
      resumed_dir.path(), {"train.log_level=info"});
  testing::internal::CaptureStderr();
  second->setup();
  EXPECT_EQ(second->engine().state().step, 6);
  EXPECT_EQ(second->engine().state().loss_scale, 1.0);
  poison_while_fp16(second->engine(), 2);
  std::vector<std::string> resumed_dtypes;
  record_forward_dtype(second->engine(), resumed_dtypes);
  second->run();
  const std::string resumed_log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(resumed_dtypes, std::vector<std::string>(2, target_dtype));
  EXPECT_NE(resumed_log.find("[precision] the checkpoint's run fell back from fp16 to " + target +
                             " at step 5 ([precision] on_overflow = \"fallback\"); continuing in " +
                             target),
            std::string::npos)
      << resumed_log;
  EXPECT_EQ(resumed_log.find("the checkpoint was trained with mode"), std::string::npos)
      << resumed_log;
  EXPECT_EQ(second->engine().state().skipped_updates, 3);
  EXPECT_TRUE(all_bitwise_equal(snapshot(second->engine()), trained));
  const auto la = metrics(straight_dir.path()), lb = metrics(resumed_dir.path());
  ASSERT_EQ(lb.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(la[i]["loss"], lb[i]["loss"]) << "step " << i + 1;
  EXPECT_EQ(run_python("import json\nd = '" + resumed_dir.str() + R"('
values = json.load(open(d + "/checkpoint-8/manifest.json"))["values"]
print(*(values["precision." + k] for k in ("mode", "fallback_from", "fallback_step")))
)"),
            target + " fp16 5\n");
}

// fallback_after overflowing steps in a row switch the run before any floor. The run that falls
// back to bf16 at step 5 ends bitwise where an independent route ends: an fp16 run that skips
// the same three updates and saves at step 5, resumed with mode = "bf16".
TEST(Precision, FallbackAfterAStreakEqualsAResumeInTheNewMode) {
  TempDir fallen_dir, reference_dir;
  auto job = [](const std::string& dir, int steps, const std::string& precision,
                const std::string& resume) {
    std::string text = test::tiny_gpt_job(dir);
    text.replace(text.find("max_steps = 4"), 13, "max_steps = " + std::to_string(steps));
    if (!resume.empty())
      text.replace(text.find("[model]"), 7, "resume = \"" + resume + "\"\n\n[model]");
    return with_precision(text, precision);
  };
  auto fallen = Trainer::from_text(
      job(fallen_dir.str(), 8,
          "mode = \"fp16\"\non_overflow = \"fallback\"\nfallback_after = 3\n"
          "fallback_mode = \"bf16\"",
          ""),
      fallen_dir.path());
  fallen->setup();
  poison_steps(fallen->engine(), {2, 3, 4});
  std::vector<std::string> dtypes;
  record_forward_dtype(fallen->engine(), dtypes);
  testing::internal::CaptureStderr();
  fallen->run();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("[precision] step 5: fp16 overflowed on 3 steps in a row ([precision] "
                     "fallback_after = 3)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("switching from fp16 to bf16 autocast for the rest of the run ([precision] "
                     "fallback_mode = \"bf16\""),
            std::string::npos)
      << log;
  const std::vector<std::string> expected = {"Half", "Half", "Half", "Half", "Half",
                                             "BFloat16", "BFloat16", "BFloat16"};
  EXPECT_EQ(dtypes, expected);

  auto fp16_part = Trainer::from_text(job(reference_dir.str(), 5, "mode = \"fp16\"", ""),
                                      reference_dir.path());
  fp16_part->setup();
  poison_steps(fp16_part->engine(), {2, 3, 4});
  fp16_part->run();
  EXPECT_EQ(fp16_part->engine().state().skipped_updates, 3);
  fp16_part.reset();
  auto bf16_part = Trainer::from_text(job(reference_dir.str(), 8, "mode = \"bf16\"", "latest"),
                                      reference_dir.path());
  bf16_part->run();

  EXPECT_TRUE(all_finite(snapshot(fallen->engine())));
  EXPECT_TRUE(all_bitwise_equal(snapshot(fallen->engine()), snapshot(bf16_part->engine())));
  const auto la = metrics(fallen_dir.path()), lb = metrics(reference_dir.path());
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(la[i]["loss"], lb[i]["loss"]) << "step " << i + 1;
  EXPECT_EQ(la[4]["precision_fallback_to_bf16"], 1);
  EXPECT_FALSE(la[3].contains("precision_fallback_to_bf16"));
  EXPECT_FALSE(la[5].contains("precision_fallback_to_bf16"));
}

// The default (on_overflow = "error"): the same storm ends the run at the floor, named, as
// before the fallback existed.
TEST(Precision, OverflowStormAtTheFloorIsStillANamedErrorByDefault) {
  for (const std::string policy : {"", "on_overflow = \"error\""}) {
    SCOPED_TRACE(policy.empty() ? "default" : policy);
    TempDir dir;
    auto trainer = Trainer::from_text(storm_job(dir.str(), 8, policy), dir.path());
    trainer->setup();
    poison_while_fp16(trainer->engine(), 2);
    EXPECT_THROW_WITH(trainer->run(), Error, "step 5: the gradients are inf/NaN at the loss "
                      "scale's floor 256 ([precision] min_scale");
    EXPECT_EQ(trainer->engine().state().step, 4);
    EXPECT_EQ(trainer->engine().state().loss_scale, 256.0);
  }
}

// A real fp16 overflow, not an injected one: after step 2 the embedding (tied to the LM head)
// is scaled past fp16's 65504, so under fp16 autocast the head's weight casts to inf and the loss
// is NaN at every loss scale. The run falls back to fp32 after 3 such steps and trains on with a
// finite loss (fp32 holds those weights), where fp16 could only skip.
TEST(Precision, WeightsBeyondFp16sRangeFallBackAndTrainOnWithAFiniteLoss) {
  TempDir dir;
  std::string job = test::tiny_gpt_job(dir.str());
  job.replace(job.find("max_steps = 4"), 13, "max_steps = 8");
  auto trainer = Trainer::from_text(
      with_precision(job, "mode = \"fp16\"\non_overflow = \"fallback\"\nfallback_after = 3\n"
                          "fallback_mode = \"fp32\""),
      dir.path());
  trainer->setup();
  trainer->engine().on(Event::step_end, [](Engine& e) {
    if (e.state().step != 2) return;
    at::NoGradGuard no_grad;
    at::Tensor wte = e.model().named_parameters()["wte.weight"];
    wte.mul_(1e7);
    ASSERT_GT(wte.abs().max().item<float>(), 65504.0f);
  });
  trainer->run();
  EXPECT_EQ(trainer->engine().state().skipped_updates, 3);
  EXPECT_TRUE(all_finite(snapshot(trainer->engine())));
  const auto lines = metrics(dir.path());
  ASSERT_EQ(lines.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    const bool fp16_overflow = i >= 2 && i <= 4;
    // nlohmann writes a NaN loss as null.
    EXPECT_EQ(lines[i]["loss"].is_number(), !fp16_overflow) << lines[i].dump();
    EXPECT_EQ(lines[i].contains("precision_fallback_to_fp32"), i == 4);
  }
}

TEST(Precision, BadFallbackValuesAreErrorsNamingTheKey) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"mode = \"fp16\"\non_overflow = \"retry\"",
       {"[precision] on_overflow 'retry' is unknown (use \"error\" or \"fallback\")"}},
      {"mode = \"fp16\"\non_overflow = \"fallback\"\nfallback_after = 0",
       {"[precision] fallback_after must be > 0 (overflowing steps in a row), got 0"}},
      {"mode = \"fp16\"\non_overflow = \"fallback\"\nfallback_after = -3",
       {"[precision] fallback_after must be > 0 (overflowing steps in a row), got -3"}},
      {"mode = \"fp16\"\non_overflow = \"fallback\"\nfallback_mode = \"fp16\"",
       {"[precision] fallback_mode 'fp16' is unknown (use \"auto\", \"bf16\" or \"fp32\")"}},
      {"mode = \"fp16\"\nfallback_after = 5",
       {"[precision] fallback_after applies only with on_overflow = \"fallback\", but "
        "on_overflow is \"error\""}},
      {"mode = \"bf16\"\non_overflow = \"fallback\"",
       {"[precision] on_overflow sets the fp16 loss scaler, but mode is 'bf16'"}},
      {"mode = \"full_fp16\"\non_overflow = \"fallback\"",
       {"[precision] on_overflow = \"fallback\" needs mode = \"fp16\"", "use mode = \"fp16\""}}};
  for (const auto& [lines, messages] : cases) {
    SCOPED_TRACE(lines);
    TempDir dir;
    auto build = [&] {
      return Trainer::from_text(with_precision(test::tiny_gpt_job(dir.str()), lines), dir.path());
    };
    std::vector<std::string> parts = {"job.toml:"};
    parts.insert(parts.end(), messages.begin(), messages.end());
    try {
      build();
      ADD_FAILURE() << "no ConfigError";
    } catch (const ConfigError& error) {
      const std::string message = error.what();
      for (const auto& part : parts)
        EXPECT_NE(message.find(part), std::string::npos) << message;
    }
  }
}

// ---- autocast and pure-half modes ----

TEST(Precision, Bf16AndFullBf16FollowTheFp32Loss) {
  // Stated tolerance: at every one of 20 steps the bf16 (autocast) and full_bf16 (pure bf16
  // weights and compute) losses are within 1% of the fp32 run's, while all three fall by more
  // than 1.0 from 5.5. (Measured: within 0.03%; the loss is a mean over 256 tokens, which
  // averages bf16's 2^-9 rounding away.)
  const int steps = 20;
  TempDir a, b, c;
  auto fp32 = Trainer::from_text(with_precision(text_job(a.str(), steps), "mode = \"fp32\""),
                                 a.path());
  // The unfused loss, so the forward's output carries the logits whose dtype is checked.
  auto bf16 = Trainer::from_text(with_precision(text_job(b.str(), steps), "mode = \"bf16\""),
                                 b.path(), {"model.fused_cross_entropy=false"});
  auto full = Trainer::from_text(with_precision(text_job(c.str(), steps), "mode = \"full_bf16\""),
                                 c.path());
  bf16->setup();
  at::ScalarType logits_dtype = at::kFloat;
  bf16->engine().on(Event::after_forward,
                    [&](Engine& e) { logits_dtype = e.output().logits.scalar_type(); });
  full->setup();
  const auto state = full->engine().model_state();
  EXPECT_EQ(state.param_bytes, 2 * state.param_count);
  EXPECT_EQ(state.master_bytes, 4 * state.trainable_count);
  EXPECT_EQ(state.grad_bytes, 2 * state.trainable_count);

  fp32->run();
  bf16->run();
  full->run();
  EXPECT_EQ(logits_dtype, at::kBFloat16) << "autocast did not run the model in bf16";
  for (const auto& param : bf16->engine().params())
    EXPECT_EQ(param.tensor.scalar_type(), at::kFloat) << param.name;  // autocast: fp32 weights
  for (const auto& param : full->engine().params())
    EXPECT_EQ(param.tensor.scalar_type(), at::kBFloat16) << param.name;

  const auto reference = metrics(a.path());
  ASSERT_EQ(reference.size(), static_cast<size_t>(steps));
  for (const auto* dir : {&b, &c}) {
    const auto lines = metrics(dir->path());
    ASSERT_EQ(lines.size(), static_cast<size_t>(steps));
    double largest = 0.0;
    for (int i = 0; i < steps; ++i) {
      const double x = reference[i]["loss"], y = lines[i]["loss"];
      largest = std::max(largest, std::abs(x - y) / x);
      EXPECT_NEAR(y, x, 0.01 * x) << "step " << i + 1;
    }
    EXPECT_GT(largest, 0.0) << "bf16 and fp32 agree bitwise: bf16 did not run";
    EXPECT_GT(lines.front()["loss"].get<double>() - lines.back()["loss"].get<double>(), 1.0);
  }
  EXPECT_GT(reference.front()["loss"].get<double>() - reference.back()["loss"].get<double>(), 1.0);
}

// Note [Cast once per update]: with accumulation, the first micro-batch's forward casts the
// fp32 weights to bf16 and the others reuse those copies (fewer casts, counted by a
// RecordFunction callback on aten::_to_copy), with cast_cache = "forward" every micro-batch
// casts again as PyTorch's autocast does; the weights come out bitwise the same either way.
TEST(Precision, AutocastCastsTheWeightsOncePerUpdate) {
  std::map<std::string, std::vector<int>> casts;
  std::map<std::string, std::vector<at::Tensor>> weights;
  for (const std::string cache : {"step", "forward"}) {
    SCOPED_TRACE(cache);
    TempDir dir;
    auto trainer = Trainer::from_text(
        with_precision(text_job(dir.str(), 2), "mode = \"bf16\"\ncast_cache = \"" + cache + "\""),
        dir.path(), {"train.gradient_accumulation_steps=4", "train.per_device_train_batch_size=1"});
    trainer->setup();
    auto counter = at::addThreadLocalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (std::string_view(fn.name()) == "aten::_to_copy") ++*counter_of_this_thread();
              return nullptr;
            })
            .scopes({at::RecordScope::FUNCTION}));
    *counter_of_this_thread() = 0;
    trainer->engine().on(Event::before_forward, [](Engine&) { *counter_of_this_thread() = 0; });
    trainer->engine().on(Event::after_forward, [&](Engine&) {
      casts[cache].push_back(*counter_of_this_thread());
    });
    trainer->run();
    at::removeCallback(counter);
    weights[cache] = snapshot(trainer->engine());
  }
  const auto& step = casts["step"];
  const auto& forward = casts["forward"];
  ASSERT_EQ(step.size(), 8u);  // 2 steps x 4 micro-batches
  ASSERT_EQ(forward.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(forward[i], forward[0]) << "micro-batch " << i;
    if (i % 4 == 0) EXPECT_EQ(step[i], forward[0]) << "a step's first forward casts as always";
    else EXPECT_LT(step[i], step[i / 4 * 4]) << "micro-batch " << i << " cast the weights again";
  }
  EXPECT_TRUE(all_bitwise_equal(weights["step"], weights["forward"]));
}

// Note [Frozen weights in half]: LoRA on every Linear ("all-linear") leaves the base Linears'
// weights and biases frozen. Under bf16 autocast they are held in bf16 (the autocast dtype),
// which must train bit for bit as when they are held in fp32 and cast at each forward: gpt with
// activation checkpointing (the recompute casts again) and its tied head (an Embedding's
// weight: stays fp32), and llama with an untied lm_head (a frozen Linear the fused loss reads
// without calling the Linear).
std::string lora_everywhere(const std::string& dir, bool llama) {
  std::string job = test::tiny_gpt_job(dir);
  if (llama) {
    job.replace(job.find("model = \"gpt\""), 13, "model = \"llama\"");
    const auto from = job.find("[model]"), to = job.find("[data]");
    job.replace(from, to - from,
                "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 48\n"
                "num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
                "max_position_embeddings = 16\ntie_word_embeddings = false\n\n");
  } else {
    job += "\n[checkpointing]\nevery = 1\n";
  }
  return job + "\n[lora]\nr = 4\ntarget_modules = \"all-linear\"\ninit_lora_weights = false\n";
}

TEST(Precision, FrozenLinearWeightsHeldInHalfTrainBitwiseLikeFp32) {
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama, untied lm_head" : "gpt, checkpointed, tied head");
    std::map<std::string, std::vector<at::Tensor>> trained;
    std::map<std::string, std::vector<nlohmann::json>> lines;
    std::map<std::string, int64_t> param_bytes;
    int64_t halved_elements = 0;
    for (const std::string frozen : {"half", "fp32"}) {
      TempDir dir;
      auto trainer = Trainer::from_text(
          with_precision(lora_everywhere(dir.str(), llama),
                         "mode = \"bf16\"\nfrozen_weights = \"" + frozen + "\""),
          dir.path(), {"train.gradient_accumulation_steps=2"});
      trainer->setup();
      Engine& e = trainer->engine();
      int64_t bf16_tensors = 0;
      for (const auto& p : e.model().named_parameters(true)) {
        const bool base_linear = !p.value().requires_grad() &&
                                 p.key().find("embed") == std::string::npos &&
                                 p.key().find("wte") == std::string::npos &&
                                 p.key().find("wpe") == std::string::npos &&
                                 p.key().find("ln") == std::string::npos &&
                                 p.key().find("norm") == std::string::npos;
        const auto want = frozen == "half" && base_linear ? at::kBFloat16 : at::kFloat;
        EXPECT_EQ(p.value().scalar_type(), want) << p.key();
        if (p.value().scalar_type() == at::kBFloat16) {
          ++bf16_tensors;
          halved_elements += p.value().numel();
        }
      }
      // gpt: 2 blocks x (qkv, proj, fc_in, fc_out) x (weight, bias); llama: 2 x 7 + lm_head.
      if (frozen == "half") EXPECT_EQ(bf16_tensors, llama ? 15 : 16);
      param_bytes[frozen] = e.model_state().param_bytes;
      trainer->run();
      trained[frozen] = snapshot(e);
      lines[frozen] = metrics(dir.path());
    }
    EXPECT_EQ(param_bytes["fp32"] - param_bytes["half"], 2 * halved_elements);
    EXPECT_TRUE(all_bitwise_equal(trained["half"], trained["fp32"]));
    ASSERT_EQ(lines["half"].size(), 4u);
    ASSERT_EQ(lines["fp32"].size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(lines["half"][i]["loss"], lines["fp32"][i]["loss"]);
  }
}

// A checkpoint written with the frozen weights in one dtype resumes in the other (they are not
// trained: the dtype check of a trainable weight does not apply), bit for bit.
TEST(Precision, FrozenWeightsResumeAcrossHalfAndFp32Checkpoints) {
  auto job = [](const TempDir& dir, const std::string& frozen, int steps, bool resume) {
    std::string text = lora_everywhere(dir.str(), /*llama=*/false);
    text.replace(text.find("max_steps = 4"), 13, "max_steps = " + std::to_string(steps));
    if (resume) text.replace(text.find("[model]"), 7, "resume = \"latest\"\n\n[model]");
    return Trainer::from_text(
        with_precision(text, "mode = \"bf16\"\nfrozen_weights = \"" + frozen + "\""), dir.path());
  };
  TempDir straight_dir;
  auto straight = job(straight_dir, "half", 4, false);
  straight->run();
  const auto expected = snapshot(straight->engine());
  for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
           {"fp32", "half"}, {"half", "fp32"}}) {
    SCOPED_TRACE(first + " checkpoint, resumed with " + second);
    TempDir dir;
    job(dir, first, 2, false)->run();
    auto resumed = job(dir, second, 4, true);
    resumed->setup();
    EXPECT_EQ(resumed->engine().state().step, 2);
    resumed->run();
    EXPECT_TRUE(all_bitwise_equal(snapshot(resumed->engine()), expected));
  }
}

// Note [Falling back from fp16]: LoRA's frozen base Linears, held in fp16 under fp16 autocast,
// follow the run into its fallback mode (an fp32 forward cannot multiply by an fp16 weight), and
// the run trains on.
TEST(Precision, FallbackCastsFrozenHalfWeightsToTheNewMode) {
  for (const std::string target : {"fp32", "bf16"}) {
    SCOPED_TRACE(target);
    TempDir dir;
    std::string job = lora_everywhere(dir.str(), /*llama=*/false);
    job.replace(job.find("max_steps = 4"), 13, "max_steps = 6");
    auto trainer = Trainer::from_text(
        with_precision(job, "mode = \"fp16\"\ninit_scale = 1024\nmin_scale = 256\n"
                            "on_overflow = \"fallback\"\nfallback_mode = \"" + target + "\""),
        dir.path());
    trainer->setup();
    Engine& e = trainer->engine();
    poison_while_fp16(e, 2);
    std::map<std::string, at::Tensor> frozen;
    for (const auto& p : e.model().named_parameters(true))
      if (p.value().scalar_type() == at::kHalf) frozen[p.key()] = p.value();
    ASSERT_EQ(frozen.size(), 16u);  // 2 blocks x (qkv, proj, fc_in, fc_out) x (weight, bias)
    const auto before = snapshot(e);
    trainer->run();
    EXPECT_EQ(e.state().step, 6);
    EXPECT_EQ(e.state().skipped_updates, 3);
    for (const auto& [name, tensor] : frozen)
      EXPECT_EQ(tensor.scalar_type(), target == "fp32" ? at::kFloat : at::kBFloat16) << name;
    const auto after = snapshot(e);
    EXPECT_TRUE(all_finite(after));
    EXPECT_FALSE(all_bitwise_equal(before, after));
    EXPECT_EQ(metrics(dir.path())[4]["precision_fallback_to_" + target], 1);
  }
}

TEST(Precision, UnknownFrozenWeightsIsAnErrorNamingTheKey) {
  TempDir dir;
  auto build = [&] { return Trainer::from_text(
      with_precision(test::tiny_gpt_job(dir.str()), "mode = \"bf16\"\nfrozen_weights = \"bf16\""),
      dir.path()); };
  EXPECT_THROW_WITH(build(), ConfigError, "job.toml:",
                    "[precision] frozen_weights must be \"half\" or \"fp32\", got \"bf16\"");
}

TEST(Precision, AnatomyReportShowsHalfCopiesOfTheWeights) {
  TempDir dir;
  std::string job = test::tiny_gpt_job(dir.str());
  job.replace(job.find("log_level = \"warn\""), 18, "log_level = \"info\"");
  auto trainer = Trainer::from_text(with_precision(job, "mode = \"bf16\""), dir.path());
  testing::internal::CaptureStderr();
  trainer->setup();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("precision bf16: per trainable parameter 4 B fp32 weights + 2 B BFloat16 "
                     "copies made by autocast for forward/backward + 4 B fp32 grads + 8 B "
                     "optimizer state = 18 B"),
            std::string::npos)
      << log;
}

// The run's header names every scaler key and on_overflow with the values the run uses, the
// defaults of the keys a job leaves out included.
TEST(Precision, HeaderNamesEveryScalerKeyAndWhatAnOverflowDoes) {
  auto header = [](const std::string& precision) {
    TempDir dir;
    std::string job = test::tiny_gpt_job(dir.str());
    job.replace(job.find("log_level = \"warn\""), 18, "log_level = \"info\"");
    auto trainer = Trainer::from_text(with_precision(job, precision), dir.path());
    testing::internal::CaptureStderr();
    trainer->setup();
    return testing::internal::GetCapturedStderr();
  };
  const std::string defaults = header("mode = \"fp16\"");
  EXPECT_NE(defaults.find("; dynamic loss scale 65536 (x2 every 2000 clean steps, x0.5 on "
                          "overflow; hysteresis 1; min_scale 0 (none: the floor is 2^-24)); "
                          "on_overflow error: an overflow at the floor ends the run\n"),
            std::string::npos)
      << defaults;
  const std::string set = header(
      "mode = \"fp16\"\ninit_scale = 1024.0\nhysteresis = 3\nconsecutive_hysteresis = true\n"
      "min_scale = 0.25\non_overflow = \"fallback\"\nfallback_after = 5\nfallback_mode = \"fp32\"");
  EXPECT_NE(set.find("; dynamic loss scale 1024 (x2 every 2000 clean steps, x0.5 on overflow; "
                     "hysteresis 3 overflows at one scale before it backs off, restored after "
                     "every clean step; min_scale 0.25); on_overflow fallback: an overflow at "
                     "the floor or 5 overflowing steps in a row switch the run to fp32 "
                     "(fallback_mode fp32)\n"),
            std::string::npos)
      << set;
  // fallback_mode auto says what it resolved to on this device, and why.
  const std::string automatic = header("mode = \"fp16\"\non_overflow = \"fallback\"");
  const bool bf16 = loom::precision::cpu_half_gap(at::kBFloat16,
                                                  at::cpu::get_cpu_capabilities()).empty();
  EXPECT_NE(automatic.find(bf16 ? "switch the run to bf16 autocast (fallback_mode auto: this "
                                  "CPU computes bf16 natively)"
                                : "switch the run to fp32 (fallback_mode auto: this CPU has no "
                                  "bf16 instructions"),
            std::string::npos)
      << automatic;
}

// ---- bad input and warnings ----

TEST(Precision, UnknownModeIsAnErrorWithAHint) {
  TempDir dir;
  auto build = [&] { return Trainer::from_text(
      with_precision(test::tiny_gpt_job(dir.str()), "mode = \"bf61\""), dir.path()); };
  EXPECT_THROW_WITH(build(), ConfigError, "job.toml:", "[precision] mode 'bf61' is unknown",
                    "did you mean 'bf16'?", "fp32, tf32, bf16, fp16, full_bf16, full_fp16 or auto");
}

TEST(Precision, UnknownCastCacheIsAnErrorNamingTheKey) {
  TempDir dir;
  auto build = [&] { return Trainer::from_text(
      with_precision(test::tiny_gpt_job(dir.str()), "mode = \"bf16\"\ncast_cache = \"micro\""),
      dir.path()); };
  EXPECT_THROW_WITH(build(), ConfigError, "job.toml:",
                    "[precision] cast_cache must be \"step\" or \"forward\", got \"micro\"");
}

TEST(Precision, ScalerKeysWithoutFp16AreAnError) {
  TempDir dir;
  auto build = [&] { return Trainer::from_text(
      with_precision(test::tiny_gpt_job(dir.str()), "mode = \"bf16\"\ngrowth_interval = 10"),
      dir.path()); };
  EXPECT_THROW_WITH(build(), ConfigError, "[precision] growth_interval sets the fp16 loss",
                    "mode is 'bf16'", "remove it or use an fp16 mode");
}

TEST(Precision, BadScalerValuesAreErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"init_scale = 0.0", "[precision] init_scale must be a positive number, got 0"},
      {"growth_factor = 1.0", "[precision] growth_factor must be > 1, got 1"},
      {"backoff_factor = 1.5", "[precision] backoff_factor must be in (0, 1), got 1.5"},
      {"growth_interval = 0", "[precision] growth_interval must be >= 1, got 0"},
      {"hysteresis = 0", "[precision] hysteresis must be >= 1, got 0"},
      {"min_scale = 1e6", "[precision] min_scale must be in [0, init_scale (65536)], got 1e+06"}};
  for (const auto& [line, message] : cases) {
    TempDir dir;
    auto build = [&] { return Trainer::from_text(
        with_precision(test::tiny_gpt_job(dir.str()), "mode = \"fp16\"\n" + line), dir.path()); };
    EXPECT_THROW_WITH(build(), ConfigError, "job.toml:", message);
  }
}

TEST(Precision, AutocastRefusesAModelWithHalfWeights) {
  // A model whose weights are not fp32 cannot run fp16 autocast over fp32 masters.
  TempDir dir;
  auto trainer = Trainer::from_text(
      with_precision(test::tiny_gpt_job(dir.str()), "mode = \"fp16\""), dir.path());
  trainer->engine().on(Event::model_built, [](Engine& e) {
    at::NoGradGuard no_grad;
    auto param = e.model().named_parameters()["ln_f.weight"];
    param.set_data(param.detach().to(at::kBFloat16));
  });
  EXPECT_THROW_WITH(trainer->setup(), ConfigError, "[precision] mode = \"fp16\" runs autocast",
                    "parameter 'ln_f.weight' is stored as BFloat16", "mode = \"full_fp16\"");
}

TEST(Precision, Tf32OnCpuWarnsOnce) {
  TempDir dir;
  auto trainer = Trainer::from_text(
      with_precision(test::tiny_gpt_job(dir.str()), "mode = \"tf32\""), dir.path());
  testing::internal::CaptureStderr();
  trainer->run();
  const std::string log = testing::internal::GetCapturedStderr();
  const std::string warning = "[precision] mode = \"tf32\" has no effect on cpu";
  const size_t first = log.find(warning);
  ASSERT_NE(first, std::string::npos) << log;
  EXPECT_EQ(log.find(warning, first + 1), std::string::npos) << "warned twice: " << log;
}

// Note [Auto precision]: the choice rule, then a run that says what it chose, runs it (autocast
// is on in forward exactly when it chose bf16), and ends bitwise where the same job with that
// mode named ends: the probe leaves the run's random stream alone.
TEST(Precision, AutoRunsTheModeItChoseAndSaysWhy) {
  EXPECT_TRUE(precision::auto_prefers_bf16(1.0, 0.6));
  EXPECT_FALSE(precision::auto_prefers_bf16(1.0, 0.95));  // faster, but not by the margin
  EXPECT_FALSE(precision::auto_prefers_bf16(1.0, 1.6));
  EXPECT_FALSE(precision::auto_prefers_bf16(0.0, 0.0));

  TempDir a, b;
  auto chosen_run = Trainer::from_text(
      with_precision(test::tiny_gpt_job(a.str()), "mode = \"auto\""), a.path(),
      {"train.log_level=info"});
  testing::internal::CaptureStderr();
  chosen_run->setup();
  std::optional<bool> autocast_in_forward;
  chosen_run->engine().on(Event::before_forward, [&](Engine&) {
    const bool on = at::autocast::is_autocast_enabled(at::kCPU);
    EXPECT_TRUE(!autocast_in_forward || *autocast_in_forward == on) << "the mode changed mid-run";
    autocast_in_forward = on;
  });
  chosen_run->run();
  const std::string log = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(autocast_in_forward.has_value());
  const bool bf16 = *autocast_in_forward;
  EXPECT_NE(log.find(std::string("[precision] mode = \"auto\" chose ") +
                     (bf16 ? "bf16 autocast" : "fp32")),
            std::string::npos)
      << log;
  if (!precision::cpu_half_gap(at::kBFloat16, at::cpu::get_cpu_capabilities()).empty())
    EXPECT_FALSE(bf16) << "auto chose bf16 on a CPU without bf16 instructions";

  auto named_run = Trainer::from_text(
      with_precision(test::tiny_gpt_job(b.str()),
                     std::string("mode = \"") + (bf16 ? "bf16" : "fp32") + "\""),
      b.path());
  named_run->run();
  EXPECT_TRUE(all_bitwise_equal(snapshot(chosen_run->engine()), snapshot(named_run->engine())));
}

TEST(Precision, CpuWithoutHalfInstructionsIsNamed) {
  // The capability names the check reads are LibTorch's own (a typo would silently pass).
  const auto caps = at::cpu::get_cpu_capabilities();
#if defined(__x86_64__)
  for (const char* key : {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"})
    EXPECT_TRUE(caps.count(key)) << "LibTorch reports no capability '" << key << "'";
#endif
  std::unordered_map<std::string, c10::IValue> none = {{"avx512_bf16", false}, {"avx2", true}};
  EXPECT_NE(precision::cpu_half_gap(at::kBFloat16, none).find("no bf16 instructions"),
            std::string::npos);
  EXPECT_NE(precision::cpu_half_gap(at::kHalf, none).find("no fp16 arithmetic"),
            std::string::npos);
  EXPECT_EQ(precision::cpu_half_gap(at::kBFloat16, {{"amx_bf16", true}}), "");
  EXPECT_EQ(precision::cpu_half_gap(at::kHalf, {{"avx512_fp16", true}}), "");
  EXPECT_EQ(precision::cpu_half_gap(at::kFloat, none), "");

  // A run on a CPU without the dtype's instructions says so once.
  const at::ScalarType missing =
      precision::cpu_half_gap(at::kHalf, caps).empty() ? at::kBFloat16 : at::kHalf;
  if (!precision::cpu_half_gap(missing, caps).empty()) {
    TempDir dir;
    const std::string mode = missing == at::kHalf ? "fp16" : "bf16";
    auto trainer = Trainer::from_text(
        with_precision(test::tiny_gpt_job(dir.str()), "mode = \"" + mode + "\""), dir.path());
    testing::internal::CaptureStderr();
    trainer->run();
    const std::string log = testing::internal::GetCapturedStderr();
    const size_t first = log.find("LibTorch emulates");
    ASSERT_NE(first, std::string::npos) << log;
    EXPECT_EQ(log.find("LibTorch emulates", first + 1), std::string::npos) << log;
  }
}

// oneDNN's bf16 kernels allocate through c10::Allocator::raw_allocate, which needs a DataPtr
// whose context is its data: the core's tracking allocator must serve that, and count it.
TEST(Precision, TrackingAllocatorServesRawAllocations) {
  memory::install_cpu_tracker();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  const int64_t before = memory::cpu_stats().current_bytes;
  void* block = allocator->raw_allocate(1000);
  ASSERT_NE(block, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(block) % 64, 0u);
  static_cast<char*>(block)[999] = 1;
  EXPECT_EQ(memory::cpu_stats().current_bytes, before + 1000);
  allocator->raw_deallocate(block);
  EXPECT_EQ(memory::cpu_stats().current_bytes, before);
  // oneDNN asks for 0 bytes too, and hands the nullptr it got back to the raw deleter.
  void* empty = allocator->raw_allocate(0);
  allocator->raw_deallocate(empty);
  EXPECT_EQ(memory::cpu_stats().current_bytes, before);
}

}  // namespace
}  // namespace loom
