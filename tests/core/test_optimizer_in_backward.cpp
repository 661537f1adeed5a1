// [train] optimizer_in_backward (Note [Optimizer in backward]): bitwise the normal step with
// clipping off (plain, accumulation, bf16 autocast, full_bf16 masters, weight decay and a
// schedule; ZeRO stages 1-2 on one rank, Note [Updating chunks in backward]), its resume, a
// peak lower by about the gradients' bytes, and the refusals by name.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <regex>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/safetensors.h"
#include "loom/step_driver.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

const std::string kInBackward = "train.optimizer_in_backward=true";

// The tiny GPT with decay on group 0, a warm-up then cosine schedule, and clipping off.
std::vector<std::string> base_sets(std::vector<std::string> extra = {}) {
  std::vector<std::string> sets = {"train.max_grad_norm=0", "train.max_steps=5",
                                   "train.lr_scheduler_type=cosine", "train.warmup_steps=2",
                                   "optimizer.weight_decay=0.1"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return sets;
}

// One number of every metrics.jsonl line ("loss", "grad_norm"), as written.
std::vector<std::string> metric_column(const std::filesystem::path& file, const std::string& key) {
  std::vector<std::string> out;
  std::istringstream in(test::read_text(file));
  const std::regex field("\"" + key + "\":([^,}]+)");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, field)) out.push_back(m[1]);
  }
  return out;
}

struct Trained {
  std::vector<std::pair<std::string, at::Tensor>> weights;  // every parameter, as trained
  StatePieces state;                                        // the driver's masters and state
};

Trained train(const std::string& job, const std::filesystem::path& dir,
              const std::vector<std::string>& sets) {
  auto trainer = Trainer::from_text(job, dir, sets);
  trainer->run();
  Trained out;
  for (const auto& p : trainer->engine().params())
    out.weights.emplace_back(p.name, p.tensor.detach().clone());
  for (auto piece : trainer->engine().step_driver().state_pieces()) {
    piece.tensor = piece.tensor.clone();
    out.state.push_back(std::move(piece));
  }
  return out;
}

void expect_bitwise_equal(const Trained& want, const Trained& got) {
  ASSERT_EQ(want.weights.size(), got.weights.size());
  for (size_t i = 0; i < want.weights.size(); ++i) {
    EXPECT_EQ(want.weights[i].first, got.weights[i].first);
    EXPECT_TRUE(at::equal(want.weights[i].second, got.weights[i].second))
        << want.weights[i].first;
  }
  ASSERT_EQ(want.state.size(), got.state.size());
  for (size_t i = 0; i < want.state.size(); ++i) {
    EXPECT_EQ(want.state[i].name, got.state[i].name);
    EXPECT_TRUE(at::equal(want.state[i].tensor, got.state[i].tensor)) << want.state[i].name;
  }
}

struct Case {
  const char* name;
  std::vector<std::string> sets;
  std::string tables;  // appended to the job
};

class InBackwardBitwise : public ::testing::TestWithParam<Case> {};

// The weights, fp32 masters and AdamW moments after 5 steps, the per-step loss and the
// reported grad_norm are the normal step's, bit for bit.
void expect_in_backward_bitwise(const Case& c) {
  TempDir normal_dir, in_backward_dir;
  const auto sets = base_sets(c.sets);
  auto in_backward_sets = sets;
  in_backward_sets.push_back(kInBackward);
  const Trained normal =
      train(tiny_gpt_job(normal_dir.str()) + c.tables, normal_dir.path(), sets);
  const Trained in_backward = train(tiny_gpt_job(in_backward_dir.str()) + c.tables,
                                    in_backward_dir.path(), in_backward_sets);
  expect_bitwise_equal(normal, in_backward);
  for (const char* key : {"loss", "grad_norm"}) {
    const auto want = metric_column(normal_dir / "metrics.jsonl", key);
    EXPECT_EQ(want.size(), 5u) << key;
    EXPECT_EQ(want, metric_column(in_backward_dir / "metrics.jsonl", key)) << key;
  }
  // The updates really ran: the weights moved from the seed's.
  TempDir untrained_dir;
  auto untrained = Trainer::from_text(tiny_gpt_job(untrained_dir.str()) + c.tables,
                                      untrained_dir.path(), sets);
  untrained->setup();
  EXPECT_FALSE(at::equal(untrained->engine().params().front().tensor,
                         in_backward.weights.front().second));
}

