// loom-launch: starts the ranks of one node with torchrun's environment (RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT),
// prefixes each rank's output, stops the others when one fails and exits with its code,
// restarts the node's group up to --max-restarts times (the job resumes from its latest
// checkpoint), and forwards SIGINT/SIGTERM: the first lets the ranks finish their step and save
// (Note [Graceful stop] in loom/trainer.h) and is waited for; a second stops them at once. The
// ranks die with the launcher (PR_SET_PDEATHSIG): a killed launcher leaves no rank training
// on. Not a scheduler: one launcher per node, as torchrun in its static mode.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

const char* kUsage = R"(usage: loom-launch [options] [--] COMMAND [ARGS...]

Starts --nproc-per-node copies of COMMAND on this node with torchrun's environment variables.

  --nproc-per-node N   ranks on this node (default 1)
  --nnodes M           nodes in the job (default 1)
  --node-rank K        this node's index, 0..M-1 (default 0)
  --master-addr A      address of rank 0's rendezvous (default 127.0.0.1)
  --master-port P      its TCP port (default 29500)
  --max-restarts R     restart this node's ranks up to R times after a failure (default 0);
                       a restarted job resumes from its latest checkpoint by itself (give it
                       save_steps, or it starts over)
  --grace-seconds S    after a failure, time the other ranks get to exit before SIGKILL (5)

example: loom-launch --nproc-per-node 2 build/bin/loom run examples/demo.toml
)";

volatile sig_atomic_t g_signal = 0, g_signal_count = 0;
int64_t g_last_signal_ns = 0;
// A repeat within half a second is the same request (Note [Signals arrive twice] in
// core/src/stop_signal.cpp: `timeout` and Slurm deliver one stop twice).
void on_signal(int sig) {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  const int64_t now = static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
  if (g_signal_count > 0 && now - g_last_signal_ns < 500'000'000) return;
  g_last_signal_ns = now;
  g_signal = sig;
  g_signal_count = g_signal_count + 1;
}

[[noreturn]] void usage_error(const std::string& what) {
  std::cerr << "loom-launch: error: " << what << "\n" << kUsage;
  std::exit(2);
}

int parse_int(const std::string& flag, const char* text, int min) {
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (!end || *end || end == text || value < min)
    usage_error(flag + " needs an integer >= " + std::to_string(min) + ", got '" + text + "'");
  return static_cast<int>(value);
}

struct Options {
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 29500, max_restarts = 0, grace = 5;
  std::string master_addr = "127.0.0.1";
  std::vector<std::string> command;
};

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (a.rfind("--", 0) != 0) break;
    std::string value;
    const auto eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      value = argv[++i];
    }
    if (a == "--nproc-per-node" || a == "--nproc_per_node") o.nproc = parse_int(a, value.c_str(), 1);
    else if (a == "--nnodes") o.nnodes = parse_int(a, value.c_str(), 1);
    else if (a == "--node-rank" || a == "--node_rank") o.node_rank = parse_int(a, value.c_str(), 0);
    else if (a == "--master-addr" || a == "--master_addr") o.master_addr = value;
    else if (a == "--master-port" || a == "--master_port") o.master_port = parse_int(a, value.c_str(), 1);
    else if (a == "--max-restarts" || a == "--max_restarts") o.max_restarts = parse_int(a, value.c_str(), 0);
    else if (a == "--grace-seconds") o.grace = parse_int(a, value.c_str(), 0);
    else usage_error("unknown option " + a);
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.command.empty()) usage_error("no COMMAND to launch");
  if (o.node_rank >= o.nnodes)
    usage_error("--node-rank " + std::to_string(o.node_rank) + " must be below --nnodes " +
                std::to_string(o.nnodes));
  if (o.master_port > 65535) usage_error("--master-port must be a TCP port (1..65535)");
  return o;
}

struct Child {
  int local_rank = 0, global_rank = 0;
  pid_t pid = -1;
  int out = -1;             // read end of the child's stdout+stderr
  std::string partial;      // an unfinished output line
  bool running = false;
  int status = 0;
};

void emit(Child& c, const char* data, size_t n) {
  c.partial.append(data, n);
  size_t start = 0, nl;
  while ((nl = c.partial.find('\n', start)) != std::string::npos) {
    std::string line = "[rank " + std::to_string(c.global_rank) + "] " +
                       c.partial.substr(start, nl - start + 1);
    ::write(STDOUT_FILENO, line.data(), line.size());
    start = nl + 1;
  }
  c.partial.erase(0, start);
}

