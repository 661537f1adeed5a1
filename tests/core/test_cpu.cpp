// Tests of loom/cpu.h: the ISA levels read from /proc/cpuinfo's flags, the start-up probe's
// fall-back when a level faults or hangs (faked with ProbeOptions::fault, since most machines
// cannot fault for real), and [train] cpu_isa's bad input.
#include <chrono>

#include "loom/cpu.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

const char* kSapphireRapids = R"(processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8488C
flags		: fpu sse4_1 sse4_2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 avx_vnni

processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8488C
flags		: fpu sse4_1
)";

const char* kZen4 = R"(processor	: 0
model name	: AMD EPYC 9R14 96-Core Processor
flags		: fpu sse4_1 sse4_2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16
)";

TEST(CpuIsa, LevelsFollowTheFlagsOfTheFirstProcessor) {
  const auto spr = cpu::parse_cpu_info(kSapphireRapids);
  EXPECT_EQ(spr.model, "Intel(R) Xeon(R) Platinum 8488C");
  const auto levels = cpu::supported_isa_levels(spr);
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), "avx512_core_amx");  // no amx_fp16: not the AMX-FP16 level
  EXPECT_EQ(levels.back(), "sse41");
  EXPECT_EQ(cpu::supported_isa_levels(cpu::parse_cpu_info(kZen4)).front(), "avx512_core_bf16");
  EXPECT_TRUE(cpu::supported_isa_levels(cpu::parse_cpu_info("model name : some ARM\n")).empty());
}

TEST(CpuIsa, NamesAreCaseFreeAndKnowOneDnnsAliases) {
  EXPECT_EQ(cpu::canonical_isa("AVX512_CORE_AMX"), "avx512_core_amx");
  EXPECT_EQ(cpu::canonical_isa(" avx2 "), "avx2");
  EXPECT_EQ(cpu::canonical_isa("AVX10_1_512"), "avx512_core_fp16");
  EXPECT_EQ(cpu::canonical_isa("avx9"), "");
  EXPECT_EQ(cpu::parse_job_isa("Auto", "job.toml:3"), "auto");
  EXPECT_EQ(cpu::parse_job_isa("AVX2", "job.toml:3"), "avx2");
}

TEST(CpuIsa, AnUnknownJobLevelIsAConfigErrorListingTheValidOnes) {
  EXPECT_THROW_WITH(cpu::parse_job_isa("avx9", "job.toml:3"), ConfigError, "job.toml:3",
                    "[train] cpu_isa 'avx9' is no oneDNN ISA level", "auto", "avx512_core_amx",
                    "avx512_core_fp16", "avx2", "sse41", "loom env");
  TempDir dir;
  EXPECT_THROW_WITH(Trainer::from_text(test::tiny_gpt_job(dir.str()), dir.path(),
                                       {"train.cpu_isa=avx9"}),
                    ConfigError, "[train] cpu_isa 'avx9'", "avx512_core_bf16");
}

TEST(CpuProbe, TheCpusBestLevelPassesOnAHealthyMachine) {
  const auto cpu = cpu::read_cpu_info();
  const auto levels = cpu::supported_isa_levels(cpu);
  if (levels.empty()) GTEST_SKIP() << "not an x86-64 CPU";
  const auto choice = cpu::probe_isa(cpu, {});
  // A machine whose best level faults for real (AMX under some VMs) falls back instead.
  if (choice.source == cpu::IsaSource::probe) GTEST_SKIP() << "this CPU faults: " << choice.reason;
  EXPECT_EQ(choice.source, cpu::IsaSource::cpu_best);
  EXPECT_EQ(choice.level, levels.front());
  ASSERT_EQ(choice.steps.size(), 1u);
  EXPECT_EQ(choice.steps[0].outcome, "ok");
  EXPECT_NE(choice.summary().find("a probe passed"), std::string::npos) << choice.summary();
}

