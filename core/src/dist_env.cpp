// Rank and world detection from launcher environments.
#include "dist_env.h"

#include <atomic>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "loom/error.h"
#include "slurm_env.h"

namespace loom {
namespace {

bool has(const char* name) { return std::getenv(name) != nullptr; }

// The value of `name`, which is set.
long long_env(const char* name) {
  const char* raw = std::getenv(name);
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(raw, &end, 10);
  LOOM_CHECK_AS(ConfigError, end && *end == '\0' && end != raw && value >= 0 && errno == 0,
                "environment ", name, "='", raw, "' is not a non-negative integer; fix the "
                "launcher's settings");
  return value;
}

int int_env(const char* name, int fallback) {
  if (!has(name)) return fallback;
  const long value = long_env(name);
  LOOM_CHECK_AS(ConfigError, value <= std::numeric_limits<int>::max(), "environment ", name,
                "='", value, "' is too large; fix the launcher's settings");
  return static_cast<int>(value);
}

// The first of `names` that is set, or nullptr.
const char* first_set(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (has(name)) return name;
  return nullptr;
}

// This node's tasks under srun. The step's own counts come first (a step may use fewer nodes
// or tasks than its job), then the job's; --ntasks-per-node's single number holds on every
// node. None of them: one task on this node.
int slurm_local_world_size(const DistEnv& env) {
  const char* name = first_set({"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  if (!name) return int_env("SLURM_NTASKS_PER_NODE", 1);
  const std::string text = std::getenv(name);
  const std::vector<int> counts = parse_slurm_task_counts(text, name);
  LOOM_CHECK_AS(ConfigError, static_cast<size_t>(env.node_rank) < counts.size(), "SLURM_NODEID=",
                env.node_rank, " names node ", env.node_rank, " (from 0), but ", name, "='",
                text, "' counts the tasks of ", counts.size(), " node(s)");
  if (std::string(name) == "SLURM_STEP_TASKS_PER_NODE") {
    long total = 0;
    for (int count : counts) total += count;
    LOOM_CHECK_AS(ConfigError, total == env.world_size, name, "='", text, "' counts ", total,
                  " tasks, but SLURM_NTASKS=", env.world_size);
  }
  return counts[env.node_rank];
}

// Rank 0's host under srun when no MASTER_ADDR is set: the first host of the step's node list,
// where Slurm's block and cyclic distributions put task 0. A job on one node keeps the loopback
// default.
void slurm_master_addr(DistEnv& env) {
  if (env.world_size <= env.local_world_size) return;
  const char* name = first_set({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (!name) return;  // check_rendezvous_address says what to set
  const std::string text = std::getenv(name);
  const std::vector<std::string> hosts = expand_slurm_hostlist(text, name);
  LOOM_CHECK_AS(ConfigError, static_cast<size_t>(env.node_rank) < hosts.size(), "SLURM_NODEID=",
                env.node_rank, " names node ", env.node_rank, " (from 0), but ", name, "='",
                text, "' names ", hosts.size(), " host(s)");
  env.master_addr = hosts.front();
  env.master_addr_from = name;
}

}  // namespace

namespace {
std::atomic<int> solo_scopes{0};
}  // namespace

DistEnv detect_dist_env() {
  DistEnv env;
  if (has("RANK") && has("WORLD_SIZE")) {
    env.launcher = "torchrun";
    env.rank = int_env("RANK", 0);
    env.world_size = int_env("WORLD_SIZE", 1);
    env.local_rank = int_env("LOCAL_RANK", env.rank);
    env.local_world_size = int_env("LOCAL_WORLD_SIZE", env.world_size);
    // torchrun sets GROUP_RANK; NODE_RANK is what other launchers (and torchrun's --node-rank)
    // call it.
    if (const char* node = first_set({"GROUP_RANK", "NODE_RANK"})) env.node_rank = int_env(node, 0);
  } else if (has("OMPI_COMM_WORLD_SIZE")) {
    env.launcher = "openmpi";
    env.rank = int_env("OMPI_COMM_WORLD_RANK", 0);
    env.world_size = int_env("OMPI_COMM_WORLD_SIZE", 1);
    env.local_rank = int_env("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    env.local_world_size = int_env("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  } else if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
    // srun --mpi=pmix sets PMIX_RANK too (equal to SLURM_PROCID); Slurm's variables say more.
    env.launcher = "slurm";
    env.rank = int_env("SLURM_PROCID", 0);
    env.world_size = int_env("SLURM_NTASKS", 1);
    env.local_rank = int_env("SLURM_LOCALID", 0);
    env.node_rank = int_env("SLURM_NODEID", 0);
    env.local_world_size = slurm_local_world_size(env);
  } else if (has("PMIX_RANK")) {
    // Another PMIx launcher (prterun; Open MPI's mpirun sets OMPI_COMM_WORLD_* beside
    // PMIX_RANK). PMIx gives the world's size through its API only: the environment has it
    // only where the launcher also speaks PMI (PMI_SIZE) or Hydra's MPI_LOCAL* names.
    env.launcher = "pmix";
    env.rank = int_env("PMIX_RANK", 0);
    LOOM_CHECK_AS(ConfigError, has("PMI_SIZE"), "PMIX_RANK=", env.rank, " says a PMIx launcher "
                  "started this process, but no variable gives the number of ranks (PMIx has it "
                  "in its API only); start loom with Open MPI's mpirun, srun, torchrun or "
                  "loom-launch, or set RANK and WORLD_SIZE");
    env.world_size = int_env("PMI_SIZE", 1);
    env.local_rank = int_env("MPI_LOCALRANKID", 0);
    env.local_world_size = int_env("MPI_LOCALNRANKS", 1);
  }
  if (const char* addr = std::getenv("MASTER_ADDR")) {
    env.master_addr = addr;
    env.master_addr_from = "MASTER_ADDR";
  } else if (env.launcher == "slurm") {
    slurm_master_addr(env);
  }
  if (has("MASTER_PORT")) {
    env.master_port = int_env("MASTER_PORT", env.master_port);
    env.master_port_from = "MASTER_PORT";
  } else if (env.launcher == "slurm" && has("SLURM_JOB_ID")) {
    // Two jobs sharing a node then meet at different ports; every rank of a job computes the
    // same one.
    env.master_port = 10000 + static_cast<int>(long_env("SLURM_JOB_ID") % 20000);
    env.master_port_from = "SLURM_JOB_ID";
  }
  env.restart_count = int_env("TORCHELASTIC_RESTART_COUNT", 0);
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE"))
    env.agent_store = std::string(agent) == "True" || std::string(agent) == "1";
  LOOM_CHECK_AS(ConfigError, env.world_size >= 1, "the launcher says the world has ",
                env.world_size, " ranks");
  LOOM_CHECK_AS(ConfigError, env.rank < env.world_size, "the launcher (", env.launcher,
                ") gives rank ", env.rank, " in a world of ", env.world_size,
                " ranks; check RANK/WORLD_SIZE");
  LOOM_CHECK_AS(ConfigError, env.local_rank < std::max(1, env.local_world_size), "local rank ",
                env.local_rank, " >= local world size ", env.local_world_size);
  LOOM_CHECK_AS(ConfigError, env.master_port > 0 && env.master_port < 65536, "MASTER_PORT=",
                env.master_port, " is not a TCP port");
  if (solo_scopes.load() > 0) {  // Note [Solo probes]
    env.rank = 0;
    env.world_size = env.local_world_size = 1;
    env.launcher = "none";
  }
  return env;
}

SoloScope::SoloScope() { ++solo_scopes; }
SoloScope::~SoloScope() { --solo_scopes; }

std::string describe_derived_rendezvous(const DistEnv& env) {
  std::string derived;
  if (!env.master_addr_from.empty() && env.master_addr_from != "MASTER_ADDR")
    derived = detail::cat("MASTER_ADDR = ", env.master_addr, ", the first host of ",
                          env.master_addr_from);
  if (!env.master_port_from.empty() && env.master_port_from != "MASTER_PORT")
    derived += detail::cat(derived.empty() ? "" : "; ", "MASTER_PORT = ", env.master_port,
                           " from ", env.master_port_from, " (10000 + id % 20000)");
  if (derived.empty()) return derived;
  return detail::cat(env.launcher, " launch, rank ", env.rank, " of ", env.world_size, " on node ",
                     env.node_rank, " (", env.local_world_size, " rank(s) there): ", derived);
}

void check_rendezvous_address(const DistEnv& env) {
  const bool spans_hosts = env.world_size > std::max(1, env.local_world_size);
  if (!env.master_addr_from.empty() || !spans_hosts) return;
  const std::string how =
      env.launcher == "openmpi" ? "mpirun -x MASTER_ADDR=<rank 0's host> (or [distributed] "
                                  "backend = \"mpi\", which needs no address)"
      : env.launcher == "slurm" ? "export MASTER_ADDR=$(scontrol show hostnames "
                                  "\"$SLURM_JOB_NODELIST\" | head -n 1) before srun (srun "
                                  "sets SLURM_STEP_NODELIST, whose first host loom takes, but "
                                  "it is not set here)"
                                : "MASTER_ADDR=<rank 0's host> (loom-launch --master-addr)";
  throw ConfigError(detail::cat(
      "this job's ", env.world_size, " ranks span several hosts (", env.local_world_size,
      " on this one) but MASTER_ADDR is not set, so the ranks of other hosts cannot find rank "
      "0's rendezvous (the default 127.0.0.1 is each host's own); set ", how));
}

}  // namespace loom
