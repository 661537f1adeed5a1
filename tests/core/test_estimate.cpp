// `loom estimate` (loom/estimate.h): the model-state arithmetic against the ZeRO paper's
// published numbers, the job estimate against the peak the same job measures when it trains
// (every precision; the offload rows, cpu+p's host memory against its CPU twin), a GPU job
// estimated on a machine without a GPU, the largest batch for a budget, [train]
// auto_find_batch_size, and bad input.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "loom/engine.h"
#include "loom/error.h"
#include "loom/estimate.h"
#include "loom/memory.h"
#include "loom/step_driver.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using estimate::Offload;
using estimate::Precision;
using test::TempDir;

// Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
// (2020), Figure 1: a 7.5 B model, mixed precision Adam (K = 12: fp32 masters and two moments)
// over 64 GPUs: 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per GPU for the baseline, P_os, P_os+g and
// P_os+g+p. loom's full_bf16 with AdamW is that anatomy (2 + 2 + 4 + 8 bytes).
TEST(Estimate, ModelStatesMatchTheZeroPaper) {
  estimate::ModelCounts m;
  m.params = m.trainable = 7.5e9;
  m.unit_params = m.params;  // P_os+g+p shards every parameter
  const estimate::Activations none;
  const double psi = 7.5e9;
  const double want[4] = {16 * psi, 4 * psi + 12 * psi / 64, 2 * psi + 14 * psi / 64,
                          16 * psi / 64};
  const double paper_gb[4] = {120, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    const estimate::Row r =
        estimate::row(m, stage, Offload::none, Precision::full_bf16, 64, none, 0, false);
    EXPECT_DOUBLE_EQ(r.model_states(), want[stage]) << "stage " << stage;
    EXPECT_NEAR(r.model_states() / 1e9, paper_gb[stage], 0.05) << "stage " << stage;
    // Stage 0 over ranks adds its gradient buckets (4 B per parameter) beside the states;
    // stages 1-2 the fp32 send buffer of the bucket backward fills (Note [Gradient buckets in
    // the peak]), one reduce_bucket_size here; stage 3's buckets are units (none in this model).
    const double bucket = 25.0 * (1 << 20);
    EXPECT_DOUBLE_EQ(r.peak, r.model_states() + (stage == 0 ? 4 * psi : stage < 3 ? bucket : 0));
  }
  // Table 1 of the paper: 1 T parameters on 1024 GPUs with all three stages, 15.6 GB per GPU.
  const estimate::Report trillion = estimate::estimate_params(1e12, {.world_size = 1024});
  bool found = false;
  for (const auto& r : trillion.rows)
    if (r.stage == 3 && r.offload == Offload::none && r.precision == Precision::full_bf16) {
      EXPECT_NEAR(r.device / 1e9, 15.6, 0.05);
      found = true;
    }
  EXPECT_TRUE(found);
}

// Note [Hybrid sharding]: [zero] shard_group_size G shards stages 1-3 over G ranks and
// replicates across the groups, so a rank holds what a G-rank run holds: the paper's 7.5 B
// model over 64 GPUs in groups of 8 is Psi/8 in the sharded terms, not Psi/64.
TEST(Estimate, ShardGroupSizeDividesTheShardedTermsByG) {
  estimate::ModelCounts m;
  m.params = m.trainable = m.unit_params = 7.5e9;
  const double psi = 7.5e9;
  const double want[4] = {16 * psi, 4 * psi + 12 * psi / 8, 2 * psi + 14 * psi / 8, 16 * psi / 8};
  for (int stage = 0; stage <= 3; ++stage) {
    m.shard_group_size = 8;
    const estimate::Row grouped =
        estimate::row(m, stage, Offload::none, Precision::full_bf16, 64, {}, 0, false);
    EXPECT_DOUBLE_EQ(grouped.model_states(), want[stage]) << "stage " << stage;
    // Stage 0 shards nothing: its gradient buckets are the world's, as without groups.
    m.shard_group_size = 0;
    const estimate::Row world =
        estimate::row(m, stage, Offload::none, Precision::full_bf16, 64, {}, 0, false);
    if (stage == 0) EXPECT_DOUBLE_EQ(grouped.peak, world.peak);
    // A group of the world's size (or more) is the world.
    m.shard_group_size = 64;
    EXPECT_DOUBLE_EQ(
        estimate::row(m, stage, Offload::none, Precision::full_bf16, 64, {}, 0, false).model_states(),
        world.model_states());
  }
}

