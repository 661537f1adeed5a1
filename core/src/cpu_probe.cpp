// The start-up probe of the CPU kernels (see Note [CPU kernel probe]), the job's [train] cpu_isa,
// and `loom env`'s report. Not the level table: that is cpu_isa.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/headeronly/version.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "cuda_runtime.h"
#include "device.h"
#include "dist_env.h"
#include "loom/cpu.h"
#include "loom/error.h"
#include "loom/log.h"

#if __has_include(<oneapi/dnnl/dnnl_version.h>)
#include <oneapi/dnnl/dnnl_version.h>
#endif

// Note [CPU kernel probe]
// ~~~~~~~~~~~~~~~~~~~~~~~
// oneDNN picks its kernels by what CPUID reports. On some VMs (Intel Xeons with AMX under
// Firecracker) CPUID reports AMX, the kernel grants the tile permission, and still oneDNN's
// AMX kernels die by SIGILL at their first `tilezero`: every bf16 matmul kills the process.
// Nothing in the parent can catch that, so a forked child runs a few small bf16, fp16 and fp32
// matmuls first; if it dies by a signal, the next child tries one level lower
// (ONEDNN_MAX_CPU_ISA), and the parent sets the first level that passed before its own first
// kernel: oneDNN reads that variable once, when it first runs. A child that does not answer
// within the time limit is killed and the safe level (avx2, else the best below it) is used
// without probing further, so a hang costs one time limit, not one per level.
// The fork happens first thing in main(), before LibTorch has started a thread: forking a
// threaded process leaves the child with locks no thread will release. A user's own
// ONEDNN_MAX_CPU_ISA is never probed over.

namespace loom::cpu {
namespace {

enum class Fault { none, sigill, hang };

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

int rank_of(const std::string& level) {
  const auto& all = isa_levels();
  return static_cast<int>(std::find(all.begin(), all.end(), level) - all.begin());
}

// The lower (later in isa_levels()) of a requested level and the CPU's best: oneDNN never
// goes above what the CPU has, whatever the cap says.
std::string capped(const std::string& requested, const std::string& best) {
  if (best.empty()) return requested;
  return rank_of(requested) < rank_of(best) ? best : requested;
}

// LOOM_TEST_CPU_PROBE_FAULT's levels; see ProbeOptions::fault.
std::map<std::string, Fault> parse_fault(const std::string& spec,
                                         const std::vector<std::string>& supported) {
  std::map<std::string, Fault> faults;
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    Fault kind = Fault::sigill;
    std::string name = item;
    if (name.rfind("hang:", 0) == 0) {
      kind = Fault::hang;
      name = name.substr(5);
    } else if (name.rfind("sigill:", 0) == 0) {
      name = name.substr(7);
    }
    std::vector<std::string> levels;
    if (name == "amx" || name == "AMX") {
      for (const auto& level : supported)
        if (level.find("amx") != std::string::npos) levels.push_back(level);
      if (levels.empty()) levels.push_back("avx512_core_amx");
    } else {
      const std::string level = canonical_isa(name);
      LOOM_CHECK_AS(ConfigError, !level.empty(), "LOOM_TEST_CPU_PROBE_FAULT: '", item,
                    "' names no ISA level; use a comma list of levels (or amx), each "
                    "optionally hang:-prefixed, e.g. amx or hang:avx2");
      levels.push_back(level);
    }
    for (const auto& level : levels) faults[level] = kind;
  }
  return faults;
}

// The child's work: the matmuls a training step runs (forward, and backward's transposed
// operands, attention's batched matmul) in each dtype the precision plugin may pick. LibTorch
// hands a matmul to oneDNN from 16^3 multiply-adds on; 128 is well above that and still takes
// milliseconds where the CPU lacks native bf16/fp16 and LibTorch converts.
void run_kernels() {
  at::set_num_threads(1);  // no OpenMP team in a forked child: see the Note
  const auto a = at::randn({128, 128});
  const auto b = at::randn({128, 128});
  const auto bias = at::randn({128});
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const auto x = a.to(dtype), w = b.to(dtype), c = bias.to(dtype);
    at::matmul(x, w);
    at::linear(x, w, c);
    at::matmul(x.t(), w);
    at::bmm(x.view({4, 32, 128}), w.view({4, 128, 32}));
  }
}

