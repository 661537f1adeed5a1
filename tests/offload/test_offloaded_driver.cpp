// Optimizer state offloaded to NVMe ([zero] offload_optimizer, loom/offload/offloaded_driver.h):
// the final weights equal the in-memory run's bit for bit for adamw, adafactor and adam8bit, fp32
// and bf16 weights, stages 0 to 3 on one rank (stages 1-3: ZeRO's driver with its pieces in the
// swap file); a resumed offloaded run is bitwise the uninterrupted one, from its own checkpoint
// and from an in-memory run's; the swap file is gone after the run; bad offload keys are errors
// naming them. Stage 3's weight shards offloaded too (offload_param): bitwise, each unit's shard
// read a unit ahead, none in memory between steps; and staged as a GPU run stages them, on the
// CPU twin (host store or NVMe), bitwise and resumed bitwise. The host store's update
// overlapping backward (Note [Overlapped update]) is bitwise the in-memory run's, its updates
// started before update() is called; host memory that cannot be allocated, and offload_param
// with nothing to offload, are errors naming the size or the threshold.
#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/offload/offloaded_driver.h"
#include "loom/safetensors.h"
#include "loom/step_driver.h"
#include "loom/update_rule.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
namespace fs = std::filesystem;

std::string job(const std::string& out, const std::string& optimizer, const std::string& zero,
                const std::string& train_extra = "", int steps = 6) {
  std::string text = test::tiny_gpt_job(out);
  text.replace(text.find("max_steps = 4"), 13,
               "max_steps = " + std::to_string(steps) + "\n" + train_extra);
  text += "\n[optimizer]\nname = \"" + optimizer + "\"\n";
  if (optimizer == "adam8bit") text += "block_size = 64\nmin_8bit_size = 256\n";
  text += "\n[zero]\n" + zero + "\n";
  return text;
}

std::string offload(const std::string& folder) {
  return "offload_optimizer = { device = \"nvme\", nvme_path = \"" + folder +
         "\", block_size = 8192, queue_depth = 2, buffer_count = 3 }\n";
}

// The CPU twin of the host store (Note [Host store]): on a CPU run offload_optimizer.device =
// "cpu" otherwise changes nothing.
struct TwinScope {
  TwinScope() { setenv("LOOM_OFFLOAD_CPU_STORE", "1", 1); }
  ~TwinScope() { unsetenv("LOOM_OFFLOAD_CPU_STORE"); }
};

// `text` (a job() with an [optimizer] table) with [optimizer] master_dtype = `dtype`.
std::string with_master_dtype(std::string text, const std::string& dtype) {
  text.replace(text.find("[optimizer]\n"), 12, "[optimizer]\nmaster_dtype = \"" + dtype + "\"\n");
  return text;
}

// The delayed update's store (Note [Delayed update]) for the driver-level tests: `device` "cpu"
// or "nvme" (its file in `folder`, small blocks, the fewest buffers).
offload::OffloadOptions delayed_store(const std::string& device, const std::string& folder) {
  offload::OffloadOptions offload;
  offload.device = device;
  offload.nvme.path = folder;
  offload.nvme.block_size = 4096;
  offload.buffer_count = 3;
  offload.delayed_update = true;
  return offload;
}

// The final weights of the job `text` trained in `dir` (and, given `tensors`, how many trainable
// tensors it has).
std::map<std::string, at::Tensor> trained(const std::string& text, const fs::path& dir,
                                          double* tensors = nullptr) {
  auto trainer = Trainer::from_text(text, dir);
  trainer->setup();
  if (tensors) *tensors = static_cast<double>(trainer->engine().params().size());
  trainer->run();
  std::map<std::string, at::Tensor> out;
  for (const auto& item : trainer->engine().model().named_parameters(true))
    out[item.key()] = item.value().detach().to(at::kFloat).clone();
  // The fp32 masters, where a bf16 run keeps them, are in the final checkpoint's optimizer
  // state; equal weights after several steps with equal masters underneath are checked by
  // the resume case below.
  return out;
}

void expect_bitwise(const std::map<std::string, at::Tensor>& a,
                    const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) EXPECT_TRUE(at::equal(tensor, b.at(name))) << name;
}

// No optimizer file of `checkpoint` holds a "master/" tensor.
void expect_no_masters(const fs::path& checkpoint) {
  for (const auto& entry : fs::directory_iterator(checkpoint))
    if (entry.path().filename().string().rfind("optimizer-", 0) == 0)
      for (const auto& [name, tensor] : safetensors::load(entry.path()).tensors)
        EXPECT_NE(name.rfind("master/", 0), 0u) << name;
}

// The lines of a run's metrics.jsonl.
std::vector<std::string> metric_lines(const fs::path& dir) {
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The offload matrix: every rule x fp32 and bf16 weights x stages 0-3, each case trained in
// memory and then by `offloaded(rule, stage, precision, weights)`, which trains the offloaded
// run, checks what it leaves and fills `weights`: bitwise the in-memory run's.
void expect_offload_matrix_bitwise(
    const std::function<void(const std::string&, const std::string&, const std::string&,
                             std::map<std::string, at::Tensor>&)>& offloaded) {
  for (const std::string rule : {"adamw", "adafactor", "adam8bit"})
    for (const std::string precision : {"", "\n[precision]\nmode = \"full_bf16\"\n"})
      for (const std::string stage :
           {"stage = 0\n", "stage = 1\n", "stage = 2\n",
            "stage = 3\nstage3_param_persistence_threshold = 0\n"}) {
        SCOPED_TRACE(rule + (precision.empty() ? " fp32 " : " bf16 ") + stage);
        TempDir memory_dir;
        const auto memory = trained(job(memory_dir.str(), rule, stage) + precision,
                                    memory_dir.path());
        std::map<std::string, at::Tensor> weights;
        offloaded(rule, stage, precision, weights);
        expect_bitwise(memory, weights);
      }
}

TEST(Offload, NvmeOptimizerStateTrainsBitwiseLikeMemory) {
  expect_offload_matrix_bitwise([](const std::string& rule, const std::string& stage,
                                   const std::string& precision,
                                   std::map<std::string, at::Tensor>& weights) {
    TempDir nvme_dir, swap;
    weights = trained(job(nvme_dir.str(), rule, stage + offload(swap.str())) + precision,
                      nvme_dir.path());
    EXPECT_TRUE(fs::is_empty(swap.path())) << "the swap file outlived the run";
  });
}

// Note [Host store]: offload_optimizer.device = "cpu", a GPU run's ZeRO-Offload, run on the CPU
// (LOOM_OFFLOAD_CPU_STORE=1: on a CPU run "cpu" otherwise changes nothing): the same matrix is
// bitwise the in-memory runs, every step's update went through the store (no bytes moved to a
// file), and a run resumed from its own checkpoint is bitwise the uninterrupted one.
TEST(Offload, HostStoreTwinTrainsBitwiseLikeMemory) {
  TwinScope twin;
  const std::string host = "offload_optimizer = { device = \"cpu\" }\n";
  expect_offload_matrix_bitwise([&](const std::string& rule, const std::string& stage,
                                    const std::string& precision,
                                    std::map<std::string, at::Tensor>& weights) {
    TempDir host_dir;
    weights = trained(job(host_dir.str(), rule, stage + host) + precision, host_dir.path());
    const auto lines = metric_lines(host_dir.path());
    EXPECT_EQ(lines.size(), 6u);
    for (const auto& line : lines) {
      EXPECT_NE(line.find("\"offload_update_s\""), std::string::npos) << line;
      EXPECT_NE(line.find("\"offload_bytes_read\":0.0"), std::string::npos) << line;
    }
  });
  const std::string bf16 = "\n[precision]\nmode = \"full_bf16\"\n";
  for (const std::string stage : {"stage = 0\n", "stage = 2\n"}) {
    SCOPED_TRACE(stage);
    TempDir whole_dir, resumed_dir;
    const auto whole =
        trained(job(whole_dir.str(), "adamw", stage + host, "save_steps = 3\n") + bf16,
                whole_dir.path());
    const auto resumed = trained(
        job(resumed_dir.str(), "adamw", stage + host,
            "resume = \"" + (whole_dir / "checkpoint-3").string() + "\"\n") + bf16,
        resumed_dir.path());
    expect_bitwise(whole, resumed);
  }
}

// A metric of a run's metrics.jsonl line (the number after "key":).
double metric(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":");
  EXPECT_NE(at, std::string::npos) << key << " in " << line;
  return at == std::string::npos ? -1 : std::stod(line.substr(at + key.size() + 3));
}