TEST(Estimate, OffloadMovesMastersAndStateOffTheDevice) {
  estimate::ModelCounts m;
  m.params = m.trainable = 1e9;
  m.largest_tensor_params = 5e7;
  const estimate::Activations none;
  const auto gpu = [&](Offload o) {
    return estimate::row(m, 2, o, Precision::full_bf16, 8, none, 0, /*cpu_device=*/false);
  };
  const estimate::Row in_memory = gpu(Offload::none), cpu = gpu(Offload::cpu),
                      nvme = gpu(Offload::nvme);
  const double moved = (4 + 8) * 1e9 / 8;  // masters and AdamW moments, a rank's share
  // ... less the values chunk (bf16) the all-gather sends, which stays on the device (Note
  // [Offloaded ZeRO]).
  EXPECT_DOUBLE_EQ(in_memory.device - cpu.device, moved - 2 * 1e9 / 8);
  EXPECT_DOUBLE_EQ(cpu.host, moved);
  EXPECT_DOUBLE_EQ(nvme.nvme, moved);
  EXPECT_DOUBLE_EQ(nvme.host, 4 * 5e7 * 12 / 8);  // four buffers of the largest tensor's share
  // On a CPU run the "device" is RAM: offloading to cpu changes nothing.
  const estimate::Row on_cpu =
      estimate::row(m, 2, Offload::cpu, Precision::full_bf16, 8, none, 0, true);
  EXPECT_DOUBLE_EQ(on_cpu.device, in_memory.device);
  EXPECT_EQ(on_cpu.host, 0);
}

// offload_param (nvme+p, cpu+p): stage 3's unit shards go to NVMe or host memory beside the
// optimizer state; the device keeps the weights outside units and two gathered units, and
// nvme+p's host RAM three shards in flight. On a CPU run "cpu" moves nothing.
TEST(Estimate, ParameterOffloadMovesTheUnitShards) {
  estimate::ModelCounts m;
  m.params = m.trainable = 1e9;
  m.unit_params = 9e8;  // 30 units of 3e7, 1e8 outside them (embeddings)
  m.largest_unit_params = 3e7;
  m.largest_tensor_params = 5e7;
  const estimate::Activations none;
  const auto rank_of_8 = [&](Offload o) {
    return estimate::row(m, 3, o, Precision::full_bf16, 8, none, 0, /*cpu_device=*/false);
  };
  const estimate::Row nvme = rank_of_8(Offload::nvme), params = rank_of_8(Offload::nvme_params);
  const double shards = 9e8 / 8 * 2;  // bf16
  EXPECT_DOUBLE_EQ(params.nvme - nvme.nvme, shards);
  EXPECT_DOUBLE_EQ(params.weights, 1e8 * 2 + 2 * 3e7 * 2 + shards);
  // ... and the values chunk of the weights outside units, which the all-gather sends.
  // (and the fp32 send buffer of one unit's gradients, capped at reduce_bucket_size).
  EXPECT_DOUBLE_EQ(params.buffers, 1e8 * 2 / 8 + std::min(3e7 * 4, 25.0 * (1 << 20)));
  EXPECT_DOUBLE_EQ(params.device, 1e8 * 2 + 2 * 3e7 * 2 + params.grads + params.buffers);
  EXPECT_DOUBLE_EQ(params.host - nvme.host, 3 * 3e7 / 8 * 2);
  // cpu+p: the same device memory; the shards, masters and moments in host memory, no staging.
  const estimate::Row host = rank_of_8(Offload::cpu_params), cpu = rank_of_8(Offload::cpu);
  EXPECT_DOUBLE_EQ(host.device, params.device);
  EXPECT_DOUBLE_EQ(host.weights, params.weights);
  EXPECT_DOUBLE_EQ(host.host, shards + (4 + 8) * 1e9 / 8);
  EXPECT_DOUBLE_EQ(host.host - cpu.host, shards);
  EXPECT_EQ(host.nvme, 0);
  const auto on_cpu = [&](Offload o) {
    return estimate::row(m, 3, o, Precision::full_bf16, 8, none, 0, /*cpu_device=*/true);
  };
  EXPECT_DOUBLE_EQ(on_cpu(Offload::cpu_params).device, on_cpu(Offload::none).device);
  EXPECT_DOUBLE_EQ(on_cpu(Offload::cpu_params).device, on_cpu(Offload::cpu).device);
  // Only stage 3 with half-precision weights can drop its weights from memory.
  std::vector<estimate::Row> table = estimate::rows(m, std::array<estimate::Activations, 3>{}.data(),
                                                     8, 0, false);
  int rows_with_params = 0;
  for (const auto& r : table)
    if (r.offload == Offload::nvme_params || r.offload == Offload::cpu_params) {
      ++rows_with_params;
      EXPECT_EQ(r.stage, 3);
      EXPECT_EQ(r.precision, Precision::full_bf16);
    }
  EXPECT_EQ(rows_with_params, 2);
}

// A job that offloads its weight shards is estimated (the probes run it unsharded, in memory)
// and finds its row; with the optimizer state in memory the report says how that differs.
TEST(Estimate, JobWithParameterOffloadFindsItsRow) {
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  std::ofstream(job) << test::tiny_gpt_job((dir.path() / "run").string())
                     << "\n[precision]\nmode = \"full_bf16\"\n\n[zero]\nstage = 3\n"
                        "stage3_param_persistence_threshold = 0\noffload_param = { device = \"nvme\", nvme_path = \""
                     << (dir.path() / "swap").string() << "\" }\n";
  for (bool probe : {false, true}) {
    const estimate::Report r = estimate::estimate_job(job, {}, {.probe = probe});
    EXPECT_EQ(r.job_stage, 3);
    EXPECT_EQ(r.job_offload, Offload::nvme_params);
    EXPECT_TRUE(r.job_offload_params_only);
    EXPECT_GT(r.model.unit_params, 0);
    EXPECT_LT(r.model.unit_params, r.model.params);  // the embeddings are outside the units
    EXPECT_NE(estimate::format(r).find("keeps the optimizer state in memory"), std::string::npos);
  }
}

