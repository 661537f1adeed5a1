// Where a run trains: its ranks, threads and device. See run_placement.h.
#include "run_placement.h"

#include <ATen/Context.h>

#include <chrono>

#include "comm_backends.h"
#include "device.h"
#include "loom/error.h"
#include "loom/log.h"
#include "prepared_job.h"

namespace loom {

std::unique_ptr<Comm> connect_ranks(const PreparedJob& job) {
  const auto& train = job.section("train");
  const auto& distributed = job.section("distributed");
  CommOptions options;
  options.backend = distributed.get_string("backend");
  const std::string device_name = train.get_string("device");
  options.cuda = device_name.rfind("cuda", 0) == 0 || (device_name == "auto" && at::hasCUDA());
  options.timeout = std::chrono::milliseconds(
      static_cast<int64_t>(distributed.get_float("timeout_seconds") * 1000));
  CommChecks checks;  // Note [Hang reports]
  checks.check_collectives = distributed.get_bool("check_collectives");
  checks.trace_folder = job.resolve_path(train.get_string("output_dir"));
  std::unique_ptr<Comm> comm = make_comm(options, checks);
  log::configure(comm->rank(), comm->world_size(), train.get_bool("log_all_ranks"),
                 job.log_level());
  return comm;
}

RankPlacement place_rank(const PreparedJob& job, const Comm& comm) {
  const auto& train = job.section("train");
  const std::string device_name = train.get_string("device");
  set_job_threads(train, comm.local_world_size());  // cpu_isa before any kernel
  RankPlacement out;
  out.device = pick_device(device_name, train.where("device"), comm.local_rank(),
                           comm.local_world_size());
  activate_device(out.device);
  out.malloc_note = out.device.is_cpu() ? keep_freed_cpu_memory() : "";
  LOOM_CHECK_AS(ConfigError, comm.device().is_cpu() || out.device.is_cuda(),
                job.section("distributed").where("backend"), ": [distributed] backend = \"",
                comm.backend(), "\" moves CUDA tensors only, but this job trains on ",
                out.device.str(), " ([train] device = \"", device_name,
                "\"); use backend = \"gloo\" or \"mpi\" on CPUs, or a CUDA device");
  if (job.data_parallel_by_default())  // Note [Data parallelism by default]
    log::info("data parallelism by default: ", comm.world_size(), " ranks and no [ddp] or "
              "[zero] table, so [ddp] with its defaults (a [ddp] or [zero] table chooses)");
  // Several ranks need something that keeps their replicas in step (a world size the
  // launcher's environment did not say, e.g. [distributed] backend = "local" under mpirun).
  const bool synced = comm.world_size() == 1 || job.resolved().table_plugin_in(Slot::grad_sync);
  LOOM_CHECK_AS(ConfigError, synced, "this job runs on ", comm.world_size(),
                " ranks but no plugin synchronises gradients, so each rank would train its "
                "own model; add a [ddp] table (data parallelism)");
  return out;
}

}  // namespace loom