// Note [ZeRO without masters]: with [optimizer] master_dtype = "bf16" the swap file holds the
// state alone (the walk widens the bf16 weights where they are and rounds them back): the
// weights are bitwise the in-memory run's without masters (stages 2 and 3; adamw, and
// adafactor's reduction walks), the file moves 8 B/param each way where masters made it 12,
// no checkpoint holds a master, and a resume from its own checkpoint is bitwise.
TEST(Offload, WithoutMastersTheSwapFileHoldsTheStateAloneAndTrainsBitwiseLikeMemory) {
  const std::string no_masters =
      "\n[precision]\nmode = \"full_bf16\"\n";
  for (const auto& [rule, stage] :
       {std::pair<std::string, std::string>{"adamw", "stage = 2\n"},
        {"adafactor", "stage = 3\nstage3_param_persistence_threshold = 0\n"}}) {
    SCOPED_TRACE(rule + " " + stage);
    TempDir memory_dir, swap_dir, swap, masters_dir, masters_swap, resumed_dir;
    const auto memory = trained(
        with_master_dtype(job(memory_dir.str(), rule, stage) + no_masters, "bf16"), memory_dir.path());
    const auto swapped = trained(
        with_master_dtype(job(swap_dir.str(), rule, stage + offload(swap.str()), "save_steps = 3\n") +
                         no_masters, "bf16"),
        swap_dir.path());
    expect_bitwise(memory, swapped);
    EXPECT_TRUE(fs::is_empty(swap.path())) << "the swap file outlived the run";
    expect_no_masters(swap_dir / "checkpoint-6");
    // The same job with fp32 masters: its file moves the masters too.
    trained(with_master_dtype(job(masters_dir.str(), rule, stage + offload(masters_swap.str())) +
                             no_masters, "fp32"),
            masters_dir.path());
    const std::string without = metric_lines(swap_dir.path()).back();
    const std::string with = metric_lines(masters_dir.path()).back();
    if (rule == "adamw") {
      // 8 of 12 B/param; each region is rounded up to the file's 8 KiB blocks, which the tiny
      // model's small tensors fill only in part (0.72 measured): with masters still in the file
      // it would be 1.
      for (const char* key : {"offload_bytes_read", "offload_bytes_written"}) {
        const double ratio = metric(without, key) / metric(with, key);
        EXPECT_GT(ratio, 8.0 / 12.0 - 0.01) << key;
        EXPECT_LT(ratio, 0.76) << key;
      }
    } else {
      EXPECT_LT(metric(without, "offload_bytes_read"), metric(with, "offload_bytes_read"));
    }
    const auto resumed = trained(
        with_master_dtype(job(resumed_dir.str(), rule, stage + offload(swap.str()),
                         "resume = \"" + (swap_dir / "checkpoint-3").string() + "\"\n") +
                         no_masters, "bf16"),
        resumed_dir.path());
    expect_bitwise(swapped, resumed);
  }
}