// Note [GPU jobs estimated on a CPU]: a job for a GPU, estimated where there is none, is probed
// on the CPU and split as the GPU run's: its cpu+p row's device memory is the nvme+p row's,
// host RAM holds the shards and the optimizer state; auto_find_batch_size refuses it by name.
TEST(Estimate, AGpuJobIsSplitAsOnTheGpuWhereThereIsNone) {
  if (at::hasCUDA() && c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount() > 0)
    GTEST_SKIP() << "this machine has a CUDA device";
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  std::string text = test::tiny_gpt_job((dir.path() / "run").string());
  text.replace(text.find("[train]\n"), 8, "[train]\ndevice = \"cuda\"\n");
  std::ofstream(job) << text << "\n[precision]\nmode = \"full_bf16\"\n\n[zero]\nstage = 3\n"
                        "stage3_param_persistence_threshold = 0\n"
                        "offload_optimizer = { device = \"cpu\" }\n"
                        "offload_param = { device = \"cpu\" }\n";
  const estimate::Report r = estimate::estimate_job(job, {}, {.probe = false});
  EXPECT_EQ(r.device, "cuda");
  EXPECT_TRUE(r.gpu_probed_on_cpu);
  EXPECT_EQ(r.job_offload, Offload::cpu_params);
  const estimate::Row mine = estimate::job_row(r, r.batch);
  const double state = 12 * r.model.trainable, shards = 2 * r.model.unit_params;
  EXPECT_NEAR(mine.host, state + shards, 1e-6 * state);
  EXPECT_EQ(mine.nvme, 0);
  const std::string table = estimate::format(r);
  EXPECT_NE(table.find("host RAM"), std::string::npos) << table;
  EXPECT_NE(table.find("this machine has no CUDA device: the probes ran the job on the CPU"),
            std::string::npos) << table;
  EXPECT_THROW_WITH(Trainer::from_text(text, dir.path(),
                                       {"train.auto_find_batch_size=true",
                                        "train.memory_budget=\"1GiB\""}),
                    ConfigError, "auto_find_batch_size", "device = \"cuda\"",
                    "no CUDA device");
}

// Stage 3 shards only what trains (ZeRO's driver holds no frozen tensor): a LoRA job's frozen
// base stays whole on every rank, and only the adapters inside units count as sharded.
TEST(Estimate, StageThreeKeepsALoraJobsFrozenBaseWhole) {
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  std::ofstream(job) << test::tiny_gpt_job((dir.path() / "run").string())
                     << "\n[lora]\nr = 4\ntarget_modules = \"all-linear\"\n\n[zero]\nstage = 3\n"
                        "stage3_param_persistence_threshold = 0\n";
  const estimate::Report r = estimate::estimate_job(job, {}, {.probe = false});
  ASSERT_LT(r.model.trainable, r.model.params / 4);
  EXPECT_GT(r.model.unit_params, 0);
  EXPECT_LE(r.model.unit_params, r.model.trainable);
  // Over 4 ranks (fp32 weights): the frozen bytes whole, the units' adapters a quarter, two
  // units gathered.
  const estimate::Row row = estimate::row(r.model, 3, Offload::none, Precision::fp32, 4, {}, 0,
                                          /*cpu_device=*/false);
  const double frozen = r.model.params - r.model.trainable;
  const double want = 4 * (frozen + (r.model.trainable - r.model.unit_params) +
                           r.model.unit_params / 4 + 2 * r.model.largest_unit_params);
  EXPECT_NEAR(row.weights, want, want * 1e-12);
}

// Counts that know their units' tensors (ModelCounts::unit_tensors) hand the declarations a
// unit count at the threshold they ask for (MemoryContext::unit_params): stage 3 shards a
// unit's tensors of at least stage3_param_persistence_threshold elements (1e5, the schema's
// default, for row()), so a tensor below it stays whole and one moved to it is sharded.
TEST(Estimate, UnitCountsHonourTheThresholdAskedFor) {
  auto weights = [](std::vector<std::vector<double>> units) {
    estimate::ModelCounts m;
    m.params = m.trainable = 1e6;
    m.unit_tensors = std::move(units);
    return estimate::row(m, 3, Offload::none, Precision::fp32, 4, {}, 0, false).weights;
  };
  // fp32 over 4 ranks: what is not sharded whole, the units' groups a quarter, two units
  // gathered (the largest group).
  auto want = [](double sharded, double largest) {
    return 4 * ((1e6 - sharded) + sharded / 4 + 2 * largest);
  };
  EXPECT_DOUBLE_EQ(weights({{2e5, 5e4}, {3e5, 5e4}}), want(5e5, 3e5));
  EXPECT_DOUBLE_EQ(weights({{2e5, 1e5}, {3e5, 5e4}}), want(6e5, 3e5));  // at the threshold: in
  EXPECT_DOUBLE_EQ(weights({{9e4, 5e4}, {9e4}}), want(0, 0));          // all below: all whole
}

