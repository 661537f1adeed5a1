// Note [Graceful stop] (loom/trainer.h): the first SIGTERM or SIGINT is a request to stop after
// the current step; a second one, half a second or more later, ends the process at once.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <cstring>

#include "loom/trainer.h"

namespace loom {
namespace {

std::atomic<int> g_stop{0};

// Note [Signals arrive twice]: Slurm signals every process of a step (the launcher and each
// rank), `timeout` its child and then its whole group, and loom-launch forwards what it gets:
// one pre-emption often reaches a rank twice within milliseconds. A repeat within half a
// second is the same request; a later one is the user's "stop now".
constexpr int64_t kSameRequestNs = 500'000'000;
std::atomic<int64_t> g_first_ns{0};

int64_t now_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);  // async-signal-safe
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

void on_stop_signal(int sig) {
  // Only async-signal-safe calls here: write(2), clock_gettime, no streams, no allocation.
  const int64_t now = now_ns();
  if (stop_requested() != 0) {
    if (now - g_first_ns.load() < kSameRequestNs) return;
    const char text[] = "loom: second stop signal: stopping now\n";
    const ssize_t ignored = ::write(STDERR_FILENO, text, sizeof text - 1);
    (void)ignored;
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_first_ns.store(now);
  request_stop(sig);
  const char* text = sig == SIGINT
                         ? "loom: SIGINT: stopping after this step (saving a checkpoint if the "
                           "job saves); send it again to stop at once\n"
                         : "loom: SIGTERM: stopping after this step (saving a checkpoint if the "
                           "job saves); send it again to stop at once\n";
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // blocking reads and collectives go on; the flag is polled
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
}

int stop_requested() { return g_stop.load(std::memory_order_relaxed); }

void request_stop(int signal) {
  int expected = 0;
  g_stop.compare_exchange_strong(expected, signal);
}

}  // namespace loom