// Note [Offloaded without masters]: stage 0's offloaded driver keeps no masters either: on NVMe
// and in the host store (the GPU path's twin), its update overlapping backward (without
// clipping: every tensor updated during backward) or waiting for the norm, or after backward,
// the weights are bitwise the in-memory run's without masters, for adamw (its own pass over
// the bf16 weights), lion (the widened copy) and adafactor (whole-tensor sums); the swap file
// moves 8 of the 12 B/param masters made it move; no checkpoint holds a master, a resume is
// bitwise, and one from a checkpoint with masters drops them and goes on.
TEST(Offload, StageZeroWithoutMastersTrainsBitwiseLikeMemory) {
  TwinScope twin;
  const std::string bf16 = "\n[precision]\nmode = \"full_bf16\"\n";
  struct Case {
    std::string rule, store, train;
  };
  const std::string host = "offload_optimizer = { device = \"cpu\" }\n";
  const std::string after = "offload_optimizer = { device = \"cpu\", overlap_update = false }\n";
  const std::string no_clip = "max_grad_norm = 0\n";
  const std::vector<Case> cases = {
      {"adamw", "nvme", ""}, {"lion", "nvme", ""}, {"adafactor", "nvme", ""},
      {"adamw", host, no_clip}, {"lion", host, no_clip}, {"adafactor", host, no_clip},
      {"adamw", host, ""}, {"lion", after, ""}};
  for (const auto& [rule, store, train] : cases) {
    SCOPED_TRACE(rule + " " + store + " " + train);
    TempDir memory_dir, run_dir, swap;
    const auto memory = trained(with_master_dtype(job(memory_dir.str(), rule, "stage = 0\n", train) + bf16,
                                        "bf16"),
                                memory_dir.path());
    const std::string zero = "stage = 0\n" + (store == "nvme" ? offload(swap.str()) : store);
    double tensors = 0;
    expect_bitwise(memory, trained(with_master_dtype(job(run_dir.str(), rule, zero,
                                               train + "save_steps = 3\n") + bf16, "bf16"),
                                   run_dir.path(), &tensors));
    expect_no_masters(run_dir / "checkpoint-6");
    if (store == host && train == no_clip)
      for (const auto& line : metric_lines(run_dir.path()))
        EXPECT_EQ(metric(line, "offload_updated_in_backward"), tensors) << line;
  }
  // The swap file without masters moves 8 of 12 B/param (its 8 KiB blocks apart); a resume is
  // bitwise; a resume from a run with masters drops them, warned, and trains on.
  TempDir whole_dir, swap, masters_dir, masters_swap, resumed_dir, switched_dir;
  const auto whole = trained(
      with_master_dtype(job(whole_dir.str(), "adamw", "stage = 0\n" + offload(swap.str()),
                  "save_steps = 3\n") + bf16, "bf16"),
      whole_dir.path());
  trained(with_master_dtype(job(masters_dir.str(), "adamw", "stage = 0\n" + offload(masters_swap.str()),
                      "save_steps = 3\n") + bf16, "fp32"),
          masters_dir.path());
  for (const char* key : {"offload_bytes_read", "offload_bytes_written"}) {
    const double ratio = metric(metric_lines(whole_dir.path()).back(), key) /
                         metric(metric_lines(masters_dir.path()).back(), key);
    EXPECT_GT(ratio, 8.0 / 12.0 - 0.01) << key;
    EXPECT_LT(ratio, 0.8) << key;
  }
  const auto resumed = trained(
      with_master_dtype(job(resumed_dir.str(), "adamw", "stage = 0\n" + offload(swap.str()),
                  "resume = \"" + (whole_dir / "checkpoint-3").string() + "\"\n") + bf16, "bf16"),
      resumed_dir.path());
  expect_bitwise(whole, resumed);
  // The delayed update's host copy of the weights, refilled from a checkpoint's.
  TempDir delayed_dir, delayed_resumed_dir;
  const std::string delayed = "stage = 0\noffload_optimizer = { device = \"nvme\", nvme_path = \"" +
                              swap.str() + "\", block_size = 8192, delayed_update = true }\n";
  const auto delayed_whole = trained(
      with_master_dtype(job(delayed_dir.str(), "adamw", delayed, "save_steps = 3\n") + bf16, "bf16"),
      delayed_dir.path());
  const auto delayed_resumed = trained(
      with_master_dtype(job(delayed_resumed_dir.str(), "adamw", delayed,
                  "resume = \"" + (delayed_dir / "checkpoint-3").string() + "\"\n") + bf16,
              "bf16"),
      delayed_resumed_dir.path());
  expect_bitwise(delayed_whole, delayed_resumed);
  const auto switched = trained(
      with_master_dtype(job(switched_dir.str(), "adamw", "stage = 0\n" + offload(swap.str()),
                  "resume = \"" + (masters_dir / "checkpoint-3").string() + "\"\n") + bf16,
              "bf16"),
      switched_dir.path());
  EXPECT_EQ(switched.size(), whole.size());
}

// Note [Offloaded without masters], the delayed update: the driver equals a reference that
// applies each update one step late with the core's in-memory driver without masters (its bf16
// weights one update ahead of the model's, in adamw's own pass), bit for bit, in the host store
// and on NVMe (whose walk widens and rounds), with fp32 and bf16 moments; synchronize() leaves
// every update applied.
TEST(Offload, DelayedUpdateWithoutMastersAppliesEachUpdateOneStepLate) {
  Schema schema("optimizer", "adamw");
  schema.key_float("beta1", 0.9, "").key_float("beta2", 0.999, "").key_float("eps", 1e-8, "")
      .key_float("weight_decay", 0.0, "").key_string("state_dtype", "fp32", "");
  for (const std::string state_dtype : {"fp32", "bf16"})
    for (const std::string device : {"cpu", "nvme"}) {
      SCOPED_TRACE(state_dtype + " moments, " + device);
      const auto adamw = make_adamw(ConfigSection(
          "optimizer", {{"state_dtype", ConfigValue{state_dtype, "test"}}}, schema, "job.toml"));
      const UpdateRule* rule = adamw.get();
      at::manual_seed(3);
      const at::Tensor w0 = at::randn({16, 8}).to(at::kBFloat16);
      const at::Tensor b0 = at::randn({8}).to(at::kBFloat16);
      std::vector<at::Tensor> xs, ys;
      for (int k = 0; k < 6; ++k) {
        xs.push_back(at::randn({4, 16}).to(at::kBFloat16));
        ys.push_back(at::randn({4, 8}).to(at::kBFloat16));
      }
      auto backward = [&](const at::Tensor& w, const at::Tensor& b, int k) {
        (at::matmul(xs[k], w) + b - ys[k]).to(at::kFloat).pow(2).mean().backward();
      };
      auto options_for = [&](const at::Tensor& w, const at::Tensor& b) {
        StepDriverOptions options;
        options.params = {Param{"w", w, 0}, Param{"b", b, 1}};
        options.rule = rule;
        options.weight_decay = 0.01;
        options.master_dtype = "bf16";
        options.seed = 11;
        return options;
      };
      TempDir swap;
      at::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      const offload::OffloadOptions offload = delayed_store(device, swap.str());
      auto driver = offload::make_offloaded_step_driver(options_for(w, b), offload);
      if (device == "nvme") {
        // The delayed update's own host copies, a step's gradients and its update's weights,
        // are both bf16 like the weights: 2 + 2 B per parameter beside the same store.
        TempDir plain_swap;
        offload::OffloadOptions plain = delayed_store(device, plain_swap.str());
        plain.delayed_update = false;
        at::Tensor pw = w0.clone().requires_grad_(true), pb = b0.clone().requires_grad_(true);
        const auto undelayed = offload::make_offloaded_step_driver(options_for(pw, pb), plain);
        EXPECT_EQ(driver->state_bytes() - undelayed->state_bytes(), (2 + 2) * (16 * 8 + 8));
      }
      // The reference: the model's weights (rw, rb) trail the core driver's own (mw, mb) by one
      // update; each step's gradients, taken at rw and rb before they catch up, go to mw, mb.
      at::Tensor rw = w0.clone().requires_grad_(true), rb = b0.clone().requires_grad_(true);
      at::Tensor mw = w0.clone().requires_grad_(true), mb = b0.clone().requires_grad_(true);
      auto reference = make_default_step_driver(options_for(mw, mb));
      for (int k = 0; k < 6; ++k) {
        const int64_t step = k + 1;
        const double lr = 1e-2 * (1.0 - 0.1 * k);
        driver->zero_grad();
        backward(w, b, k);
        driver->update(step, lr);
        // Step k's gradients at update k-2's weights; update k-1 reaches them; update k made.
        if (rw.grad().defined()) rw.mutable_grad().zero_();
        if (rb.grad().defined()) rb.mutable_grad().zero_();
        backward(rw, rb, k);
        {
          at::NoGradGuard no_grad;
          rw.copy_(mw);
          rb.copy_(mb);
        }
        mw.mutable_grad() = rw.grad().clone();
        mb.mutable_grad() = rb.grad().clone();
        reference->update(step, lr);
        EXPECT_TRUE(at::equal(w.detach(), rw.detach())) << "step " << step;
        EXPECT_TRUE(at::equal(b.detach(), rb.detach())) << "step " << step;
      }
      EXPECT_FALSE(at::equal(w.detach(), mw.detach())) << "the last update is still in flight";
      driver->synchronize();
      EXPECT_TRUE(at::equal(w.detach(), mw.detach())) << "after synchronize";
      EXPECT_TRUE(at::equal(b.detach(), mb.detach())) << "after synchronize";
    }
}