TEST_P(InBackwardBitwise, EqualsTheNormalStepWithoutClipping) { expect_in_backward_bitwise(GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Cases, InBackwardBitwise,
    ::testing::Values(
        Case{"plain", {}, ""},
        // Updates on the last micro-batch only; the first one's gradients accumulate as usual.
        Case{"accumulation2", {"train.gradient_accumulation_steps=2"}, ""},
        // Autocast over fp32 weights, half copies cached across micro-batches (cast_cache).
        Case{"bf16_accumulation2", {"train.gradient_accumulation_steps=2"},
             "\n[precision]\nmode = \"bf16\"\n"},
        // bf16 weights with the driver's fp32 masters written back after each update.
        Case{"full_bf16", {}, "\n[precision]\nmode = \"full_bf16\"\n"},
        // [ddp] on one rank: the gradients are handed over from its buckets after backward.
        Case{"ddp_one_rank", {"ddp.reduce_bucket_size=20000"}, "\n[ddp]\n"},
        // Note [Updating chunks in backward]: ZeRO's driver updates each group's chunk as its
        // reduce-scatter lands, here over many small groups: stage 1 with the window's whole
        // gradient, stage 2 with its shard accumulated over the micro-steps and bf16 weights
        // (the chunk's fp32 masters written back and all-gathered while backward goes on).
        Case{"zero1_accumulation2", {"train.gradient_accumulation_steps=2"},
             "\n[zero]\nstage = 1\nreduce_bucket_size = 20000\nallgather_bucket_size = 30000\n"},
        Case{"zero2_full_bf16_accumulation2", {"train.gradient_accumulation_steps=2"},
             "\n[zero]\nstage = 2\nreduce_bucket_size = 20000\nallgather_bucket_size = 30000\n"
             "[precision]\nmode = \"full_bf16\"\n"}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A run stopped at step 2 and resumed ends bitwise where the straight run ends.
TEST(OptimizerInBackward, ResumeIsBitwiseExact) {
  TempDir straight, split;
  auto sets = base_sets({kInBackward, "train.gradient_accumulation_steps=2", "model.dropout=0.1"});
  Trainer::from_text(tiny_gpt_job(straight.str()), straight.path(), sets)->run();
  {
    auto first = Trainer::from_text(tiny_gpt_job(split.str()), split.path(), sets);
    first->setup();
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(first->step());
    first->save_checkpoint();
  }
  auto resume = sets;
  resume.push_back("train.resume=latest");
  EXPECT_EQ(Trainer::from_text(tiny_gpt_job(split.str()), split.path(), resume)->run().steps, 5);
  for (const char* file : {"model.safetensors", "optimizer-00000-of-00001.safetensors"}) {
    auto want = safetensors::load(straight / "checkpoint-5" / file).tensors;
    auto got = safetensors::load(split / "checkpoint-5" / file).tensors;
    ASSERT_EQ(want.size(), got.size()) << file;
    ASSERT_FALSE(want.empty()) << file;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(want[i].first, got[i].first);
      EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << file << " " << want[i].first;
    }
  }
}

// The tracked allocator's peak over 3 steps of a wider tiny GPT with `tables` appended, without
// and with optimizer_in_backward, and its gradients' fp32 bytes (all and the largest).
struct PeakSaving {
  int64_t normal = 0, in_backward = 0, grad_bytes = 0, largest = 0;
  int64_t saved() const { return normal - in_backward; }
  std::string numbers() const {
    return detail::cat("normal peak ", normal, ", in backward ", in_backward, ", grads ",
                       grad_bytes, ", largest ", largest, ", saved ", saved());
  }
};
PeakSaving measure_peak_saving(const std::string& tables, int batch = 2) {
  const std::vector<std::string> wider = {"model.n_embd=128", "model.n_layer=6",
                                          "model.vocab_size=512", "data.vocab_high=512",
                                          "train.max_steps=3",
                                          "train.per_device_train_batch_size=" +
                                              std::to_string(batch),
                                          "train.max_grad_norm=0"};
  int64_t grad_bytes = 0, largest = 0;
  auto peak_of = [&](bool in_backward) {
    TempDir dir;
    auto sets = wider;
    if (in_backward) sets.push_back(kInBackward);
    auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()) + tables, dir.path(), sets);
    trainer->setup();
    memory::reset_cpu_peak();
    const int64_t before = memory::cpu_stats().current_bytes;
    while (trainer->step()) {
    }
    grad_bytes = largest = 0;
    for (const auto& p : trainer->engine().params()) {
      grad_bytes += p.tensor.numel() * 4;
      largest = std::max<int64_t>(largest, p.tensor.numel() * 4);
    }
    return memory::cpu_stats().peak_bytes - before;
  };
  PeakSaving out;
  out.normal = peak_of(false);
  out.in_backward = peak_of(true);
  out.grad_bytes = grad_bytes;
  out.largest = largest;
  std::cout << out.numbers() << "\n";
  return out;
}

