// comm_backends.h (core-internal) — factories of the multi-process Comm backends, registered
// by name in comm.cpp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dist_env.h"
#include "loom/comm.h"

namespace loom {
// What the engine asks of the multi-process backends beyond the SDK's CommOptions (kept out of
// the SDK: no plugin needs them). Note [Hang reports] in comm_trace.cpp.
struct CommChecks {
  bool check_collectives = false;  // [distributed] check_collectives
  // mpi: a folder every rank can write and read (the job's output_dir) for the trace's files;
  // empty: no peer lines, each rank reports only its own last collectives.
  std::string trace_folder;
};
// make_comm with the checks (the engine's call); make_comm(options) passes none.
std::unique_ptr<Comm> make_comm(const CommOptions& options, const CommChecks& checks);

std::unique_ptr<Comm> make_mpi_comm(const CommOptions& options, const CommChecks& checks);
std::unique_ptr<Comm> make_gloo_comm(const CommOptions& options, const DistEnv& env,
                                     const CommChecks& checks);
// Compiled in CUDA builds only; elsewhere it throws a ConfigError saying so.
std::unique_ptr<Comm> make_nccl_comm(const CommOptions& options, const DistEnv& env,
                                     const CommChecks& checks);
bool nccl_built();

// Rendezvous helper shared by gloo and nccl: a socket bound to MASTER_ADDR:MASTER_PORT for
// rank 0's store server (so the store listens on that address only — loopback by default —
// and a port in use is our clear error, not a retry loop).
int listen_on_master(const DistEnv& env);

// all_to_all_rows' argument check (counts per rank, rows, dtype), shared by the backends.
void check_rows(const at::Tensor& output, const at::Tensor& input,
                const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                int world, const char* op);

// Wraps a backend's failure into loom's error: the rank, the operation, what to check.
[[noreturn]] void comm_failure(int rank, const char* op, const std::string& why);
}  // namespace loom
