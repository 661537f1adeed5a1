// loom/cpu.h — which CPU kernels (oneDNN ISA level) this process uses, and the start-up probe
// that makes sure they work. Not a CPU-feature library: it knows the flags that pick oneDNN's
// kernels and nothing else. See Note [CPU kernel probe] in core/src/cpu_probe.cpp.
//
// Every loom program calls ensure_cpu_kernels_work() first thing in main(), before LibTorch
// runs any kernel and before any thread exists: oneDNN reads ONEDNN_MAX_CPU_ISA once, at its
// first kernel, and the probe forks.
#pragma once

#include <chrono>
#include <string>
#include <vector>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::cpu {

// oneDNN's ISA levels, best first, in ONEDNN_MAX_CPU_ISA's names lower-cased
// ("avx512_core_amx", ..., "sse41"). The valid values of [train] cpu_isa besides "auto".
const std::vector<std::string>& isa_levels();

// "avx512_core_amx" for "AVX512_CORE_AMX", "Avx512_Core_Amx" or oneDNN's alias
// "avx10_1_512_amx"; "" when `name` is no level.
std::string canonical_isa(const std::string& name);

// What /proc/cpuinfo says about this CPU.
struct CpuInfo {
  std::string model;                // "Intel(R) Xeon(R) Platinum 8488C"
  std::vector<std::string> flags;   // every flag, as the kernel spells them
  bool has(const std::string& flag) const;
};
CpuInfo read_cpu_info();                             // this machine's
CpuInfo parse_cpu_info(const std::string& cpuinfo);  // from /proc/cpuinfo's text (for tests)

// The levels this CPU supports, best first ("avx2", "avx", "sse41" on a plain AVX2 machine).
std::vector<std::string> supported_isa_levels(const CpuInfo& cpu);

// The flags that decide oneDNN's level, for `loom env` ("avx2 avx512f avx512_bf16 amx_bf16 ...").
const std::vector<std::string>& relevant_flags();

// How a level came to be in effect.
enum class IsaSource {
  cpu_best,     // the CPU's best level: no cap set (a probe ran and passed, or probing was off)
  probe,        // a probe saw a level fail and fell back: ONEDNN_MAX_CPU_ISA set by loom
  environment,  // the user's own ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA): never probed over
  job,          // [train] cpu_isa forced it
  not_x86,      // no x86-64 levels to choose between: oneDNN's own choice
};

struct ProbeStep {
  std::string level;    // the level the child ran at
  std::string outcome;  // "ok", "died by SIGILL", "no answer within 10 s", "exit 3: ..."
};

// The level in effect and how it was chosen.
struct IsaChoice {
  std::string cpu_best;     // the best level this CPU supports ("" when not x86-64)
  std::string level;        // the level in effect (== cpu_best when nothing caps it)
  IsaSource source = IsaSource::cpu_best;
  std::string reason;       // how it was chosen, in words ("avx512_core_amx died by SIGILL in
                            // a probe", "this CPU's best; a probe passed")
  std::vector<ProbeStep> steps;  // the probes run, in order
  // One line for the run header: "avx512_core_amx -> avx512_core_fp16 (avx512_core_amx died
  // by SIGILL in a probe)" or "avx2 (the CPU's best; probed)".
  std::string summary() const;
};

struct ProbeOptions {
  // A child that has not answered by then is killed, and the safe level is used.
  std::chrono::milliseconds timeout{10000};
  // Test-only: levels whose probe child fakes a fault, as LOOM_TEST_CPU_PROBE_FAULT spells them:
  // a comma list of level names (or "amx" for every AMX level), each optionally "hang:"-prefixed
  // to fake a hang instead of a SIGILL. A faked level counts as supported by this CPU, so the
  // fall-back can be tested on a machine without it. Unknown names throw ConfigError.
  std::string fault;
};

// Probes from the CPU's best level down until one passes, in forked children; changes nothing
// in this process (no setenv). What ensure_cpu_kernels_work() runs, exposed for the tests.
IsaChoice probe_isa(const CpuInfo& cpu, const ProbeOptions& options);

// Once per process, first thing in main(): respects a user's ONEDNN_MAX_CPU_ISA; else probes
// (options from LOOM_CPU_PROBE_TIMEOUT seconds and LOOM_TEST_CPU_PROBE_FAULT; LOOM_CPU_PROBE=0
// skips the probe), sets ONEDNN_MAX_CPU_ISA when a level failed, and prints one warning line
// saying what failed and what is used instead. Later calls return the first call's answer.
// Throws ConfigError for a malformed LOOM_TEST_CPU_PROBE_FAULT / LOOM_CPU_PROBE_TIMEOUT.
const IsaChoice& ensure_cpu_kernels_work();

// The choice in effect: ensure_cpu_kernels_work()'s, or what apply_job_isa() changed it to.
const IsaChoice& isa_in_effect();

// [train] cpu_isa: "auto" keeps the level in effect; a level name forces it (sets
// ONEDNN_MAX_CPU_ISA). `where` says where the value came from ("job.toml:4") for errors.
// Throws ConfigError for an unknown level, listing the valid ones. Forcing a level after a
// training already ran in this process cannot reach oneDNN (it fixed its level then): warns so.
void apply_job_isa(const std::string& value, const std::string& where);
// The check alone (for `loom check`): the canonical level, "auto", or a ConfigError.
std::string parse_job_isa(const std::string& value, const std::string& where);

// `loom env`: CPU model, its relevant flags, the level chosen and why, threads, versions.
std::string describe_environment();

}  // namespace loom::cpu

#pragma GCC visibility pop
