// Note [DeepSpeed config files]: a ds_config.json shaped like DeepSpeed's and transformers'
// documented examples resolves to the very job written in loom's own keys (same config hash)
// and trains to the same weights bit for bit; DeepSpeed's schedulers give DeepSpeed's rate at
// every update; what loom lacks, a file that is not JSON and a batch that does not add up are
// errors naming the keys.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "loom/trainer.h"
#include "job_text.h"

namespace loom {
namespace {

using test::TempDir;

using test::config_hash_of;

std::string job(const std::string& out, const std::string& train_extra, const std::string& tables) {
  return test::tiny_gpt_job_with(out, train_extra, tables);
}

void write(const std::filesystem::path& file, const std::string& text) {
  std::ofstream(file) << text;
}

// The safetensors files of a run's newest checkpoint, by name, as bytes.
std::map<std::string, std::string> final_weights(const std::filesystem::path& out) {
  std::filesystem::path newest;
  int64_t best = -1;
  for (const auto& entry : std::filesystem::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("checkpoint-", 0) != 0) continue;
    const int64_t step = std::stoll(name.substr(11));
    if (step > best) best = step, newest = entry.path();
  }
  std::map<std::string, std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(newest))
    if (entry.path().extension() == ".safetensors")
      files[entry.path().lexically_relative(newest).string()] = test::read_text(entry.path());
  EXPECT_FALSE(files.empty()) << "no weights in " << newest;
  return files;
}

// Both jobs resolve to one config hash and train to the same bytes.
void expect_same_job_and_weights(const std::string& deepspeed_job, const std::string& loom_job,
                                 const std::filesystem::path& ds_dir,
                                 const std::filesystem::path& loom_dir,
                                 const std::vector<std::string>& lines) {
  auto ds = Trainer::from_text(deepspeed_job, ds_dir);
  auto own = Trainer::from_text(loom_job, loom_dir);
  const std::string described = ds->describe();
  EXPECT_EQ(config_hash_of(described), config_hash_of(own->describe())) << described;
  for (const auto& line : lines)
    EXPECT_NE(described.find(line), std::string::npos) << "no line '" << line << "':\n"
                                                       << described;
  const double ds_loss = ds->run().final_loss, own_loss = own->run().final_loss;
  EXPECT_EQ(ds_loss, own_loss);
  EXPECT_EQ(final_weights(ds_dir / "out"), final_weights(loom_dir / "out"));
}

// transformers' documented ZeRO-2 example (docs "DeepSpeed", ZeRO-2 config), its optimizer
// state sent to NVMe: "auto" everywhere the Trainer decides.
TEST(DeepSpeedConfig, Zero2WithNvmeOffloadIsTheLoomKeyedJob) {
  TempDir a, b;
  write(a / "ds_config.json", R"({
    "bf16": { "enabled": "auto" },
    "optimizer": { "type": "AdamW",
                   "params": { "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto" } },
    "scheduler": { "type": "WarmupDecayLR",
                   "params": { "total_num_steps": "auto", "warmup_min_lr": "auto",
                               "warmup_max_lr": "auto", "warmup_num_steps": "auto" } },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": { "device": "nvme", "nvme_path": ")" +
                                  a.str() + R"(/nvme",
                               "pin_memory": true, "buffer_count": 4 },
        "allgather_partitions": true, "allgather_bucket_size": 2e8, "overlap_comm": true,
        "reduce_scatter": true, "reduce_bucket_size": 2e8, "contiguous_gradients": true },
    "aio": { "block_size": 262144, "queue_depth": 4, "thread_count": 1,
             "single_submit": false, "overlap_events": true },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
  })");
  std::filesystem::create_directories(a / "nvme");
  const std::string train = "bf16 = true\nweight_decay = 0.01\ndeepspeed = \"ds_config.json\"\n";
  const std::string own_train =
      "lr_scheduler_type = \"ds_warmup_decay_lr\"\n"
      "lr_scheduler_kwargs = { warmup_type = \"log\", warmup_min_lr = 0.0 }\n";
  const std::string own_tables =
      "[precision]\nmode = \"full_bf16\"\n[optimizer]\nname = \"adamw\"\nweight_decay = 0.01\n"
      "[zero]\nstage = 2\nallgather_bucket_size = 2e8\noverlap_comm = true\n"
      "reduce_bucket_size = 2e8\noffload_optimizer = { device = \"nvme\", nvme_path = \"" +
      a.str() +
      "/nvme\", pin_memory = true, buffer_count = 4, block_size = 262144, "
      "queue_depth = 4 }\n";
  // output_dir is not in the config hash; one NVMe folder serves both runs, one after the other.
  const std::string ds_job = job((a / "out").string(), train, "");
  const std::string own_job = job((b / "out").string(), own_train, own_tables);
  expect_same_job_and_weights(
      ds_job, own_job, a.path(), b.path(),
      {"DeepSpeed's bf16 keeps the weights in bf16",
       "zero_optimization.stage = 2 -> [zero] stage = 2",
       "zero_optimization.offload_optimizer -> [zero] offload_optimizer = { device = \"nvme\"",
       "optimizer.params.lr = \"auto\": the job's [train] learning_rate",
       "warning: ", "zero_optimization.contiguous_gradients changes nothing in loom",
       "steps_per_print changes nothing in loom", "aio.thread_count changes nothing in loom",
       "offload_param checksum_threads"});
}