// Settings the job leaves out come from the plugins' own schemas: [zero]'s persistence
// threshold (1e5: every tensor of the tiny model stays whole at stage 3) and [precision]'s
// frozen_weights ("half": the frozen Linears count at 2 B under bf16); set, the job's values.
TEST(Estimate, SettingsTheJobLeavesOutAreThePluginsDefaults) {
  auto counts = [](const std::string& extra) {
    TempDir dir;
    const std::filesystem::path job = dir.path() / "job.toml";
    std::ofstream(job) << test::tiny_gpt_job((dir.path() / "run").string())
                       << "\n[lora]\nr = 4\ntarget_modules = \"all-linear\"\n" << extra;
    return estimate::estimate_job(job, {}, {.probe = false}).model;
  };
  const estimate::ModelCounts defaults = counts("");
  EXPECT_EQ(defaults.unit_params, 0);
  EXPECT_GT(defaults.frozen_linear_params, 0);
  const estimate::ModelCounts set =
      counts("\n[zero]\nstage3_param_persistence_threshold = 0\n"
             "\n[precision]\nmode = \"bf16\"\nfrozen_weights = \"fp32\"\n");
  EXPECT_GT(set.unit_params, 0);
  EXPECT_EQ(set.frozen_linear_params, 0);
}

// See Note [Memory declarations]: a job's plugin that declares a term (tests/core/plugins/
// memory_declarer.cpp: two copies of the trainable weights in the weights' dtype, declared
// after the precision) adds exactly that to every row: 2 x 4 B per trainable parameter in fp32
// and bf16, 2 x 2 B in full_bf16; in host RAM it lands in the RAM column too on a CPU run.
TEST(Estimate, APluginsDeclaredTermIsInEveryRow) {
  TempDir dir;
  auto report = [&](const std::string& extra) {
    const std::filesystem::path job = dir.path() / "job.toml";
    std::ofstream(job) << test::tiny_gpt_job((dir.path() / "run").string()) << extra;
    return estimate::estimate_job(job, {}, {.world_size = 2, .probe = false});
  };
  const std::string plugins = "\n[plugins]\npath = \"" LOOM_TEST_PLUGIN_DIR "\"\n";
  const estimate::Report plain = report(plugins);
  const estimate::Report device = report(plugins + "\n[memory_declarer]\ncopies = 2\n");
  const estimate::Report host =
      report(plugins + "\n[memory_declarer]\ncopies = 2\nplace = \"host\"\n");
  ASSERT_EQ(device.rows.size(), plain.rows.size());
  ASSERT_EQ(host.rows.size(), plain.rows.size());
  // stages 0-3 x none, cpu, nvme x 3 precisions, + cpu+p and nvme+p
  ASSERT_EQ(plain.rows.size(), 38u);
  const double trainable = plain.model.trainable;
  ASSERT_GT(trainable, 0);
  for (size_t i = 0; i < plain.rows.size(); ++i) {
    const estimate::Row& p = plain.rows[i];
    SCOPED_TRACE("stage " + std::to_string(p.stage) + " " + estimate::to_string(p.offload) +
                 " " + estimate::to_string(p.precision));
    const double bytes = 2 * trainable * (p.precision == Precision::full_bf16 ? 2 : 4);
    EXPECT_DOUBLE_EQ(device.rows[i].buffers - p.buffers, bytes);
    EXPECT_DOUBLE_EQ(device.rows[i].device - p.device, bytes);
    EXPECT_DOUBLE_EQ(device.rows[i].peak - p.peak, bytes);
    EXPECT_EQ(device.rows[i].model_states(), p.model_states());
    EXPECT_EQ(host.rows[i].buffers, p.buffers);
    EXPECT_DOUBLE_EQ(host.rows[i].device - p.device, bytes);  // one memory on a CPU run
  }
}

// test::tiny_gpt_job widened, so activations are most of the peak.
const std::vector<std::string> kShape = {
    "train.per_device_train_batch_size=12", "train.max_steps=3", "train.save_final=false",
    "model.vocab_size=256", "model.n_positions=64", "model.n_embd=96", "model.n_layer=3",
    "model.n_head=4", "data.seq_len=64", "data.vocab_high=256", "data.num_samples=256"};

std::vector<std::string> with(std::vector<std::string> overrides, const std::string& more) {
  overrides.push_back(more);
  return overrides;
}

// The peak of tensor memory a run of the job measures, above what was live before it.
double measured_peak(const std::string& text, const TempDir& dir, const std::string& mode,
                     const std::vector<std::string>& more = {}) {
  memory::install_cpu_tracker();
  const int64_t before = memory::cpu_stats().current_bytes;
  memory::reset_cpu_peak();
  {
    std::vector<std::string> overrides = with(kShape, "precision.mode=\"" + mode + "\"");
    overrides.insert(overrides.end(), more.begin(), more.end());
    auto trainer = Trainer::from_text(text, dir.path(), overrides);
    trainer->run();
  }
  return static_cast<double>(memory::cpu_stats().peak_bytes - before);
}

