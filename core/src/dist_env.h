// dist_env.h (core-internal) — who this process is among the ranks of a job, read from the
// environment its launcher set: torchrun / loom-launch (RANK, WORLD_SIZE, ...), Open MPI's
// mpirun (OMPI_COMM_WORLD_*), or Slurm's srun (SLURM_PROCID, ...). No environment: one rank.
#pragma once

#include <string>

namespace loom {

struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  bool master_addr_given = false;  // MASTER_ADDR was set (else the loopback default above)
  int master_port = 29500;
  std::string launcher = "none";  // torchrun | openmpi | slurm | none
  int restart_count = 0;          // TORCHELASTIC_RESTART_COUNT (loom-launch restarts)
  // torchrun's agent already serves the rendezvous store at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True): rank 0 joins it as a client instead of serving it.
  bool agent_store = false;
};

// Throws ConfigError naming the variable when a value is malformed or inconsistent
// (RANK >= WORLD_SIZE...).
DistEnv detect_dist_env();

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
