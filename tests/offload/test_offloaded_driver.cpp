// Optimizer state offloaded to NVMe ([zero] offload_optimizer, loom/offload/offloaded_driver.h):
// the final weights equal the in-memory run's bit for bit for adamw, adafactor and adam8bit, fp32
// and bf16 weights, stage 0 and stage 2 on one rank; a resumed offloaded run is bitwise the
// uninterrupted one, from its own checkpoint and from an in-memory run's; the swap file is gone
// after the run; bad offload keys are errors naming them.
#include <ATen/ATen.h>

#include <filesystem>
#include <map>

#include "loom/engine.h"
#include "loom/model.h"
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

std::map<std::string, at::Tensor> trained(const std::string& text, const fs::path& dir) {
  auto trainer = Trainer::from_text(text, dir);
  trainer->setup();
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

TEST(Offload, NvmeOptimizerStateTrainsBitwiseLikeMemory) {
  for (const std::string rule : {"adamw", "adafactor", "adam8bit"})
    for (const std::string precision : {"", "\n[precision]\nmode = \"full_bf16\"\n"})
      for (const std::string stage : {"stage = 0\n", "stage = 2\n"}) {
        SCOPED_TRACE(rule + (precision.empty() ? " fp32 " : " bf16 ") + stage);
        TempDir memory_dir, nvme_dir, swap;
        const auto memory = trained(job(memory_dir.str(), rule, stage) + precision,
                                    memory_dir.path());
        const auto nvme = trained(job(nvme_dir.str(), rule, stage + offload(swap.str())) +
                                      precision,
                                  nvme_dir.path());
        expect_bitwise(memory, nvme);
        EXPECT_TRUE(fs::is_empty(swap.path())) << "the swap file outlived the run";
      }
}

TEST(Offload, ResumesBitwiseFromItsOwnAndFromAnInMemoryCheckpoint) {
  TempDir whole_dir, memory_dir, resumed_dir, crossed_dir, swap;
  const std::string bf16 = "\n[precision]\nmode = \"full_bf16\"\n";
  const auto whole = trained(
      job(whole_dir.str(), "adamw", offload(swap.str()), "save_steps = 3\n") + bf16,
      whole_dir.path());
  trained(job(memory_dir.str(), "adamw", "stage = 0\n", "save_steps = 3\n") + bf16,
          memory_dir.path());
  for (const auto& [dir, from] :
       {std::pair{&resumed_dir, whole_dir / "checkpoint-3"},
        std::pair{&crossed_dir, memory_dir / "checkpoint-3"}}) {
    SCOPED_TRACE(from.string());
    const auto resumed = trained(
        job(dir->str(), "adamw", offload(swap.str()), "resume = \"" + from.string() + "\"\n") +
            bf16,
        dir->path());
    expect_bitwise(whole, resumed);
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
  EXPECT_THROW_WITH(setup("offload_optimizer = { device = \"nvme\", nvme_path = \"" +
                          (swap / "missing").string() + "\" }"),
                    ConfigError, "nvme_path", (swap / "missing").string(), "not an existing folder");
  EXPECT_THROW_WITH(setup("stage = 3\noffload_optimizer = { device = \"nvme\", nvme_path = \"" +
                          swap.str() + "\" }"),
                    ConfigError, "offload_optimizer", "stage 3", "not implemented yet");
  EXPECT_THROW_WITH(setup("offload_param = { device = \"nvme\" }"), ConfigError, "offload_param",
                    "not implemented yet");
  // device = "cpu" on a CPU run: the in-memory driver, said once.
  setup("offload_optimizer = { device = \"cpu\" }");
}

}  // namespace
}  // namespace loom