// The bar: the estimate of a configuration within 10 % of the peak the configuration
// measures. The probes run batches 1 and 2; the job trains at 12.
TEST(Estimate, JobEstimateIsWithinTenPercentOfTheMeasuredPeak) {
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  const std::string run_dir = (dir.path() / "run").string();
  std::ofstream(job) << test::tiny_gpt_job(run_dir);
  const estimate::Report report = estimate::estimate_job(job, kShape, {});
  EXPECT_EQ(report.batch, 12);
  EXPECT_EQ(report.device, "cpu");
  EXPECT_FALSE(std::filesystem::exists(run_dir)) << "the estimate wrote into the job's output_dir";
  EXPECT_NEAR(report.model.optimizer_per_trainable, 8.0, 1e-9);  // AdamW's two fp32 moments
  for (Precision p : {Precision::fp32, Precision::bf16, Precision::full_bf16}) {
    SCOPED_TRACE(estimate::to_string(p));
    const auto& a = report.activations[static_cast<int>(p)];
    ASSERT_TRUE(a.measured) << a.note;
    EXPECT_GT(a.per_sample, 0);
    const estimate::Row* mine = nullptr;
    for (const auto& r : report.rows)
      if (r.stage == 0 && r.offload == Offload::none && r.precision == p) mine = &r;
    ASSERT_NE(mine, nullptr);
    TempDir run;
    const double measured =
        measured_peak(test::tiny_gpt_job(run.str()), run, estimate::to_string(p));
    std::printf("%s: estimated %.2f MiB, measured %.2f MiB\n", estimate::to_string(p), mine->peak / 1048576.0, measured / 1048576.0);
    EXPECT_NEAR(mine->peak / measured, 1.0, 0.10)
        << "estimated " << mine->peak << " B, measured " << measured << " B";
  }
  // A budget: the largest batch, a multiple of 8, whose estimate fits.
  const estimate::Row& fp32 = report.rows.front();
  const auto& a = report.activations[0];
  const double budget = fp32.peak - a.per_sample * 12 + a.per_sample * 40.5;
  EXPECT_EQ(estimate::largest_batch(report, budget), 40);
  EXPECT_EQ(estimate::largest_batch(report, fp32.model_states() * 0.5), 0);
}

// [optimizer] master_dtype = "bf16" (Note [bf16 weights as their own masters]): the job's
// full_bf16 row holds no masters and is within the same 10 % of the peak the job measures; its
// other precisions' probes run with masters' default (which they need); the full_bf16 rows of
// every ZeRO stage keep none (Note [ZeRO without masters], Note [Offloaded without masters]),
// offloaded or not, offload_param's row too, and every one is buildable.
TEST(Estimate, Bf16MastersJobRowHasNoMastersAndMatchesItsPeak) {
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  const std::string run_dir = (dir.path() / "run").string();
  std::ofstream(job) << test::tiny_gpt_job(run_dir) << "\n[precision]\nmode = \"full_bf16\"\n"
                     << "\n[optimizer]\nmaster_dtype = \"bf16\"\n";
  const estimate::Report report = estimate::estimate_job(job, kShape, {});
  const estimate::Row* mine = nullptr;
  int shards_offloaded = 0;
  for (const auto& r : report.rows) {
    if (r.precision != Precision::full_bf16) continue;
    EXPECT_EQ(r.masters, 0) << "stage " << r.stage;
    EXPECT_TRUE(r.buildable) << "stage " << r.stage << " " << to_string(r.offload);
    if (r.offload == Offload::nvme_params) ++shards_offloaded;
    if (r.stage == 0 && r.offload == Offload::none) mine = &r;
  }
  ASSERT_NE(mine, nullptr);
  EXPECT_EQ(shards_offloaded, 1) << "the full_bf16 row of stage 3 with offload_param on NVMe";
  for (const auto& r : report.rows)
    if (r.precision == Precision::fp32) EXPECT_EQ(r.masters, 0);
  TempDir run;
  const double measured = measured_peak(test::tiny_gpt_job(run.str()), run, "full_bf16",
                                        {"optimizer.master_dtype=\"bf16\""});
  std::printf("estimated %.2f MiB, measured %.2f MiB\n", mine->peak / 1048576.0,
              measured / 1048576.0);
  EXPECT_NEAR(mine->peak / measured, 1.0, 0.10);
}