// The point of it: no step holds every gradient at once. The normal step releases its
// gradients between steps (Note [Gradients released, not zeroed]), so its forward holds none
// and its update, holding them all, sets its peak wherever the activations do not. With the
// activations recomputed unit by unit at batch 1 (so they set neither peak) the tracked
// allocator's peak over the steps falls by the gradients' bytes (all fp32 here), less what
// backward holds besides at the in-backward run's peak: one gradient being updated, its
// squares for the norm in fp32 and fp64, the rule's temporaries, backward's own buffers and a
// unit's recomputation, at most 8 of the largest gradient's bytes (measured: 7.3 of them, 3.93
// of 5.03 MB saved). Without recomputation the activations set the in-backward peak: 2.91 MB
// saved at batch 2.
TEST(OptimizerInBackward, PeakMemoryFallsByAboutTheGradientBytes) {
  const PeakSaving m = measure_peak_saving("\n[checkpointing]\n", 1);
  ASSERT_GT(m.grad_bytes, 16 * m.largest);  // the gradients stand out of one's transients
  EXPECT_GE(m.saved(), m.grad_bytes - 8 * m.largest) << m.numbers();
  EXPECT_LE(m.saved(), m.grad_bytes) << m.numbers();
}

// Note [Updating chunks in backward]: at ZeRO stage 2 (one rank, so the shard is the whole
// gradient, in groups of about one large tensor) each group's shard is freed as soon as its
// chunk is updated, while backward goes on; the normal step holds every shard, and every
// chunk's update temporaries, at once.
// The CPU twin of Note [Small gradients batched on a GPU] (LOOM_IN_BACKWARD_BATCH=BYTES: small
// gradients held on the CPU too, applied once BYTES are held and at the end of backward, as a
// GPU run does with 16 MiB): at about 20 KB a batch the tiny GPT's backward applies several
// batches and a remainder, and stays bitwise the normal step (weights, state, loss, grad_norm),
// plainly and with accumulation. Held without limit, nothing is freed before backward ends, so
// the peak saving of PeakMemoryFallsByAboutTheGradientBytes disappears: the holding is real.
TEST(OptimizerInBackward, SmallGradientsBatchedAreBitwiseTheNormalStep) {
  struct Unset {
    ~Unset() { unsetenv("LOOM_IN_BACKWARD_BATCH"); }
  } unset;
  setenv("LOOM_IN_BACKWARD_BATCH", "20000", 1);
  expect_in_backward_bitwise(Case{"plain", {}, ""});
  expect_in_backward_bitwise(Case{"accumulation2", {"train.gradient_accumulation_steps=2"}, ""});
  setenv("LOOM_IN_BACKWARD_BATCH", "1000000000000", 1);
  const PeakSaving held = measure_peak_saving("\n[checkpointing]\n", 1);
  EXPECT_LT(held.saved(), held.grad_bytes / 4) << held.numbers();
}

TEST(OptimizerInBackward, ZeroStage2PeakFallsByAboutTheGradientShards) {
  const PeakSaving m =
      measure_peak_saving("\n[zero]\nstage = 2\nreduce_bucket_size = 300000\n");
  EXPECT_GE(m.saved(), m.grad_bytes - 4 * m.largest) << m.numbers();
}