TEST(Offload, ResumesBitwiseFromItsOwnAndFromAnInMemoryCheckpoint) {
  const std::string bf16 = "\n[precision]\nmode = \"full_bf16\"\n";
  // Unsharded (stage 0) and ZeRO's driver (stage 3, and adafactor's reduction walks).
  for (const auto& [rule, stage] :
       {std::pair<std::string, std::string>{"adamw", "stage = 0\n"},
        {"adafactor", "stage = 3\nstage3_param_persistence_threshold = 0\n"}}) {
    SCOPED_TRACE(rule + " " + stage);
    TempDir whole_dir, memory_dir, resumed_dir, crossed_dir, swap;
    const auto whole = trained(
        job(whole_dir.str(), rule, stage + offload(swap.str()), "save_steps = 3\n") + bf16,
        whole_dir.path());
    // In memory and unsharded: the stage-3 job takes its shards from the whole weights.
    trained(job(memory_dir.str(), rule, "stage = 0\n", "save_steps = 3\n") + bf16,
            memory_dir.path());
    for (const auto& [dir, from] :
         {std::pair{&resumed_dir, whole_dir / "checkpoint-3"},
          std::pair{&crossed_dir, memory_dir / "checkpoint-3"}}) {
      SCOPED_TRACE(from.string());
      const auto resumed = trained(job(dir->str(), rule, stage + offload(swap.str()),
                                       "resume = \"" + from.string() + "\"\n") +
                                       bf16,
                                   dir->path());
      expect_bitwise(whole, resumed);
    }
  }
}

// A checkpoint of an offloaded run streams the state from the swap file a piece at a time: the
// tensors alive during the save stay a small part of the state it writes (unsharded at stage 0,
// ZeRO's pieces at stage 2); and the streamed checkpoint resumes bitwise (the case above).
TEST(Offload, CheckpointsStreamTheStateFromTheSwapFile) {
  memory::install_cpu_tracker();
  for (const std::string stage : {"stage = 0\n", "stage = 2\n"}) {
    SCOPED_TRACE(stage);
    TempDir dir, swap;
    std::string text = job(dir.str(), "adamw", stage + offload(swap.str()), "", 2);
    for (const auto& [from, to] : {std::pair<std::string, std::string>{"n_layer = 2", "n_layer = 8"},
                                   {"n_embd = 32", "n_embd = 96"}})
      text.replace(text.find(from), from.size(), to);
    auto trainer = Trainer::from_text(text, dir.path());
    trainer->setup();
    trainer->step();
    const int64_t state = 8 * trainer->engine().model_state().trainable_count;  // AdamW's m, v
    const int64_t before = memory::cpu_stats().current_bytes;
    memory::reset_cpu_peak();
    const std::string folder = trainer->save_checkpoint();
    const int64_t during = memory::cpu_stats().peak_bytes - before;
    EXPECT_LT(during, state / 8) << "the save held " << during << " B of tensors for "
                                 << state << " B of state";
    int64_t written = 0;
    for (const auto& entry : fs::directory_iterator(folder))
      if (entry.path().filename().string().rfind("optimizer", 0) == 0) written += fs::file_size(entry);
    EXPECT_GT(written, state) << "the optimizer file lacks state";
  }
}

TEST(Offload, BadOffloadKeysAreErrorsNamingThem) {
  TempDir dir, swap;
  auto setup = [&](const std::string& zero) {
    Trainer::from_text(job(dir.str(), "adamw", zero), dir.path())->setup();
  };
  EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"nvme\" }"), ConfigError,
                    "offload_optimizer", "needs nvme_path");
  EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"disk\", nvme_path = \"x\" }"),
                    ConfigError, "offload_optimizer.device", "\"nvme\"");
  EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"nvme\", nvme_path = \"" + swap.str() +
                          "\", buffer_count = 2 }"),
                    ConfigError, "buffer_count", "3 to 64");
  EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"nvme\", nvme_path = \"" + swap.str() +
                          "\", buffers = 4 }"),
                    ConfigError, "has no key 'buffers'");
  EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"nvme\", nvme_path = \"" + swap.str() +
                          "\", checksum_threads = 0 }"),
                    ConfigError, "checksum_threads 0", "between 1 and 64");
  EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"nvme\", nvme_path = \"" +
                          (swap / "missing").string() + "\" }"),
                    ConfigError, "nvme_path", (swap / "missing").string(), "not an existing folder");
  EXPECT_THROW_WITH(setup("offload_param = { device = \"nvme\" }"), ConfigError, "offload_param",
                    "needs nvme_path");
  EXPECT_THROW_WITH(setup("offload_param = { device = \"nvme\", nvme_path = \"" + swap.str() +
                          "\", size = 1 }"),
                    ConfigError, "offload_param has no key 'size'");
  EXPECT_THROW_WITH(setup("stage = 2\noffload_param = { device = \"nvme\", nvme_path = \"" +
                          swap.str() + "\" }"),
                    ConfigError, "offload_param", "stage 3's weight shards", "stage = 2");
  EXPECT_THROW_WITH(setup("stage = 3\nstage3_param_persistence_threshold = 0\n"
                          "offload_param = { device = \"nvme\", nvme_path = \"" + swap.str() +
                          "\" }"),
                    ConfigError, "offload_param", "half-precision", "full_bf16");
  EXPECT_TRUE(fs::is_empty(swap.path())) << "a refused job left a swap file";
  // device = "cpu" on a CPU run: the in-memory driver, said once.
  setup("offload_optimizer = { device = \"cpu\" }");
  setup("stage = 3\noffload_param = { device = \"cpu\" }");
  // ... but its twin (a GPU run's host store) is held to what a GPU run is held to.
  TwinScope twin;
  EXPECT_THROW_WITH(setup("stage = 3\nstage3_param_persistence_threshold = 0\n"
                          "offload_param = { device = \"cpu\" }"),
                    ConfigError, "offload_param", "half-precision", "full_bf16");
  EXPECT_THROW_WITH(setup("stage = 2\noffload_param = { device = \"cpu\" }"), ConfigError,
                    "offload_param", "stage 3's weight shards", "stage = 2");
}