// The same bar for the ZeRO and offload configurations the offload tests run on one rank
// (full_bf16: the layout offload needs): the row of the job's stage and offload against the
// peak of tensor memory the configured job measures. The swap files' staging buffers are not
// tensors (aligned host memory), so the row's host part is left out of the comparison; cpu+p's
// host part is held to its CPU twin, where the host stores are tensors.
TEST(Estimate, ZeroAndOffloadEstimatesAreWithinTenPercentOfTheMeasuredPeak) {
  TempDir swap;
  const std::string nvme = "{ device = \"nvme\", nvme_path = \"" + swap.str() + "\" }";
  struct Case {
    int stage;
    Offload offload;
    std::string zero;
    std::vector<std::string> train = {};  // --set overrides of [train]
    double reduce_bucket_bytes = 25.0 * (1 << 20);  // [zero] reduce_bucket_size, for row()
    std::vector<std::string> more = {};  // other --set overrides
  };
  // Threshold 0: every unit tensor sharded (the tiny model's are all below the default 1e5).
  const std::string all_sharded = "stage3_param_persistence_threshold = 0\n";
  const Case cases[] = {
      {1, Offload::none, ""},
      {3, Offload::none, all_sharded},
      {0, Offload::nvme, "offload_optimizer = " + nvme + "\n"},
      {2, Offload::nvme, "offload_optimizer = " + nvme + "\n"},
      {3, Offload::nvme_params,
       all_sharded + "offload_optimizer = " + nvme + "\noffload_param = " + nvme + "\n"},
      // Note [Updating chunks in backward]: groups of 75 000 elements (5 of them), each chunk
      // freed once it updated, during backward.
      {2, Offload::none, "reduce_bucket_size = 300000\n",
       {"train.optimizer_in_backward=true", "train.max_grad_norm=0"}, 300000},
      // Note [ZeRO without masters]: the bf16 shards are the only weights stage 3 keeps; the
      // swap file holds the state alone.
      {3, Offload::none, all_sharded, {}, 25.0 * (1 << 20), {"optimizer.master_dtype=\"bf16\""}},
      {2, Offload::nvme, "offload_optimizer = " + nvme + "\n", {}, 25.0 * (1 << 20),
       {"optimizer.master_dtype=\"bf16\""}},
      // Note [Offloaded without masters]: stage 0's swap file too.
      {0, Offload::nvme, "offload_optimizer = " + nvme + "\n", {}, 25.0 * (1 << 20),
       {"optimizer.master_dtype=\"bf16\""}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("stage " + std::to_string(c.stage) + " offload " + estimate::to_string(c.offload));
    const std::string zero = "\n[zero]\nstage = " + std::to_string(c.stage) + "\n" + c.zero;
    TempDir dir;
    const std::filesystem::path job = dir.path() / "job.toml";
    std::ofstream(job) << test::tiny_gpt_job((dir.path() / "run").string()) << zero;
    // Only full_bf16's row is compared, so only full_bf16 is probed (as auto_find_batch_size
    // probes): 3 probes where all three precisions took 7; its row is the same either way.
    std::vector<std::string> overrides = with(kShape, "precision.mode=\"full_bf16\"");
    overrides.insert(overrides.end(), c.train.begin(), c.train.end());
    overrides.insert(overrides.end(), c.more.begin(), c.more.end());
    const estimate::Report report =
        estimate::estimate_job(job, overrides, {.job_precision_only = true});
    ASSERT_EQ(report.job_precision, Precision::full_bf16);
    ASSERT_EQ(report.job_offload, c.offload);
    const estimate::Row* mine = nullptr;
    for (const auto& r : report.rows)
      if (r.stage == c.stage && r.offload == c.offload && r.precision == Precision::full_bf16)
        mine = &r;
    ASSERT_NE(mine, nullptr);
    // The row as a GPU's would split it: its device peak without the host's staging buffers.
    estimate::ModelCounts counts = report.model;
    counts.reduce_bucket_bytes = c.reduce_bucket_bytes;
    const double estimated = estimate::row(counts, c.stage, c.offload, Precision::full_bf16, 1,
                                           report.activations[2], report.batch,
                                           /*cpu_device=*/false).peak;
    EXPECT_LE(estimated, mine->peak);
    if (!c.more.empty()) EXPECT_EQ(mine->masters, 0);
    TempDir run;
    std::vector<std::string> sets = c.train;
    sets.insert(sets.end(), c.more.begin(), c.more.end());
    const double measured =
        measured_peak(test::tiny_gpt_job(run.str()) + zero, run, "full_bf16", sets);
    std::printf("stage %d %s%s: estimated %.2f MiB, measured %.2f MiB\n", c.stage,
                estimate::to_string(c.offload), c.train.empty() ? "" : " in backward",
                estimated / 1048576.0, measured / 1048576.0);
    EXPECT_NEAR(estimated / measured, 1.0, 0.10)
        << "estimated " << estimated << " B, measured " << measured << " B";
    if (!c.train.empty()) {
      // The 10 % above holds with or without the update in backward (the gradients are 5 % of
      // this peak), so the saving itself is held to what the same job measures without it.
      ASSERT_TRUE(counts.optimizer_in_backward);
      counts.optimizer_in_backward = false;
      const double normal = estimate::row(counts, c.stage, c.offload, Precision::full_bf16, 1,
                                          report.activations[2], report.batch,
                                          /*cpu_device=*/false).peak;
      TempDir normal_run;
      const double measured_normal =
          measured_peak(test::tiny_gpt_job(normal_run.str()) + zero, normal_run, "full_bf16");
      std::printf("stage %d without it: estimated %.2f MiB, measured %.2f MiB; saved %.2f MiB "
                  "estimated, %.2f MiB measured\n", c.stage, normal / 1048576.0,
                  measured_normal / 1048576.0, (normal - estimated) / 1048576.0,
                  (measured_normal - measured) / 1048576.0);
      // Both steps release their shards between steps (Note [Gradients released, not
      // zeroed]), so where the activations set the peak neither saves anything (0 and 0 here).
      const double saved = normal - estimated, measured_saved = measured_normal - measured;
      EXPECT_NEAR(saved, measured_saved, 0.1 * 1048576 + 0.3 * std::abs(measured_saved));
    }
    if (c.offload != Offload::nvme_params) continue;
    // cpu+p, from the same report (the probes run the same unsharded layout): the weight shards
    // and the optimizer state in host memory. Its CPU twin (Note [Parameter offload twin]) keeps
    // them in host stores of their own beside the staged "device" copies: the shards' arena is a
    // tensor (in the tracked peak), the optimizer's host store aligned memory whose size the
    // driver reports, so the GPU row's device peak and host memory together are held to the
    // twin's peak plus that store, and the row's masters and moments to the store alone.
    const estimate::Row gpu = estimate::row(report.model, 3, Offload::cpu_params,
                                            Precision::full_bf16, 1, report.activations[2],
                                            report.batch, /*cpu_device=*/false);
    EXPECT_EQ(gpu.nvme, 0);
    const std::string host = "{ device = \"cpu\" }";
    const std::string twin_zero = "\n[zero]\nstage = 3\n" + all_sharded +
                                  "offload_optimizer = " + host + "\noffload_param = " + host + "\n";
    TempDir twin_run;
    const auto started = std::chrono::steady_clock::now();
    double twin = 0, host_store = 0;
    setenv("LOOM_OFFLOAD_CPU_STORE", "1", 1);
    {
      const int64_t before = memory::cpu_stats().current_bytes;
      memory::reset_cpu_peak();
      {
        auto trainer = Trainer::from_text(test::tiny_gpt_job(twin_run.str()) + twin_zero,
                                          twin_run.path(),
                                          with(kShape, "precision.mode=\"full_bf16\""));
        trainer->run();
        host_store = static_cast<double>(trainer->engine().step_driver().state_bytes());
      }
      twin = static_cast<double>(memory::cpu_stats().peak_bytes - before);
    }
    unsetenv("LOOM_OFFLOAD_CPU_STORE");
    std::printf("stage 3 cpu+p (the CPU twin): estimated %.2f MiB on the device + %.2f MiB host "
                "(%.2f MiB of masters and moments), measured %.2f MiB of tensors + %.2f MiB "
                "host store (its run: %.1f s)\n",
                gpu.peak / 1048576.0, gpu.host / 1048576.0,
                (gpu.masters + gpu.optimizer) / 1048576.0, twin / 1048576.0,
                host_store / 1048576.0,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    EXPECT_NEAR((gpu.masters + gpu.optimizer) / host_store, 1.0, 0.10);
    EXPECT_NEAR((gpu.peak + gpu.host) / (twin + host_store), 1.0, 0.10)
        << "estimated " << gpu.peak << " + " << gpu.host << " B, measured " << twin << " + "
        << host_store << " B";
  }
}

// Note [Proxy probes]: proxies of 1, 2 and 3 units, scaled to the model's 6, give what probing the
// whole 6-unit model gives (and the 10 % tests above run on proxies: their model has 3 units).
TEST(Estimate, ProxyProbesOfOneTwoAndThreeUnitsScaleToTheWholeModel) {
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  std::ofstream(job) << test::tiny_gpt_job((dir.path() / "run").string());
  // 8 units: proxies of 1-3 units stand for a model more than twice their size (16 cost twice
  // the whole-model probes and showed nothing more).
  const auto shape = with(kShape, "model.n_layer=8");
  const estimate::Report proxied = estimate::estimate_job(job, shape, {});
  const estimate::Report whole = estimate::estimate_job(job, shape, {.proxy = false});
  EXPECT_EQ(proxied.units, 8);
  EXPECT_TRUE(proxied.uniform_units);
  for (Precision p : {Precision::fp32, Precision::bf16, Precision::full_bf16}) {
    SCOPED_TRACE(estimate::to_string(p));
    const auto& a = proxied.activations[static_cast<int>(p)];
    const auto& b = whole.activations[static_cast<int>(p)];
    ASSERT_TRUE(a.measured && b.measured) << a.note << b.note;
    EXPECT_TRUE(a.proxied);
    EXPECT_FALSE(b.proxied);
    EXPECT_NEAR(a.per_sample / b.per_sample, 1.0, 0.05);
    EXPECT_NEAR(a.setup_peak / b.setup_peak, 1.0, 0.05);
    const auto peak = [&](const estimate::Report& r) {
      return estimate::row(r.model, 0, Offload::none, p, 1, r.activations[static_cast<int>(p)],
                           r.batch, true).peak;
    };
    std::printf("%s: proxies %.2f MiB, whole model %.2f MiB\n", estimate::to_string(p),
                peak(proxied) / 1048576.0, peak(whole) / 1048576.0);
    EXPECT_NEAR(peak(proxied) / peak(whole), 1.0, 0.05);
  }
  // A proxy that cannot be built (checkpointing names unit 5 of 8): the whole model's probes.
  // Half as wide (still 8 units, still cheaper as proxies: what lies outside the units stays
  // below one unit), since only the fall-back is asked of it: its seven whole-model probes were
  // a third of this test's time at 96. What the estimate says proves the proxy was tried.
  std::ofstream(job, std::ios::app) << "\n[checkpointing]\nunits = [5]\n";
  testing::internal::CaptureStderr();
  const estimate::Report fallback = estimate::estimate_job(job, with(shape, "model.n_embd=48"), {});
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(fallback.units, 8);
  EXPECT_NE(said.find("proxies of 1, 2 and 3 units do not stand for the model in fp32: "),
            std::string::npos) << said;
  EXPECT_NE(said.find("[checkpointing] units names unit 5"), std::string::npos) << said;
  for (const auto& a : fallback.activations) {
    EXPECT_TRUE(a.measured) << a.note;
    EXPECT_FALSE(a.proxied);
  }
}

TEST(Estimate, BatchPlansKeepTheSamplesPerStep) {
  auto plan = [](int64_t effective, int64_t fits) {
    const auto p = estimate::plan_batch(effective, fits);
    return std::pair{p.batch, p.accumulation};
  };
  EXPECT_EQ(plan(16, 112), (std::pair<int64_t, int64_t>{16, 1}));  // never past the job's
  EXPECT_EQ(plan(64, 40), (std::pair<int64_t, int64_t>{32, 2}));   // a multiple of 8
  EXPECT_EQ(plan(96, 40), (std::pair<int64_t, int64_t>{32, 3}));
  EXPECT_EQ(plan(24, 7), (std::pair<int64_t, int64_t>{6, 4}));     // below 8: a divisor
  EXPECT_EQ(plan(100, 30), (std::pair<int64_t, int64_t>{25, 4}));  // no multiple of 8 divides
  EXPECT_EQ(plan(7, 3), (std::pair<int64_t, int64_t>{1, 7}));
  EXPECT_EQ(plan(16, 0), (std::pair<int64_t, int64_t>{0, 0}));
  EXPECT_DOUBLE_EQ(estimate::parse_size("x", "20GiB"), 20.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(estimate::parse_size("x", "1.5e9"), 1.5e9);
  EXPECT_DOUBLE_EQ(estimate::parse_size("x", "512MB"), 512e6);
  EXPECT_THROW_WITH(estimate::parse_size("--budget", "lots"), ConfigError, "--budget",
                    "positive size", "'lots'");
  EXPECT_THROW_WITH(estimate::parse_size("--budget", "-1GiB"), ConfigError, "'-1GiB'");
}

// [train] auto_find_batch_size: the batch the estimate says fits the budget, the samples per
// step kept; what the engine then trains with.
TEST(Estimate, AutoFindBatchSizeTakesTheLargestBatchThatFits) {
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  const std::string text = test::tiny_gpt_job((dir.path() / "run").string());
  std::ofstream(job) << text;
  // 4 x 8 = 32 samples per step.
  auto shape = with(with(kShape, "train.per_device_train_batch_size=4"),
                    "train.gradient_accumulation_steps=8");
  estimate::Options options;
  options.job_precision_only = true;
  const estimate::Report report = estimate::estimate_job(job, shape, options);
  const auto& a = report.activations[0];
  ASSERT_TRUE(a.measured) << a.note;
  EXPECT_FALSE(report.activations[1].measured);  // the job's precision only
  const estimate::Row one = estimate::row(report.model, 0, Offload::none, Precision::fp32, 1, a,
                                          0, true);
  auto chosen = [&](double budget) {
    auto trainer = Trainer::from_text(
        text, dir.path(),
        with(with(shape, "train.auto_find_batch_size=true"),
             "train.memory_budget=\"" + std::to_string(static_cast<int64_t>(budget)) + "B\""));
    trainer->setup();
    const auto& train = trainer->engine().section("train");
    return std::pair{train.get_int("per_device_train_batch_size"),
                     train.get_int("gradient_accumulation_steps")};
  };
  // Room for 13.5 samples: 13 fit, so 8 x 4; for 40: all 32 in one micro-batch.
  ASSERT_LT(one.setup_peak, one.device + a.per_sample * 13.5);
  EXPECT_EQ(chosen(one.device + a.per_sample * 13.5), (std::pair<int64_t, int64_t>{8, 4}));
  EXPECT_EQ(chosen(one.device + a.per_sample * 40), (std::pair<int64_t, int64_t>{32, 1}));
  EXPECT_THROW_WITH(chosen(one.model_states() * 0.5), ConfigError, "memory_budget",
                    "not even one sample");
  EXPECT_THROW_WITH(Trainer::from_text(text, dir.path(),
                                       with(with(shape, "train.auto_find_batch_size=true"),
                                            "train.memory_budget=\"lots\"")),
                    ConfigError, "memory_budget", "'lots'");
}

TEST(Estimate, BadInputIsNamed) {
  EXPECT_THROW_WITH(estimate::estimate_params(0, {}), ConfigError, "--params must be a positive");
  EXPECT_THROW_WITH(estimate::estimate_params(1e9, {.world_size = 0}), ConfigError,
                    "--world-size must be >= 1");
  EXPECT_THROW_WITH(estimate::estimate_job("/nonexistent/job.toml", {}, {}), ConfigError,
                    "/nonexistent/job.toml");
  TempDir dir;
  const std::filesystem::path job = dir.path() / "job.toml";
  std::ofstream(job) << test::tiny_gpt_job((dir.path() / "run").string());
  EXPECT_THROW_WITH(estimate::estimate_job(job, with(kShape, "model.n_embd=97"), {}),
                    ConfigError, "n_embd 97 must be divisible by n_head 4");
}

}  // namespace
}  // namespace loom
