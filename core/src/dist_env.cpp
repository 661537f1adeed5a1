// Rank and world detection from launcher environments.
#include "dist_env.h"

#include <atomic>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "loom/error.h"

namespace loom {
namespace {

bool has(const char* name) { return std::getenv(name) != nullptr; }

int int_env(const char* name, int fallback) {
  const char* raw = std::getenv(name);
  if (!raw) return fallback;
  char* end = nullptr;
  const long value = std::strtol(raw, &end, 10);
  LOOM_CHECK_AS(ConfigError, end && *end == '\0' && end != raw && value >= 0, "environment ",
                name, "='", raw, "' is not a non-negative integer; fix the launcher's settings");
  return static_cast<int>(value);
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
  } else if (has("OMPI_COMM_WORLD_SIZE")) {
    env.launcher = "openmpi";
    env.rank = int_env("OMPI_COMM_WORLD_RANK", 0);
    env.world_size = int_env("OMPI_COMM_WORLD_SIZE", 1);
    env.local_rank = int_env("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    env.local_world_size = int_env("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  } else if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
    env.launcher = "slurm";
    env.rank = int_env("SLURM_PROCID", 0);
    env.world_size = int_env("SLURM_NTASKS", 1);
    env.local_rank = int_env("SLURM_LOCALID", 0);
    env.local_world_size = int_env("SLURM_NTASKS_PER_NODE", int_env("SLURM_TASKS_PER_NODE", 1));
  }
  if (const char* addr = std::getenv("MASTER_ADDR")) {
    env.master_addr = addr;
    env.master_addr_given = true;
  }
  env.master_port = int_env("MASTER_PORT", env.master_port);
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

void check_rendezvous_address(const DistEnv& env) {
  const bool spans_hosts = env.world_size > std::max(1, env.local_world_size);
  if (env.master_addr_given || !spans_hosts) return;
  const std::string how =
      env.launcher == "openmpi" ? "mpirun -x MASTER_ADDR=<rank 0's host> (or [distributed] "
                                  "backend = \"mpi\", which needs no address)"
      : env.launcher == "slurm" ? "export MASTER_ADDR=$(scontrol show hostnames "
                                  "\"$SLURM_JOB_NODELIST\" | head -n 1) before srun"
                                : "MASTER_ADDR=<rank 0's host> (loom-launch --master-addr)";
  throw ConfigError(detail::cat(
      "this job's ", env.world_size, " ranks span several hosts (", env.local_world_size,
      " on this one) but MASTER_ADDR is not set, so the ranks of other hosts cannot find rank "
      "0's rendezvous (the default 127.0.0.1 is each host's own); set ", how));
}

}  // namespace loom