[[noreturn]] void child_main(const std::string& cap, Fault fault, int answer_fd) {
  // A real fault must kill the child, quietly: default dispositions, no core file.
  for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE}) ::signal(sig, SIG_DFL);
  struct rlimit no_core = {0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  if (!cap.empty()) ::setenv("ONEDNN_MAX_CPU_ISA", upper(cap).c_str(), 1);
  if (fault == Fault::sigill) ::raise(SIGILL);
  if (fault == Fault::hang)
    for (;;) ::pause();
  int code = 0;
  try {
    run_kernels();
  } catch (const std::exception& error) {
    const std::string what = error.what();
    const std::string line = what.substr(0, what.find('\n'));
    [[maybe_unused]] auto written = ::write(answer_fd, line.data(), line.size());
    code = 3;
  }
  ::_exit(code);  // no atexit handlers, no flush of the parent's stdio buffers
}

struct Outcome {
  enum Kind { ok, signal, timeout, failed } kind;
  std::string text;  // "ok", "died by SIGILL", "no answer within 10 s", "exit 3: ..."
};

// SIGCHLD at its default for the probe's life: an ignored SIGCHLD (inherited across exec) would
// reap the child before waitpid() could read how it died.
class DefaultSigchld {
 public:
  DefaultSigchld() {
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    ::sigemptyset(&dfl.sa_mask);
    ::sigaction(SIGCHLD, &dfl, &saved_);
  }
  ~DefaultSigchld() { ::sigaction(SIGCHLD, &saved_, nullptr); }

 private:
  struct sigaction saved_ = {};
};