// Note [Host store]: a host arena that cannot be allocated is an error naming its size and
// what to do — page-locked (this CPU-only process cannot pin: the same path as a GPU host out of
// page-locked memory) suggests pin_memory = false, pageable suggests NVMe — before any state is
// written. And offload_param with units that have no weight to shard is named.
TEST(Offload, HostMemoryThatCannotBeAllocatedIsNamed) {
  Schema schema("optimizer", "adamw");
  schema.key_float("beta1", 0.9, "").key_float("beta2", 0.999, "").key_float("eps", 1e-8, "")
      .key_float("weight_decay", 0.0, "").key_string("state_dtype", "fp32", "");
  const auto rule = make_adamw(ConfigSection("optimizer", {}, schema, "job.toml"));
  offload::SwapSegment huge;
  huge.name = "huge";
  huge.numel = int64_t{1} << 46;  // 256 TiB of fp32 master, 768 TiB with Adam's m and v
  huge.shape = {huge.numel};
  offload::OffloadOptions host;
  host.device = "cpu";
  host.pin_memory = true;
  EXPECT_THROW_WITH(offload::SegmentSwap(*rule, {huge}, host), ConfigError,
                    "offload_optimizer.device = \"cpu\": cannot allocate 768.00 TiB of "
                    "page-locked host memory", "set pin_memory = false");
  host.pin_memory = false;
  try {
    offload::SegmentSwap(*rule, {huge}, host);
    ADD_FAILURE() << "768 TiB of host memory were allocated";
  } catch (const ConfigError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("cannot allocate 768.00 TiB of host memory"), std::string::npos) << message;
    EXPECT_NE(message.find("use device = \"nvme\""), std::string::npos) << message;
    EXPECT_EQ(message.find("pin_memory"), std::string::npos) << message;
  }
  TempDir dir, swap;
  EXPECT_THROW_WITH(
      Trainer::from_text(job(dir.str(), "adamw",
                             "stage = 3\noffload_param = { device = \"nvme\", nvme_path = \"" +
                                 swap.str() + "\" }\n") +
                             "\n[precision]\nmode = \"full_bf16\"\n",
                         dir.path())
          ->setup(),
      ConfigError, "offload_param", "model 'gpt''s units", "none of its 2 units",
      "stage3_param_persistence_threshold = 100000", "lower stage3_param_persistence_threshold");
  EXPECT_TRUE(fs::is_empty(swap.path())) << "a refused job left a swap file";
  setenv("LOOM_OFFLOAD_CPU_STORE", "1", 1);  // the host store's twin: the same refusal
  EXPECT_THROW_WITH(Trainer::from_text(job(dir.str(), "adamw",
                                           "stage = 3\noffload_param = { device = \"cpu\" }\n") +
                                           "\n[precision]\nmode = \"full_bf16\"\n",
                                       dir.path())
                        ->setup(),
                    ConfigError, "offload_param", "none of its 2 units");
  unsetenv("LOOM_OFFLOAD_CPU_STORE");
}

// Note [Offloaded parameters]: stage 3 with the weights' shards on NVMe (and the optimizer state
// too, or not) trains bitwise like stage 3 in memory, for adamw and adafactor (its reduction
// walks); the resident shards are only those being gathered (none between steps); a resumed run
// (the shards streamed into and out of the checkpoint) is bitwise the uninterrupted one. The GPU
// path's staging, run on the CPU (Note [Parameter offload twin], LOOM_OFFLOAD_CPU_STORE=1): the
// shards in a host store of their own ("cpu") or on NVMe through staging buffers, each fetched
// as a separate copy a unit ahead on the worker and stored back from the masters there, train
// bitwise like memory too, and the "cpu" twin resumes bitwise from its own checkpoint; with the
// optimizer's host store too (a GPU job with everything in host memory) for adafactor and
// adam8bit as well.
TEST(Offload, ParameterShardsOnNvmeTrainBitwiseLikeMemory) {
  const std::string bf16 = "\n[precision]\nmode = \"full_bf16\"\n";
  const std::string stage3 = "stage = 3\nstage3_param_persistence_threshold = 0\n";
  auto params = [](const std::string& folder) {
    return "offload_param = { device = \"nvme\", nvme_path = \"" + folder +
           "\", block_size = 8192, queue_depth = 2 }\n";
  };
  const std::string host_optimizer = "offload_optimizer = { device = \"cpu\" }\n";
  // A staged twin run: bitwise `memory`, each unit fetched ahead twice a step, no fetched copy
  // left between steps; its weights.
  auto twin_run = [&](const std::string& zero, const fs::path& dir, const std::string& train_extra,
                      const std::map<std::string, at::Tensor>* memory,
                      const std::string& rule = "adamw") {
    TwinScope twin;
    auto trainer = Trainer::from_text(job(dir.string(), rule, zero, train_extra) + bf16, dir);
    trainer->setup();
    trainer->run();
    EXPECT_EQ(trainer->engine().step_driver().sharded_weight_bytes(), 0)
        << "fetched copies outlived their gathers";
    for (const auto& line : metric_lines(dir))
      EXPECT_NE(line.find("\"offload_param_reads_ahead\":4"), std::string::npos) << line;
    std::map<std::string, at::Tensor> weights;
    for (const auto& item : trainer->engine().model().named_parameters(true))
      weights[item.key()] = item.value().detach().to(at::kFloat).clone();
    if (memory) expect_bitwise(*memory, weights);
    return weights;
  };
  for (const std::string rule : {"adamw", "adafactor"})
    for (bool optimizer_too : {false, true}) {
      SCOPED_TRACE(rule + (optimizer_too ? " with the optimizer state offloaded" : ""));
      TempDir memory_dir, nvme_dir, swap;
      const auto memory = trained(job(memory_dir.str(), rule, stage3) + bf16, memory_dir.path());
      if (rule == "adamw" && !optimizer_too) {
        // The twins, their masters on the "device": every new shard goes home by the worker.
        TempDir host_dir, resumed_dir, staged_dir;
        SCOPED_TRACE("twin");
        const std::string host = stage3 + "offload_param = { device = \"cpu\" }\n";
        const auto whole = twin_run(host, host_dir.path(), "save_steps = 3\n", &memory);
        const auto resumed = twin_run(
            host, resumed_dir.path(),
            "resume = \"" + (host_dir.path() / "checkpoint-3").string() + "\"\n", nullptr);
        expect_bitwise(whole, resumed);
        twin_run(stage3 + params(swap.str()), staged_dir.path(), "", &memory);
        EXPECT_TRUE(fs::is_empty(swap.path())) << "a swap file outlived the run";
      }
      if (rule == "adafactor" && !optimizer_too) {
        // The twin of a GPU job with everything in host memory (the weight shards and the
        // optimizer's masters and state: examples/offload/one_gpu_llama_1b.toml), adafactor's
        // reduction walks over its host store.
        TempDir host_dir;
        twin_run(stage3 + "offload_param = { device = \"cpu\" }\n" + host_optimizer,
                 host_dir.path(), "", &memory, rule);
      }
      const std::string zero =
          stage3 + params(swap.str()) + (optimizer_too ? offload(swap.str()) : "");
      auto trainer = Trainer::from_text(job(nvme_dir.str(), rule, zero) + bf16, nvme_dir.path());
      trainer->setup();
      trainer->step();
      EXPECT_EQ(trainer->engine().step_driver().sharded_weight_bytes(), 0)
          << "weight shards stayed in memory between steps";
      trainer->run();
      // Every step read each unit's shard ahead of its gather, twice (forward and backward):
      // unit 0 as the step starts, unit 1 during unit 0's forward, unit 1 again as its forward
      // ends, unit 0 during unit 1's backward.
      const auto lines = metric_lines(nvme_dir.path());
      EXPECT_EQ(lines.size(), 6u);
      for (const auto& line : lines)
        EXPECT_NE(line.find("\"offload_param_reads_ahead\":4"), std::string::npos) << line;
      std::map<std::string, at::Tensor> nvme;
      for (const auto& item : trainer->engine().model().named_parameters(true))
        nvme[item.key()] = item.value().detach().to(at::kFloat).clone();
      expect_bitwise(memory, nvme);
      trainer.reset();
      EXPECT_TRUE(fs::is_empty(swap.path())) << "a swap file outlived the run";
    }
  {
    // ... and adam8bit's blocks, the third rule of the offload matrix.
    SCOPED_TRACE("adam8bit, everything in host memory (the twin)");
    TempDir memory_dir, host_dir;
    const auto memory = trained(job(memory_dir.str(), "adam8bit", stage3) + bf16, memory_dir.path());
    twin_run(stage3 + "offload_param = { device = \"cpu\" }\n" + host_optimizer,
             host_dir.path(), "", &memory, "adam8bit");
  }
  TempDir whole_dir, resumed_dir, swap;
  const std::string zero = stage3 + params(swap.str()) + offload(swap.str());
  const auto whole =
      trained(job(whole_dir.str(), "adamw", zero, "save_steps = 3\n") + bf16, whole_dir.path());
  const auto resumed = trained(
      job(resumed_dir.str(), "adamw", zero,
          "resume = \"" + (whole_dir / "checkpoint-3").string() + "\"\n") + bf16,
      resumed_dir.path());
  expect_bitwise(whole, resumed);
}