void drain(Child& c, bool final) {
  if (c.out < 0) return;
  char buffer[65536];
  while (true) {
    ssize_t n = ::read(c.out, buffer, sizeof buffer);
    if (n > 0) {
      emit(c, buffer, static_cast<size_t>(n));
      continue;
    }
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      ::close(c.out);
      c.out = -1;
    }
    break;
  }
  if (final && !c.partial.empty()) emit(c, "\n", 1);
}

pid_t spawn(const Options& o, Child& c, int attempt) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) {
    std::perror("loom-launch: pipe");
    std::exit(1);
  }
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);  // its own group: a signal to the rank reaches its children too
    // Dies with the launcher, even by SIGKILL; if the launcher is already gone, at once.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher) ::_exit(128 + SIGKILL);
    ::dup2(pipefd[1], STDOUT_FILENO);
    ::dup2(pipefd[1], STDERR_FILENO);
    ::close(pipefd[0]);
    ::close(pipefd[1]);
    const int world = o.nnodes * o.nproc;
    auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
    set("RANK", std::to_string(c.global_rank));
    set("LOCAL_RANK", std::to_string(c.local_rank));
    set("WORLD_SIZE", std::to_string(world));
    set("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
    set("GROUP_RANK", std::to_string(o.node_rank));
    set("MASTER_ADDR", o.master_addr);
    set("MASTER_PORT", std::to_string(o.master_port));
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(attempt));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts));
    std::vector<char*> args;
    for (const auto& a : o.command) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "loom-launch: cannot run '%s': %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(pipefd[1]);
  ::fcntl(pipefd[0], F_SETFL, O_NONBLOCK);
  c.pid = pid;
  c.out = pipefd[0];
  c.running = true;
  c.partial.clear();
  return pid;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "exit code " + std::to_string(exit_code_of(status));
}

void signal_all(std::vector<Child>& children, int sig) {
  for (auto& c : children)
    if (c.running) ::kill(-c.pid, sig);
}

// Runs one attempt. Returns 0, or the failing rank's exit code (first failure wins).
int run_group(const Options& o, int attempt, int* failed_rank) {
  std::vector<Child> children(o.nproc);
  for (int i = 0; i < o.nproc; ++i) {
    children[i].local_rank = i;
    children[i].global_rank = o.node_rank * o.nproc + i;
    spawn(o, children[i], attempt);
  }
  int result = 0;
  bool stopping = false;
  sig_atomic_t forwarded = 0;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  size_t running = children.size();
  while (running > 0 || std::any_of(children.begin(), children.end(),
                                    [](const Child& c) { return c.out >= 0; })) {
    std::vector<pollfd> fds;
    for (auto& c : children)
      if (c.out >= 0) fds.push_back({c.out, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 100);
    for (auto& c : children) drain(c, false);
    if (g_signal_count > forwarded) {
      forwarded = g_signal_count;
      signal_all(children, g_signal);
      result = 128 + g_signal;
      if (forwarded == 1 && !stopping) {
        std::fprintf(stderr, "[loom-launch] %s: passed to every rank; they stop after their "
                     "current step (saving a checkpoint if the job saves); send it again to "
                     "stop them at once\n", strsignal(g_signal));
      } else {
        std::fprintf(stderr, "[loom-launch] %s again: stopping all ranks now\n",
                     strsignal(g_signal));
        stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.grace);
      }
      stopping = true;
    }
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      if (::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
      c.running = false;
      c.status = status;
      --running;
      if (exit_code_of(status) != 0 && !stopping) {
        result = exit_code_of(status);
        *failed_rank = c.global_rank;
        std::fprintf(stderr, "[loom-launch] rank %d failed (%s); stopping the other ranks\n",
                     c.global_rank, describe(status).c_str());
        signal_all(children, SIGTERM);
        stopping = true;
        stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.grace);
      }
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
      signal_all(children, SIGKILL);
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
  }
  for (auto& c : children) drain(c, true);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  for (int attempt = 0;; ++attempt) {
    int failed_rank = -1;
    const int code = run_group(o, attempt, &failed_rank);
    if (code == 0) return 0;
    if (g_signal) return 128 + g_signal;
    if (attempt >= o.max_restarts) {
      std::fprintf(stderr, "[loom-launch] rank %d failed with exit code %d%s\n", failed_rank,
                   code, o.max_restarts ? " and no restarts are left" : "");
      return code;
    }
    std::fprintf(stderr, "[loom-launch] restarting the ranks of node %d (restart %d of %d)\n",
                 o.node_rank, attempt + 1, o.max_restarts);
  }
}