Outcome probe_once(const std::string& cap, Fault fault, std::chrono::milliseconds timeout) {
  DefaultSigchld sigchld;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    return {Outcome::failed, std::string("could not make a pipe: ") + ::strerror(errno)};
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return {Outcome::failed, std::string("could not fork: ") + ::strerror(errno)};
  }
  if (pid == 0) {
    ::close(fds[0]);
    child_main(cap, fault, fds[1]);
  }
  ::close(fds[1]);
  // The pipe closes when the child ends, however it ends: wait for that, up to the limit.
  std::string message;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool ended = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p = {fds[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    char buffer[512];
    const ssize_t n = ::read(fds[0], buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ended = true;
      break;
    }
    message.append(buffer, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  if (!ended) ::kill(pid, SIGKILL);
  int status = 0;
  pid_t waited;
  while ((waited = ::waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  if (waited < 0)
    return {Outcome::failed, std::string("could not wait for the child: ") + ::strerror(errno)};
  if (!ended) {
    std::ostringstream text;
    text << "gave no answer within " << timeout.count() / 1000.0 << " s";
    return {Outcome::timeout, text.str()};
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return {Outcome::signal, std::string("died by SIG") + (name ? name : std::to_string(sig))};
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {Outcome::ok, "ok"};
  return {Outcome::failed, "failed (exit " + std::to_string(WEXITSTATUS(status)) +
                               (message.empty() ? "" : ": " + message) + ")"};
}

// The best level at or below `from` in the ladder that is widely safe (no AVX-512, no AMX).
std::string safe_level(const std::vector<std::string>& ladder, size_t from) {
  for (size_t i = from; i < ladder.size(); ++i)
    if (ladder[i] == "avx2" || ladder[i] == "avx" || ladder[i] == "sse41") return ladder[i];
  return ladder.back();
}

// "avx512_core_amx_fp16, avx512_core_amx died by SIGILL", or each with its own outcome.
std::string describe_deaths(const std::vector<ProbeStep>& died) {
  const bool same = std::all_of(died.begin(), died.end(), [&](const ProbeStep& step) {
    return step.outcome == died.front().outcome;
  });
  std::string out;
  for (const auto& step : died) {
    if (!out.empty()) out += ", ";
    out += same ? step.level : step.level + " " + step.outcome;
  }
  return same ? out + " " + died.front().outcome : out;
}

std::mutex g_mutex;
IsaChoice g_choice;
bool g_ensured = false;
bool g_trained = false;  // an engine already ran its setup in this process: oneDNN is fixed
CpuInfo g_cpu;

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::string(value) : fallback;
}

ProbeOptions options_from_env() {
  ProbeOptions options;
  options.fault = env_or("LOOM_TEST_CPU_PROBE_FAULT", "");
  const std::string timeout = env_or("LOOM_CPU_PROBE_TIMEOUT", "");
  if (!timeout.empty()) {
    char* end = nullptr;
    const double seconds = std::strtod(timeout.c_str(), &end);
    LOOM_CHECK_AS(ConfigError, end && *end == '\0' && seconds > 0,
                  "LOOM_CPU_PROBE_TIMEOUT='", timeout,
                  "' is no positive number of seconds; unset it for the default 10");
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  return options;
}

bool first_on_this_node() {
  try {
    return detect_dist_env().local_rank == 0;
  } catch (const Error&) {
    return true;  // the engine reports a malformed launcher environment later
  }
}

}  // namespace

IsaChoice probe_isa(const CpuInfo& cpu, const ProbeOptions& options) {
  IsaChoice choice;
  std::vector<std::string> ladder = supported_isa_levels(cpu);
  const auto faults = parse_fault(options.fault, ladder);
  for (const auto& [level, kind] : faults)  // a faked level counts as supported
    if (std::find(ladder.begin(), ladder.end(), level) == ladder.end()) ladder.push_back(level);
  std::sort(ladder.begin(), ladder.end(),
            [](const std::string& a, const std::string& b) { return rank_of(a) < rank_of(b); });
  if (ladder.empty()) {
    choice.source = IsaSource::not_x86;
    choice.reason = "no x86-64 ISA levels: oneDNN's own choice, not probed";
    return choice;
  }
  choice.cpu_best = ladder.front();
  std::vector<ProbeStep> died;
  for (size_t i = 0; i < ladder.size(); ++i) {
    const std::string& level = ladder[i];
    const auto fault = faults.count(level) ? faults.at(level) : Fault::none;
    // The first child runs with no cap at all: exactly what oneDNN would pick by itself.
    const Outcome outcome = probe_once(i == 0 ? "" : level, fault, options.timeout);
    choice.steps.push_back({level, outcome.text});
    if (outcome.kind == Outcome::ok) {
      choice.level = level;
      if (i == 0) {
        choice.source = IsaSource::cpu_best;
        choice.reason = "this CPU's best; a probe passed";
      } else {
        choice.source = IsaSource::probe;
        choice.reason = describe_deaths(died) + " in a probe";
      }
      return choice;
    }
    if (outcome.kind == Outcome::signal) {
      died.push_back({level, outcome.text});
      continue;
    }
    if (outcome.kind == Outcome::timeout) {
      choice.source = IsaSource::probe;
      choice.level = safe_level(ladder, i + 1);
      if (choice.level == level) choice.level = ladder.back();
      choice.reason = level + " " + outcome.text + " in a probe, so the safe level, unprobed";
      return choice;
    }
    // The probe itself could not run (no fork, an exception): nothing says the ISA is at
    // fault, so the level stays, and the warning says the probe did not run.
    choice.level = level;
    choice.source = i == 0 ? IsaSource::cpu_best : IsaSource::probe;
    choice.reason = "the probe at " + level + " " + outcome.text + "; kept " + level + " unprobed";
    return choice;
  }
  choice.source = IsaSource::probe;
  choice.level = ladder.back();
  choice.reason = "every level died in a probe (" + describe_deaths(died) + "); " +
                  choice.level + " is the lowest: expect crashes";
  return choice;
}

const IsaChoice& ensure_cpu_kernels_work() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_ensured) return g_choice;
  g_cpu = read_cpu_info();
  const auto supported = supported_isa_levels(g_cpu);
  const std::string best = supported.empty() ? "" : supported.front();
  const char* user_name = std::getenv("ONEDNN_MAX_CPU_ISA") ? "ONEDNN_MAX_CPU_ISA"
                          : std::getenv("DNNL_MAX_CPU_ISA") ? "DNNL_MAX_CPU_ISA"
                                                            : nullptr;
  const std::string user = user_name ? env_or(user_name, "") : "";
  IsaChoice choice;
  choice.cpu_best = best;
  if (!user.empty()) {
    // The user's own choice: reported, never probed over.
    const std::string level = canonical_isa(user);
    choice.source = IsaSource::environment;
    choice.level = level.empty() ? best : capped(level, best);
    choice.reason = std::string(user_name) + "=" + user + " from the environment; not probed" +
                    (level.empty() ? " (no level loom knows: oneDNN's default applies)" : "");
  } else if (env_or("LOOM_CPU_PROBE", "1") == "0") {
    choice.source = best.empty() ? IsaSource::not_x86 : IsaSource::cpu_best;
    choice.level = best;
    choice.reason = "this CPU's best; not probed (LOOM_CPU_PROBE=0)";
  } else {
    choice = probe_isa(g_cpu, options_from_env());
    if (choice.source == IsaSource::probe)
      ::setenv("ONEDNN_MAX_CPU_ISA", upper(choice.level).c_str(), 1);
    const bool probe_failed = !choice.steps.empty() && choice.steps.back().outcome != "ok" &&
                              choice.source != IsaSource::probe;
    if ((choice.source == IsaSource::probe || probe_failed) && first_on_this_node())
      log::warn("CPU kernels: ", choice.reason, "; using ", choice.level,
                choice.source == IsaSource::probe
                    ? " (ONEDNN_MAX_CPU_ISA=" + upper(choice.level) +
                          "; set it yourself or [train] cpu_isa to choose another)"
                    : "");
  }
  g_choice = choice;
  g_ensured = true;
  return g_choice;
}

const IsaChoice& isa_in_effect() {
  ensure_cpu_kernels_work();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_choice;
}

void apply_job_isa(const std::string& value, const std::string& where) {
  const std::string level = parse_job_isa(value, where);
  // A program that did not call it in main() gets the probe here, late but before training.
  ensure_cpu_kernels_work();
  std::lock_guard<std::mutex> lock(g_mutex);
  const bool trained = g_trained;
  g_trained = true;
  if (level == "auto") return;
  const std::string effective = capped(level, g_choice.cpu_best);
  if (effective != g_choice.level && trained) {
    log::warn(where, ": [train] cpu_isa = \"", value, "\" cannot take effect in this process: oneDNN fixed its ",
              "level (", g_choice.level, ") when its first kernel ran, in an earlier training; "
              "run this job in a process of its own (loom run)");
    return;
  }
  for (const auto& step : g_choice.steps)
    if (step.level == level && step.outcome != "ok")
      log::warn(where, ": [train] cpu_isa = \"", value, "\" forces ", level, " although it ", step.outcome,
                " in the start-up probe");
  ::setenv("ONEDNN_MAX_CPU_ISA", upper(level).c_str(), 1);
  g_choice.level = effective;
  g_choice.source = IsaSource::job;
  g_choice.reason = "[train] cpu_isa = \"" + level + "\"";
  if (effective != level) g_choice.reason += "; above this CPU's best, so oneDNN stays at " + effective;
}

std::string describe_environment() {
  const IsaChoice choice = isa_in_effect();
  std::lock_guard<std::mutex> lock(g_mutex);
  std::ostringstream out;
  std::string present, absent;
  for (const auto& flag : relevant_flags()) (g_cpu.has(flag) ? present : absent) += " " + flag;
  std::string supported;
  for (const auto& level : supported_isa_levels(g_cpu)) supported += " " + level;
  const char* user = std::getenv("ONEDNN_MAX_CPU_ISA");
  out << "cpu          " << g_cpu.model << ", " << std::thread::hardware_concurrency()
      << " logical cores\n";
  out << "flags       " << (present.empty() ? " (none of those below)" : present) << "\n";
  out << "  absent    " << (absent.empty() ? " (none)" : absent) << "\n";
  out << "isa levels  " << (supported.empty() ? " (not x86-64)" : supported) << "\n";
  out << "oneDNN isa   " << choice.summary() << "\n";
  for (const auto& step : choice.steps)
    out << "  probe      " << step.level << ": " << step.outcome << "\n";
  out << "  env        ONEDNN_MAX_CPU_ISA" << (user ? std::string("=") + user : " unset") << "\n";
  out << "threads      " << at::get_num_threads() << " intra-op (LibTorch's default; a job's "
      << "[train] num_threads sets its own)\n";
  out << "torch        " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "."
      << TORCH_VERSION_PATCH;
#ifdef DNNL_VERSION_MAJOR
  out << ", oneDNN " << DNNL_VERSION_MAJOR << "." << DNNL_VERSION_MINOR << "."
      << DNNL_VERSION_PATCH;
#endif
  out << "\n";
  // Note [CUDA loaded on demand] (cuda_runtime.h).
  out << "cuda         LibTorch's CUDA half " << cuda_runtime_status() << "; "
      << cuda_device_count() << " device(s)\n";
  return out.str();
}

}  // namespace loom::cpu