// Note [ZeRO without masters] with offload_param: stage 3's bf16 shards are their own masters,
// updated where they live by the walk over the offloaded state (read, widened, rounded back,
// sent home): bitwise stage 3 in memory without masters, on NVMe (the CPU's unstaged path) and
// in host stores staged as on a GPU (the twin), for adamw and adafactor (whose reading walks
// read each unit's shard once and leave none resident); no shard stays in memory between
// steps; a resume is bitwise; without an offloaded optimizer state it is refused by name.
TEST(Offload, ParameterShardsWithoutMastersTrainBitwiseLikeMemory) {
  const std::string bf16 = "\n[precision]\nmode = \"full_bf16\"\n";
  const std::string stage3 = "stage = 3\nstage3_param_persistence_threshold = 0\n";
  auto on_nvme = [&](const std::string& folder) {
    return stage3 + "offload_param = { device = \"nvme\", nvme_path = \"" + folder +
           "\", block_size = 8192, queue_depth = 2 }\n" + offload(folder);
  };
  const std::string in_host =
      stage3 + "offload_param = { device = \"cpu\" }\noffload_optimizer = { device = \"cpu\" }\n";
  // Trains `zero`, checks no shard stays resident between steps and every unit was read ahead
  // twice a step; the final weights.
  auto run = [&](const std::string& rule, const std::string& zero, const fs::path& dir,
                 const std::string& train_extra = "") {
    auto trainer = Trainer::from_text(
        with_master_dtype(job(dir.string(), rule, zero, train_extra) + bf16, "bf16"), dir);
    trainer->setup();
    trainer->step();
    EXPECT_EQ(trainer->engine().step_driver().sharded_weight_bytes(), 0)
        << "weight shards stayed in memory between steps";
    trainer->run();
    for (const auto& line : metric_lines(dir))
      EXPECT_NE(line.find("\"offload_param_reads_ahead\":4"), std::string::npos) << line;
    std::map<std::string, at::Tensor> weights;
    for (const auto& item : trainer->engine().model().named_parameters(true))
      weights[item.key()] = item.value().detach().to(at::kFloat).clone();
    return weights;
  };
  for (const std::string rule : {"adamw", "adafactor"}) {
    SCOPED_TRACE(rule);
    TempDir memory_dir, nvme_dir, host_dir, swap;
    const auto memory =
        trained(with_master_dtype(job(memory_dir.str(), rule, stage3) + bf16, "bf16"),
                memory_dir.path());
    expect_bitwise(memory, run(rule, on_nvme(swap.str()), nvme_dir.path()));
    EXPECT_TRUE(fs::is_empty(swap.path())) << "a swap file outlived the run";
    TwinScope twin;
    expect_bitwise(memory, run(rule, in_host, host_dir.path()));
  }
  TempDir whole_dir, resumed_dir, swap;
  const auto whole = run("adamw", on_nvme(swap.str()), whole_dir.path(), "save_steps = 3\n");
  expect_no_masters(whole_dir / "checkpoint-6");
  const auto resumed = run("adamw", on_nvme(swap.str()), resumed_dir.path(),
                           "resume = \"" + (whole_dir / "checkpoint-3").string() + "\"\n");
  expect_bitwise(whole, resumed);
  TempDir refused_dir;
  EXPECT_THROW_WITH(
      Trainer::from_text(
          with_master_dtype(job(refused_dir.str(), "adamw",
                                stage3 + "offload_param = { device = \"nvme\", nvme_path = \"" +
                                    swap.str() + "\" }\n") + bf16, "bf16"),
          refused_dir.path())
          ->setup(),
      ConfigError, "master_dtype", "offload_param", "offload_optimizer is not set");
  EXPECT_TRUE(test::list_files(refused_dir.path()).empty());
}