// transformers' documented ZeRO-3 example with CPU offload (which changes nothing on a CPU run)
// and HF's hidden-size "auto" for the bucket sizes; the loss scaler of DeepSpeed's fp16.
TEST(DeepSpeedConfig, Zero3WithCpuOffloadIsTheLoomKeyedJob) {
  TempDir a, b;
  const std::string ds_file = R"({
    "fp16": { "enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
              "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1 },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": { "device": "cpu", "pin_memory": true },
        "offload_param": { "device": "cpu", "pin_memory": true },
        "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true },
    "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4
  })";
  for (const auto* dir : {&a, &b}) write(*dir / "ds.json", ds_file);
  const std::string ds_train = "fp16 = true\ndeepspeed = \"ds.json\"\n";
  const std::string own_train = "gradient_accumulation_steps = 2\nmax_grad_norm = 0.5\n";
  const std::string own_tables =
      "[precision]\nmode = \"full_fp16\"\ninit_scale = 65536.0\ngrowth_interval = 1000\n"
      "hysteresis = 2\nconsecutive_hysteresis = false\nmin_scale = 1.0\n"
      "[zero]\nstage = 3\noffload_optimizer = { device = \"cpu\", pin_memory = true }\n"
      "offload_param = { device = \"cpu\", pin_memory = true }\noverlap_comm = true\n"
      "reduce_bucket_size = 1024.0\nstage3_prefetch_bucket_size = 921.0\n"
      "stage3_param_persistence_threshold = 320.0\nstage3_max_live_parameters = 1e9\n";
  // tiny_gpt_job's per_device_train_batch_size = 4 agrees with the file's micro-batch.
  expect_same_job_and_weights(job((a / "out").string(), ds_train, ""),
                              job((b / "out").string(), own_train, own_tables), a.path(), b.path(),
                              {"reduce_bucket_size = \"auto\": from the hidden size 32",
                               "train_batch_size = 8 = 4 x 2 x 1 ranks",
                               "train_micro_batch_size_per_gpu = 4 agrees with the job's [train] "
                               "per_device_train_batch_size",
                               "sub_group_size changes nothing in loom"});
}

// DeepSpeed's low-precision options (its bf16_master_weight example's bf16_full.json, less its
// torch_autocast, which loom refuses beside bf16 weights): bf16_master_weights_and_grads and
// bf16_optimizer_states are [optimizer] master_dtype and state_dtype = "bf16" (Note [ZeRO
// without masters]); the same job and bytes as loom's own keys at stage 3.
TEST(DeepSpeedConfig, Bf16MasterWeightsAndOptimizerStatesAreLoomsBf16Keys) {
  TempDir a, b;
  write(a / "ds.json", R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
                                   "bf16_optimizer_states": true},
                          "zero_optimization": {"stage": 3, "reduce_bucket_size": 1e5}})");
  const std::string own_tables =
      "[precision]\nmode = \"full_bf16\"\n[optimizer]\nmaster_dtype = \"bf16\"\n"
      "state_dtype = \"bf16\"\n[zero]\nstage = 3\nreduce_bucket_size = 1e5\n";
  expect_same_job_and_weights(job((a / "out").string(), "deepspeed = \"ds.json\"\n", ""),
                              job((b / "out").string(), "", own_tables), a.path(), b.path(),
                              {"bf16.bf16_master_weights_and_grads = true -> [optimizer] "
                               "master_dtype = \"bf16\"",
                               "bf16.bf16_optimizer_states = true -> [optimizer] state_dtype = "
                               "\"bf16\""});
}

// MiCS's shard groups are [zero] shard_group_size (Note [Hybrid sharding]); one rank here, a
// group of 1 (tests/distributed/hsdp_test.sh runs the groups on 4 ranks).
TEST(DeepSpeedConfig, MicsShardSizeIsTheShardGroupSize) {
  TempDir a, b;
  write(a / "ds.json",
        R"({"zero_optimization": {"stage": 3, "mics_shard_size": 1, "reduce_bucket_size": 1e5}})");
  const std::string own_tables =
      "[zero]\nstage = 3\nshard_group_size = 1\nreduce_bucket_size = 1e5\n";
  expect_same_job_and_weights(job((a / "out").string(), "deepspeed = \"ds.json\"\n", ""),
                              job((b / "out").string(), "", own_tables), a.path(), b.path(),
                              {"zero_optimization.mics_shard_size = 1 -> [zero] shard_group_size = 1"});
}

