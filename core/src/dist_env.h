// dist_env.h (core-internal) — who this process is among the ranks of a job, read from the
// environment its launcher set: torchrun / loom-launch (RANK, WORLD_SIZE, ...), Open MPI's
// mpirun (OMPI_COMM_WORLD_*), Slurm's srun (SLURM_PROCID, ...), or another PMIx launcher
// (PMIX_RANK). No environment: one rank.
#pragma once

#include <string>

namespace loom {

struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  int node_rank = 0;  // this node's index: GROUP_RANK or NODE_RANK (torchrun), SLURM_NODEID
  std::string master_addr = "127.0.0.1";
  // The variable master_addr came from: MASTER_ADDR, or the Slurm node list whose first host it
  // is; empty for the loopback default above.
  std::string master_addr_from;
  int master_port = 29500;
  std::string master_port_from;  // MASTER_PORT, SLURM_JOB_ID, or empty for the default
  std::string launcher = "none";  // torchrun | openmpi | slurm | pmix | none
  int restart_count = 0;          // TORCHELASTIC_RESTART_COUNT (loom-launch restarts)
  // torchrun's agent already serves the rendezvous store at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): rank 0 joins it as a client instead of serving it.
  bool agent_store = false;
};

// Throws ConfigError naming the variable when a value is malformed or inconsistent
// (RANK >= WORLD_SIZE, a hostlist that does not parse, SLURM_NODEID past the node list...).
// Under srun without MASTER_ADDR, a job on several nodes meets at the first host of the step's
// node list; without MASTER_PORT, any srun job at 10000 + SLURM_JOB_ID % 20000 (below the
// kernel's ephemeral ports, and different for jobs that share a node).
DistEnv detect_dist_env();

// One line saying which rendezvous settings were derived rather than given (MASTER_ADDR from
// Slurm's node list, MASTER_PORT from the job id), for the launch's log; empty when none were.
std::string describe_derived_rendezvous(const DistEnv& env);

// Note [Solo probes]: while a SoloScope lives, detect_dist_env() says this process is a world of
// one (rank 0, no launcher) whatever the launcher set; the local rank is kept, so a GPU probe
// runs on this rank's own device. auto_find_batch_size probes the job this way on every rank.
class SoloScope {
 public:
  SoloScope();
  ~SoloScope();
  SoloScope(const SoloScope&) = delete;
  SoloScope& operator=(const SoloScope&) = delete;
};

// Checks that a TCP rendezvous (gloo, nccl) can find rank 0: a job whose ranks span hosts
// (world size above the ranks of this node) needs MASTER_ADDR, since mpirun and srun set none
// and the loopback default would leave every other host's ranks waiting for a store that is not
// there. ConfigError naming what to set, for each launcher.
void check_rendezvous_address(const DistEnv& env);

}  // namespace loom