// Note [Delayed update]: the driver equals a reference written out here that applies each
// update one step late — step k's gradients taken at the weights of update k-2 and applied to
// masters that already hold update k-1 — bit for bit, for fp32 and bf16 weights, in the host
// store (the GPU path's, on the CPU) and on NVMe; synchronize() leaves every update applied.
TEST(Offload, DelayedUpdateAppliesEachUpdateOneStepLate) {
  Schema schema("optimizer", "adamw");
  schema.key_float("beta1", 0.9, "").key_float("beta2", 0.999, "").key_float("eps", 1e-8, "")
      .key_float("weight_decay", 0.0, "").key_string("state_dtype", "fp32", "");
  const auto rule = make_adamw(ConfigSection("optimizer", {}, schema, "job.toml"));
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (const std::string device : {"cpu", "nvme"}) {
      SCOPED_TRACE(std::string(dtype == at::kFloat ? "fp32 " : "bf16 ") + device);
      at::manual_seed(3);
      const at::Tensor w0 = at::randn({16, 8}).to(dtype), b0 = at::randn({8}).to(dtype);
      std::vector<at::Tensor> xs, ys;
      for (int k = 0; k < 6; ++k) {
        xs.push_back(at::randn({4, 16}).to(dtype));
        ys.push_back(at::randn({4, 8}).to(dtype));
      }
      // The loss of step k at the given weights; backward fills their gradients.
      auto backward = [&](const at::Tensor& w, const at::Tensor& b, int k) {
        (at::matmul(xs[k], w) + b - ys[k]).to(at::kFloat).pow(2).mean().backward();
      };
      // The driver under test.
      TempDir swap;
      at::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      StepDriverOptions options;
      options.params = {Param{"w", w, 0}, Param{"b", b, 1}};
      options.rule = rule.get();
      options.weight_decay = 0.01;
      const offload::OffloadOptions offload = delayed_store(device, swap.str());
      auto driver = offload::make_offloaded_step_driver(options, offload);
      // The reference: fp32 masters updated by the same rule, the weights set from them one
      // update late.
      at::Tensor rw = w0.clone().requires_grad_(true), rb = b0.clone().requires_grad_(true);
      std::vector<Segment> masters(2);
      const std::vector<at::Tensor*> weights = {&rw, &rb};
      for (int i = 0; i < 2; ++i) {
        Segment& m = masters[i];
        m.name = i == 0 ? "w" : "b";
        m.param = weights[i]->detach().to(at::kFloat).reshape(-1).clone();
        m.shape = weights[i]->sizes().vec();
        m.group = i;
        m.state = rule->init_state(m);
      }
      for (int k = 0; k < 6; ++k) {
        const int64_t step = k + 1;
        const double lr = 1e-2 * (1.0 - 0.1 * k);  // a schedule: each update keeps its own lr
        driver->zero_grad();
        backward(w, b, k);
        driver->update(step, lr);
        // Reference: update k-1 reaches the weights, then update k is made on the masters.
        backward(rw, rb, k);
        for (int i = 0; i < 2; ++i) {
          at::NoGradGuard no_grad;
          weights[i]->detach().copy_(masters[i].param.view(weights[i]->sizes()));
          masters[i].grad = weights[i]->grad().to(at::kFloat).reshape(-1).clone();
          weights[i]->grad().zero_();
          update_tensor(*rule, {&masters[i]},
                        update_context(options.params[i], step, lr, options.weight_decay));
        }
        EXPECT_TRUE(at::equal(w.detach(), rw.detach())) << "step " << step;
        EXPECT_TRUE(at::equal(b.detach(), rb.detach())) << "step " << step;
        if (k == 0) EXPECT_TRUE(at::equal(w.detach(), w0)) << "the first update ran at once";
      }
      driver->synchronize();
      for (int i = 0; i < 2; ++i) {
        const at::Tensor expected =
            masters[i].param.view(weights[i]->sizes()).to(dtype);
        EXPECT_TRUE(at::equal((i == 0 ? w : b).detach(), expected)) << "after synchronize";
      }
    }
}

// Note [Overlapped update]: the driver alone. Each gradient handed over as final starts its
// update at once, on the worker thread: the weights change before update() is called (it only
// waits), and equal the in-memory driver's bit for bit, fp32 (updated in place) and bf16 (fp32
// masters in the host store) alike; a step whose update ran during backward and then was not
// finished by update() (a plugin skipped it) is refused by the next zero_grad, by name.
TEST(Offload, OverlappedUpdateRunsAsEachGradientIsFinal) {
  TwinScope twin;
  Schema schema("optimizer", "adamw");
  schema.key_float("beta1", 0.9, "").key_float("beta2", 0.999, "").key_float("eps", 1e-8, "")
      .key_float("weight_decay", 0.0, "").key_string("state_dtype", "fp32", "");
  const auto rule = make_adamw(ConfigSection("optimizer", {}, schema, "job.toml"));
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(dtype == at::kFloat ? "fp32" : "bf16");
    at::manual_seed(5);
    const at::Tensor w0 = at::randn({16, 8}).to(dtype), b0 = at::randn({8}).to(dtype);
    const at::Tensor x = at::randn({4, 16}).to(dtype), y = at::randn({4, 8}).to(dtype);
    auto make = [&](at::Tensor& w, at::Tensor& b, bool offloaded) {
      w = w0.clone().requires_grad_(true);
      b = b0.clone().requires_grad_(true);
      StepDriverOptions options;
      options.params = {Param{"w", w, 0}, Param{"b", b, 1}};
      options.rule = rule.get();
      options.weight_decay = 0.01;
      offload::OffloadOptions host;
      host.device = "cpu";
      return offloaded ? std::unique_ptr<StepDriver>(offload::make_offloaded_step_driver(options, host))
                       : make_default_step_driver(options);
    };
    auto backward = [&](const at::Tensor& w, const at::Tensor& b) {
      (at::matmul(x, w) + b - y).to(at::kFloat).pow(2).mean().backward();
    };
    at::Tensor w, b, rw, rb;
    auto driver = make(w, b, true);
    auto reference = make(rw, rb, false);
    auto* overlapped = dynamic_cast<offload::OffloadedStepDriver*>(driver.get());
    ASSERT_TRUE(overlapped && overlapped->overlaps_backward());
    for (int64_t step = 1; step <= 3; ++step) {
      const double lr = 1e-2 / static_cast<double>(step);
      driver->zero_grad();
      backward(w, b);
      const at::Tensor before = w.detach().clone();
      overlapped->grad_final(w, /*update_now=*/true, step, lr);
      // Nothing but the worker thread can change w now; give it up to 10 s.
      for (int i = 0; i < 10000 && at::equal(w.detach(), before); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_FALSE(at::equal(w.detach(), before)) << "step " << step << ": w not updated "
                                                     "before update() was called";
      overlapped->grad_final(b, true, step, lr);
      reference->zero_grad();
      backward(rw, rb);
      EXPECT_EQ(driver->grad_norm_squared().item<double>(),
                reference->grad_norm_squared().item<double>());
      driver->update(step, lr);
      EXPECT_EQ(overlapped->last_stats().updated_in_backward, 2);
      reference->update(step, lr);
      EXPECT_TRUE(at::equal(w.detach(), rw.detach())) << "step " << step;
      EXPECT_TRUE(at::equal(b.detach(), rb.detach())) << "step " << step;
    }
    // An update applied during backward, then skipped: the next step refuses to go on.
    driver->zero_grad();
    backward(w, b);
    overlapped->grad_final(w, true, 4, 1e-3);
    EXPECT_THROW_WITH(driver->zero_grad(), Error, "step 4", "update was skipped",
                      "overlapped update had applied it during backward");
  }
}

