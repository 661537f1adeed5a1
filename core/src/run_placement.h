// run_placement.h (core-internal) — where a run trains: its ranks (the Comm [distributed] asks
// for, the log told this rank), and this rank's CPU threads and device, checked against the
// ranks. The first things the engine's setup does; nothing of the job's model or data.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "loom/comm.h"

namespace loom {

class PreparedJob;

// The ranks: [distributed] backend, timeout_seconds and check_collectives (Note [Hang reports],
// its traces in output_dir), for CUDA when [train] device asks for it; then the log configured
// with this rank ([train] log_all_ranks).
std::unique_ptr<Comm> connect_ranks(const PreparedJob& job);

struct RankPlacement {
  c10::Device device{c10::kCPU};
  std::string malloc_note;  // Note [Freed memory kept]: what was set, for the log ("": nothing)
};
// This rank's threads (set_job_threads) and device ([train] device, the node's local rank's GPU
// for cuda and auto), made current; on a CPU, malloc keeps freed memory. ConfigErrors: a
// backend that moves CUDA tensors only on a CPU device, and several ranks with no plugin that
// synchronises gradients. Says when [ddp] was switched on by default (Note [Data parallelism by
// default]).
RankPlacement place_rank(const PreparedJob& job, const Comm& comm);

}  // namespace loom