// `loom run --deepspeed FILE` is [train] deepspeed = FILE; --set still has the last word.
TEST(DeepSpeedConfig, TheFileCanComeFromTheCommandLineAndSetOverridesIt) {
  TempDir dir;
  write(dir / "ds.json", R"({ "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.25 })");
  // The file sets the micro-batch, so the job leaves it out.
  auto without_batch = [&](const std::string& train_extra) {
    std::string text = job(dir.str(), train_extra, "");
    return text.erase(text.find("per_device_train_batch_size = 4\n"), 32);
  };
  auto from_cli = Trainer::from_text(without_batch(""), dir.path(),
                                     {"train.deepspeed='" + (dir / "ds.json").string() + "'"});
  auto own = Trainer::from_text(
      without_batch("max_grad_norm = 0.25\nper_device_train_batch_size = 2"), dir.path());
  EXPECT_EQ(config_hash_of(from_cli->describe()), config_hash_of(own->describe()));
  // --set replaces what the file said (the file is read first).
  auto overridden = Trainer::from_text(without_batch("deepspeed = \"ds.json\""), dir.path(),
                                       {"train.per_device_train_batch_size=4"});
  auto plain = Trainer::from_text(job(dir.str(), "max_grad_norm = 0.25", ""), dir.path());
  EXPECT_EQ(config_hash_of(overridden->describe()), config_hash_of(plain->describe()));
}

// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR: the rate of every update of a run
// equals the schedulers' as DeepSpeed's engine drives them (the constructor sets the first
// update's rate from iteration -1; step() after each update), their formulas written out here.
TEST(DeepSpeedConfig, SchedulersGiveDeepSpeedsRateAtEveryUpdate) {
  constexpr int kSteps = 12;
  struct Case {
    std::string name, params, python;
  };
  const std::vector<Case> cases = {
      {"warmup_log",
       R"({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 0.01, "warmup_num_steps": 5}})",
       "WarmupLR(1e-4, 0.01, 5, 'log')"},
      {"warmup_linear",
       R"({"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}})",
       "WarmupLR(0.0, 0.01, 4, 'linear')"},
      {"decay",
       R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 12, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3, "warmup_type": "linear"}})",
       "WarmupDecayLR(12, 0.001, 0.01, 3, 'linear')"},
      {"decay_one_step_warmup",
       R"({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_max_lr": 0.01, "warmup_num_steps": 1}})",
       "WarmupDecayLR(12, 0.0, 0.01, 1, 'log')"},
      {"cosine",
       R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}})",
       "WarmupCosineLR(0.01, 12, 0.1, 4, 0.05, 'log')"},
  };
  std::string script = R"(
import math
class WarmupLR:
    def __init__(self, lo, hi, warmup, kind):
        self.lo, self.hi, self.w, self.kind, self.i = lo, hi, max(2, warmup), kind, -1
    def gamma(self):
        if self.i < self.w:
            return math.log(self.i + 1) / math.log(self.w) if self.kind == 'log' else self.i / self.w
        return 1.0
    def lr(self):
        return self.lo if self.i < 0 else self.lo + (self.hi - self.lo) * self.gamma()
class WarmupDecayLR(WarmupLR):
    def __init__(self, total, lo, hi, warmup, kind):
        super().__init__(lo, hi, warmup, kind)
        self.total = total
    def gamma(self):
        if self.i < self.w:
            return super().gamma()
        return max(0.0, (self.total - self.i) / max(1.0, self.total - self.w))
class WarmupCosineLR:
    def __init__(self, lr, total, r0, warmup, rc, kind):
        self.base, self.total, self.r0, self.w, self.rc, self.kind, self.i = lr, total, r0, max(2, warmup), rc, kind, -1
    def lr(self):
        if self.i < 0:
            return 0.0
        if self.i < self.w:
            g = math.log(self.i + 1) / math.log(self.w) if self.kind == 'log' else self.i / self.w
            return self.base * (self.r0 + g * (1 - self.r0))
        wave = (1 + math.cos(math.pi * (self.i - self.w + 1) / (self.total - self.w))) / 2
        return self.base * max(0.0, self.rc + (1 - self.rc) * wave)