// Note [Overlapped update] through the engine, one rank: the host store's twin trains bitwise
// like memory for every rule, fp32 and bf16, with clipping (the update waits for the norm:
// no segment updated during backward) and without (every tensor's update started during
// backward), and with gradient accumulation (only the last micro-step's gradients are final);
// a run resumed from its checkpoint is bitwise the one that went on; overlap_update = false
// updates after backward, and a bad value of it is named.
TEST(Offload, OverlappedHostStoreTrainsBitwiseLikeMemory) {
  TwinScope twin;
  const std::string host = "stage = 0\noffload_optimizer = { device = \"cpu\" }\n";
  const std::string bf16 = "\n[precision]\nmode = \"full_bf16\"\n";
  auto updated_in_backward = [](const fs::path& dir) {
    std::vector<double> out;
    for (const auto& line : metric_lines(dir)) {
      const std::string key = "\"offload_updated_in_backward\":";
      const auto at = line.find(key);
      out.push_back(at == std::string::npos ? -1 : std::stod(line.substr(at + key.size())));
    }
    return out;
  };
  // Every rule without clipping; clipping and accumulation once each (the clipped path for
  // every rule is HostStoreTwinTrainsBitwiseLikeMemory's: its jobs clip at 1.0).
  struct Case {
    std::string rule, precision, train;
  };
  std::vector<Case> cases;
  for (const std::string rule : {"adamw", "adafactor", "adam8bit"})
    for (const std::string precision : {std::string(), bf16})
      cases.push_back({rule, precision, "max_grad_norm = 0\n"});
  cases.push_back({"adamw", bf16, "max_grad_norm = 0.5\n"});
  cases.push_back({"adamw", "", "max_grad_norm = 0\ngradient_accumulation_steps = 2\n"});
  for (const auto& [rule, precision, train] : cases) {
    SCOPED_TRACE(rule + (precision.empty() ? " fp32 " : " bf16 ") + train);
    TempDir memory_dir, host_dir;
    const auto memory = trained(job(memory_dir.str(), rule, "stage = 0\n", train) + precision,
                                memory_dir.path());
    double tensors = 0;
    expect_bitwise(memory, trained(job(host_dir.str(), rule, host, train) + precision,
                                   host_dir.path(), &tensors));
    const bool clips = train.find("0.5") != std::string::npos;
    const auto counts = updated_in_backward(host_dir.path());
    EXPECT_EQ(counts.size(), 6u);
    for (double count : counts) EXPECT_EQ(count, clips ? 0.0 : tensors);
  }
  // overlap_update = false: the update after backward, as before the overlap; the same bits.
  {
    TempDir memory_dir, after_dir;
    const std::string train = "max_grad_norm = 0\n";
    const auto memory = trained(job(memory_dir.str(), "adamw", "stage = 0\n", train) + bf16,
                                memory_dir.path());
    const auto after = trained(
        job(after_dir.str(), "adamw",
            "stage = 0\noffload_optimizer = { device = \"cpu\", overlap_update = false }\n",
            train) + bf16,
        after_dir.path());
    expect_bitwise(memory, after);
    for (double count : updated_in_backward(after_dir.path())) EXPECT_EQ(count, -1.0);
    auto setup = [&](const std::string& zero) {
      Trainer::from_text(job(after_dir.str(), "adamw", zero), after_dir.path())->setup();
    };
    EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"cpu\", overlap_update = 1 }"),
                      ConfigError, "offload_optimizer.overlap_update must be true or false");
    EXPECT_THROW_WITH(setup("stage = 3\noffload_param = { device = \"cpu\", "
                            "overlap_update = true }"),
                      ConfigError, "offload_param.overlap_update", "set it in offload_optimizer");
  }
  TempDir whole_dir, resumed_dir;
  const std::string train = "max_grad_norm = 0\n";
  const auto whole = trained(
      job(whole_dir.str(), "adam8bit", host, train + "save_steps = 3\n") + bf16, whole_dir.path());
  const auto resumed = trained(
      job(resumed_dir.str(), "adam8bit", host,
          train + "resume = \"" + (whole_dir / "checkpoint-3").string() + "\"\n") + bf16,
      resumed_dir.path());
  expect_bitwise(whole, resumed);
}

// A delayed-update run resumed from its checkpoint (saved with no update in flight) is bitwise
// the run that went on, whose final weights hold its last update; its checkpoint holds no fp32
// masters of fp32 weights, so an in-memory job resumes from it; bad delayed_update settings
// are named.
TEST(Offload, DelayedUpdateResumesBitwiseAndBadSettingsAreNamed) {
  TempDir whole_dir, resumed_dir, swap, plain_dir;
  const std::string delayed = "stage = 0\noffload_optimizer = { device = \"nvme\", nvme_path = \"" +
                              swap.str() + "\", block_size = 8192, delayed_update = true }\n";
  const auto whole =
      trained(job(whole_dir.str(), "adamw", delayed, "save_steps = 3\n"), whole_dir.path());
  const auto resumed = trained(
      job(resumed_dir.str(), "adamw", delayed,
          "resume = \"" + (whole_dir / "checkpoint-3").string() + "\"\n"),
      resumed_dir.path());
  expect_bitwise(whole, resumed);
  // Not the plain run: the updates did land late.
  const auto plain = trained(job(plain_dir.str(), "adamw", "stage = 0\n"), plain_dir.path());
  EXPECT_FALSE(at::equal(whole.begin()->second, plain.at(whole.begin()->first)));
  EXPECT_TRUE(fs::is_empty(swap.path())) << "the swap file outlived the run";
  // Note [Offloaded without masters]: fp32 weights are their own masters' bits after a save's
  // synchronize, so the checkpoint holds none, and an in-memory job resumes from it.
  expect_no_masters(whole_dir / "checkpoint-3");
  TempDir in_memory_dir;
  const auto in_memory = trained(
      job(in_memory_dir.str(), "adamw", "stage = 0\n",
          "resume = \"" + (whole_dir / "checkpoint-3").string() + "\"\n"),
      in_memory_dir.path());
  EXPECT_EQ(in_memory.size(), whole.size());

  TempDir dir;
  auto setup = [&](const std::string& zero, const std::string& train = "") {
    Trainer::from_text(job(dir.str(), "adamw", zero, train), dir.path())->setup();
  };
  EXPECT_THROW_WITH(setup("stage = 2\noffload_optimizer = { device = \"cpu\", "
                          "delayed_update = true }"),
                    ConfigError, "delayed_update", "stage 0", "not stage 2");
  EXPECT_THROW_WITH(setup("stage = 0\noffload_optimizer = { delayed_update = true }"),
                    ConfigError, "delayed_update", "device is \"none\"");
  EXPECT_THROW_WITH(setup("stage = 0\noffload_optimizer = { device = \"cpu\", "
                          "delayed_update = 1 }"),
                    ConfigError, "offload_optimizer.delayed_update must be true or false");
  EXPECT_THROW_WITH(setup("stage = 3\noffload_param = { device = \"cpu\", "
                          "delayed_update = true }"),
                    ConfigError, "offload_param.delayed_update", "set it in offload_optimizer");
  // The one update that cannot be delayed: one already moved into backward. Schedules,
  // clipping and fp16's skip delay as they are (Note [Delayed update]).
  EXPECT_THROW_WITH(setup("stage = 0\noffload_optimizer = { device = \"cpu\", "
                          "delayed_update = true }",
                          "optimizer_in_backward = true\nmax_grad_norm = 0\n"),
                    ConfigError, "offload_optimizer.delayed_update", "optimizer_in_backward",
                    "choose one");
}

}  // namespace
}  // namespace loom