// What needs every gradient before any update is refused by name, before anything is built.
TEST(OptimizerInBackward, RefusesWhatNeedsEveryGradientFirst) {
  TempDir dir;
  const std::string job = tiny_gpt_job(dir.str());
  // max_grad_norm's default (1.0, the Trainer's) clips by the global norm.
  EXPECT_THROW_WITH(Trainer::from_text(job, dir.path(), {kInBackward}), ConfigError,
                    "[train] max_grad_norm = 1 clips by the global gradient norm",
                    "set max_grad_norm = 0");
  for (const char* mode : {"fp16", "full_fp16"})
    EXPECT_THROW_WITH(Trainer::from_text(job + "\n[precision]\nmode = \"" + mode + "\"\n",
                                         dir.path(), {kInBackward, "train.max_grad_norm=0"}),
                      ConfigError, std::string("[precision] mode = \"") + mode + "\" scales the loss",
                      "use mode = \"bf16\"");
  // Note [Updating chunks in backward]: stages 1-2 update each chunk as it lands; stage 3's
  // shards are gathered again before they could be.
  EXPECT_THROW_WITH(Trainer::from_text(job + "\n[zero]\nstage = 3\n", dir.path(),
                                       {kInBackward, "train.max_grad_norm=0"}),
                    ConfigError, "[zero] stage 3 with [train] optimizer_in_backward is not built",
                    "use stage = 1 or 2");
  // The host store updates by itself: refused when the job is read, as `loom check` reads it.
  for (const char* stage : {"0", "1"})
    EXPECT_THROW_WITH(Trainer::from_text(job + "\n[zero]\nstage = " + stage +
                                             "\noffload_optimizer = { device = \"cpu\" }\n",
                                         dir.path(), {kInBackward, "train.max_grad_norm=0"}),
                      ConfigError, "[zero] offload_optimizer.device = \"cpu\" with [train] "
                      "optimizer_in_backward is not built", "leave offload_optimizer out");
  // Adafactor's column and row sums need every rank's chunk of a tensor before any update:
  // refused when the job is read (the rule is built then: JobTables::update_rule), at both
  // stages that update chunks in backward; at stage 0 each tensor is updated whole.
  for (const char* stage : {"1", "2"})
    EXPECT_THROW_WITH(Trainer::from_text(job + "\n[zero]\nstage = " + stage + "\n", dir.path(),
                                         {kInBackward, "train.max_grad_norm=0",
                                          "optimizer.name=\"adafactor\""}),
                      ConfigError,
                      std::string("optimizer_in_backward at [zero] stage ") + stage + " (",
                      "update rule 'adafactor' sums statistics over whole tensors",
                      "use [zero] stage = 0");
  EXPECT_NE(Trainer::from_text(job + "\n[zero]\nstage = 0\n", dir.path(),
                               {kInBackward, "train.max_grad_norm=0", "optimizer.name=\"adafactor\""}),
            nullptr);
  // A step driver that cannot update as gradients arrive, named.
  EXPECT_THROW_WITH(
      Trainer::from_text(job + "\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR "\"\n[counting_driver]\n",
                         dir.path(), {kInBackward, "train.max_grad_norm=0"})
          ->setup(),
      ConfigError, "needs a step driver that updates as gradients become final",
      "this job's is 'counting(default)'");
}

// A plugin that skips an update in before_update comes too late: the update ran in backward.
TEST(OptimizerInBackward, ASkippedUpdateIsAnError) {
  TempDir dir;
  auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                    {kInBackward, "train.max_grad_norm=0"});
  trainer->engine().on(Event::before_update, [](Engine& e) { e.state().skip_update = true; });
  EXPECT_THROW_WITH(trainer->step(), Error, "step 1: a plugin asked to skip this update",
                    "optimizer_in_backward applied it during backward");
}

// grad_final belongs to optimizer_in_backward.
TEST(OptimizerInBackward, GradFinalWithoutItIsAnError) {
  TempDir dir;
  auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=1"});
  trainer->setup();
  const auto& p = trainer->engine().params().front();
  EXPECT_THROW_WITH(trainer->engine().grad_final(p.tensor, at::zeros_like(p.tensor)), Error,
                    "which this job does not set");
}

}  // namespace
}  // namespace loom