def rates(s):
    out = []
    for _ in range()" + std::to_string(kSteps) +
                       R"():
        out.append(s.lr()); s.i += 1
    return out
)";
  for (const Case& c : cases)
    script += "print('" + c.name + "', *[repr(r) for r in rates(" + c.python + ")])\n";
  const auto reference = test::named_numbers(test::run_python(script));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    write(dir / "ds.json", "{\"scheduler\": " + c.params + "}");
    std::string text = job(dir.str(), "deepspeed = \"ds.json\"\nsave_final = false", "");
    text.replace(text.find("max_steps = 4"), 13, "max_steps = " + std::to_string(kSteps));
    Trainer::from_text(text, dir.path())->run();
    std::ifstream in(dir / "metrics.jsonl");
    std::vector<double> rates;
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) rates.push_back(nlohmann::json::parse(line).at("lr").get<double>());
    const auto& expected = reference.at(c.name);
    ASSERT_EQ(rates.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(expected.size(), rates.size());
    for (size_t i = 0; i < rates.size(); ++i)
      EXPECT_DOUBLE_EQ(rates[i], expected[i]) << "update " << i;
  }
}

TEST(DeepSpeedConfig, BadFilesAndWhatLoomLacksAreErrorsNamingTheKey) {
  TempDir dir;
  auto refused = [&](const std::string& file_text, const std::string& train_extra,
                     const std::vector<std::string>& parts) {
    write(dir / "ds.json", file_text);
    try {
      Trainer::from_text(job((dir / "out").string(), "deepspeed = \"ds.json\"\n" + train_extra, ""),
                         dir.path());
      ADD_FAILURE() << "accepted: " << file_text;
    } catch (const ConfigError& error) {
      const std::string message = error.what();
      for (const auto& part : parts)
        EXPECT_NE(message.find(part), std::string::npos) << "lacks \"" << part << "\": " << message;
    }
    EXPECT_FALSE(std::filesystem::exists(dir / "out")) << "wrote output for: " << file_text;
  };
  refused("{\n  \"zero_optimization\": {\n    \"stage\": 2,,\n  }\n}", "",
          {"ds.json:3:16: not JSON"});
  refused(
      R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})",
      "",
      {"train_batch_size = 64 but train_micro_batch_size_per_gpu (4) x "
       "gradient_accumulation_steps (2) x world size 1 = 8"});
  refused(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})", "",
          {"train_batch_size = 10 is not a multiple of train_micro_batch_size_per_gpu (4)"});
  refused(R"({"gradient_accumulation_steps": "two"})", "",
          {"ds.json: gradient_accumulation_steps takes an integer, not a string"});
  refused(R"({"zero_optimization": {"stage": 2, "overlap_com": true}})", "",
          {"zero_optimization.overlap_com: not a key of DeepSpeed's zero_optimization",
           "did you mean 'overlap_comm'?"});
  refused(R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": true}})", "",
          {"zero_optimization.zero_quantized_weights: loom cannot do this (ZeRO++"});
  refused(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})", "",
          {"zero_hpz_partition_size: loom cannot do this (hierarchical partitioning"});
  refused(R"({"fp16": {"enabled": true, "loss_scale": 128}})", "",
          {"fp16.loss_scale: loom cannot do this (a static loss scale"});
  refused(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})", "",
          {"optimizer.params.adam_w_mode: loom cannot do this (Adam with L2"});
  refused(R"({"optimizer": {"type": "Lamb"}})", "",
          {"optimizer.type = \"Lamb\": loom has no such update rule"});
  refused(R"({"scheduler": {"type": "OneCycle", "params": {}}})", "",
          {"scheduler.type = \"OneCycle\"", "WarmupLR, WarmupDecayLR and WarmupCosineLR"});
  refused(R"({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}})", "",
          {"ds.json: optimizer.params.lr = 0.0003 and", "[train] learning_rate = 0.01 are one "
           "setting with two values"});
  refused(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})", "",
          {"bf16 and fp16 are both enabled"});
  refused(R"({"bf16": {"enabled": false}})", "bf16 = true\n",
          {"bf16.enabled = false but the job's [train] bf16 = true"});
  refused(R"({"wandb": {"enabled": true}})", "", {"ds.json: wandb: loom cannot do this"});
  refused(R"({"bf16": {"enabled": false, "bf16_master_weights_and_grads": true}})", "",
          {"bf16.bf16_master_weights_and_grads = true keeps bf16 state for bf16 weights, but bf16 "
           "is not enabled"});
  refused("[1, 2]", "", {"a DeepSpeed config is a JSON object"});
  std::filesystem::remove(dir / "ds.json");
  try {
    Trainer::from_text(job((dir / "out").string(), "deepspeed = \"nowhere.json\"\n", ""),
                       dir.path());
    ADD_FAILURE() << "a missing file was accepted";
  } catch (const ConfigError& error) {
    EXPECT_NE(std::string(error.what()).find("[train] deepspeed = \"nowhere.json\": cannot read"),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace loom
