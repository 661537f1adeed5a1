// run_output.h (core-internal) — what a run keeps in its output_dir besides checkpoints and
// metrics: which checkpoint it resumes from, and run.json.
#pragma once

#include <functional>
#include <string>

#include "loom/config.h"
#include "loom/memory.h"

namespace loom {

// The checkpoint folder a run starts from, or "" for a fresh start: [train] resume ("latest":
// the newest in output_dir, if any; a folder, made absolute by `resolve`), or "latest" when a
// launcher restarted the job (TORCHELASTIC_RESTART_COUNT > 0) and resume is "". An earlier
// run's checkpoints without resume were refused by the PreparedJob before anything was built.
std::string resume_folder(const ConfigSection& train, const std::string& output_dir,
                          const std::function<std::string(const std::string&)>& resolve);

// output_dir/run.json (rank 0): what ran where, and the model-state bytes, for tools and
// benchmarks.
struct RunInfo {
  std::string device, backend, config_hash, model, optimizer;
  int threads = 0, world_size = 1;
  memory::ModelState model_state;
};
void write_run_info_file(const std::string& output_dir, const RunInfo& info);

}  // namespace loom