TEST(CpuProbe, ALevelThatDiesBySigillFallsBackToTheNextOne) {
  const auto cpu = cpu::read_cpu_info();
  if (cpu::supported_isa_levels(cpu).empty()) GTEST_SKIP() << "not an x86-64 CPU";
  cpu::ProbeOptions options;
  options.fault = "amx";  // counts as supported here even where the CPU has no AMX
  const auto choice = cpu::probe_isa(cpu, options);
  EXPECT_EQ(choice.source, cpu::IsaSource::probe);
  ASSERT_GE(choice.steps.size(), 2u);
  EXPECT_NE(choice.steps[0].level.find("amx"), std::string::npos);
  EXPECT_EQ(choice.steps[0].outcome, "died by SIGILL");
  EXPECT_EQ(choice.steps.back().outcome, "ok");
  EXPECT_EQ(choice.level, choice.steps.back().level);
  EXPECT_EQ(choice.level.find("amx"), std::string::npos) << choice.level;
  EXPECT_EQ(choice.cpu_best, choice.steps[0].level);
  const std::string summary = choice.summary();
  EXPECT_NE(summary.find(choice.cpu_best + " -> " + choice.level), std::string::npos) << summary;
  EXPECT_NE(summary.find("died by SIGILL in a probe"), std::string::npos) << summary;
}

TEST(CpuProbe, AHangingProbeIsCutOffAndTheSafeLevelUsed) {
  const auto cpu = cpu::read_cpu_info();
  if (cpu::supported_isa_levels(cpu).empty()) GTEST_SKIP() << "not an x86-64 CPU";
  cpu::ProbeOptions options;
  options.fault = "hang:amx";
  options.timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  const auto choice = cpu::probe_isa(cpu, options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(choice.source, cpu::IsaSource::probe);
  ASSERT_EQ(choice.steps.size(), 1u);  // one time limit, not one per level
  EXPECT_EQ(choice.steps[0].outcome, "gave no answer within 0.3 s");
  EXPECT_TRUE(choice.level == "avx2" || choice.level == "avx" || choice.level == "sse41")
      << choice.level;
  EXPECT_NE(choice.reason.find("so the safe level, unprobed"), std::string::npos) << choice.reason;
}

TEST(CpuProbe, EveryLevelDyingEndsAtTheLowestWithAWarningReason) {
  const auto cpu = cpu::read_cpu_info();
  const auto levels = cpu::supported_isa_levels(cpu);
  if (levels.empty()) GTEST_SKIP() << "not an x86-64 CPU";
  cpu::ProbeOptions options;
  for (const auto& level : levels) options.fault += level + ",";
  const auto choice = cpu::probe_isa(cpu, options);
  EXPECT_EQ(choice.steps.size(), levels.size());
  EXPECT_EQ(choice.level, "sse41");
  EXPECT_NE(choice.reason.find("every level died"), std::string::npos) << choice.reason;
}

TEST(CpuProbe, AMalformedFaultHookIsAConfigError) {
  cpu::ProbeOptions options;
  options.fault = "amx,avx9";
  EXPECT_THROW_WITH(cpu::probe_isa(cpu::read_cpu_info(), options), ConfigError,
                    "LOOM_TEST_CPU_PROBE_FAULT", "'avx9' names no ISA level");
}

TEST(CpuIsa, AJobLevelAfterAnEarlierTrainingInTheProcessIsSaidToComeTooLate) {
  TempDir first_dir, second_dir;
  Trainer::from_text(test::tiny_gpt_job(first_dir.str()), first_dir.path(),
                     {"train.max_steps=1"})->run();
  const std::string before = cpu::isa_in_effect().level;
  const std::string other = before == "sse41" ? "avx" : "sse41";
  auto second = Trainer::from_text(test::tiny_gpt_job(second_dir.str()), second_dir.path(),
                                   {"train.max_steps=1", "train.cpu_isa=" + other});
  testing::internal::CaptureStderr();
  second->setup();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("[train] cpu_isa = \"" + other + "\" cannot take effect in this process"),
            std::string::npos) << err;
  EXPECT_NE(err.find("run this job in a process of its own"), std::string::npos) << err;
  EXPECT_EQ(cpu::isa_in_effect().level, before);  // unchanged: the header must not claim it
}

TEST(CpuProbe, EnvDescribesTheCpuItsFlagsTheLevelAndThreads) {
  const std::string env = cpu::describe_environment();
  for (const char* line : {"cpu ", "flags ", "isa levels ", "oneDNN isa ", "threads ", "torch "})
    EXPECT_NE(env.find(line), std::string::npos) << "no '" << line << "' line in:\n" << env;
}

}  // namespace
}  // namespace loom
