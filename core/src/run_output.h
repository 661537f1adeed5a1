// run_output.h (core-internal) — what a run says about itself and keeps in its output_dir
// besides checkpoints: the folder claimed, which checkpoint it resumes from, where the step
// report writes, the opening log lines, and run.json.
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>

#include "loom/config.h"
#include "loom/engine.h"
#include "loom/memory.h"
#include "step_report.h"

namespace loom {

class Comm;
class OutputDirClaim;
class PreparedJob;

// A run's output_dir opened: made and, on rank 0, claimed for this run (Note [One run per
// output_dir], checkpoint_io.h; the temporary folders of saves that never finished removed and
// said in the log), the checkpoint it resumes from found (resume_folder), and the step report
// made from [train]: metrics.jsonl there, the progress bar and the log lines, and with
// `tensorboard` its event files in logging_dir (made absolute by `resolve`), or output_dir/runs.
// The report starts neither fresh nor resumed: the engine says which.
struct OpenedOutputDir {
  std::unique_ptr<OutputDirClaim> claim;  // null on ranks other than 0
  std::string resume_from;                // "": a fresh start
  std::unique_ptr<StepReport> report;
};
OpenedOutputDir open_output_dir(const ConfigSection& train, const std::string& output_dir,
                                const Comm& comm, c10::Device device, bool tensorboard,
                                const std::function<std::string(const std::string&)>& resolve);

// The run's opening lines in the log: versions, device, threads and ranks; the rendezvous loom
// derived; the job, its notes and warnings; every plugin's file; the CPU and oneDNN's ISA; and
// `malloc_note` (Note [Freed memory kept]) when not empty.
void log_run_start(PreparedJob& job, const Comm& comm, c10::Device device,
                   const std::string& malloc_note);

// The checkpoint folder a run starts from, or "" for a fresh start: [train] resume ("latest":
// the newest in output_dir, if any; a folder, made absolute by `resolve`), or "latest" when a
// launcher restarted the job (TORCHELASTIC_RESTART_COUNT > 0) and resume is "". An earlier
// run's checkpoints without resume were refused by the PreparedJob before anything was built.
std::string resume_folder(const ConfigSection& train, const std::string& output_dir,
                          const std::function<std::string(const std::string&)>& resolve);

// The lines that end setup: the model and its state's bytes, the data and the samples each
// step trains, the evaluation set and when (`evaluation`; "" without one), the update rule and
// its schedule.
struct RunPlan {
  std::string model;
  memory::ModelState model_state;
  std::string data;
  int64_t batch_size = 0, accumulation_steps = 1;
  int world_size = 1;
  std::string evaluation;
  std::string optimizer;
  double learning_rate = 0;
  std::string schedule;
  double max_grad_norm = 0;
};
void log_run_plan(const RunPlan& plan);

// The run's last line: the steps, the final loss, the steps this run took (from `first_step`)
// in `seconds`, and the peak memory of `device` and of the process.
void log_run_end(const TrainState& state, int64_t first_step, double seconds, c10::Device device);

// output_dir/run.json (rank 0): what ran where, and the model-state bytes, for tools and
// benchmarks.
struct RunInfo {
  std::string device, backend, config_hash, model, optimizer;
  int threads = 0, world_size = 1;
  memory::ModelState model_state;
};
void write_run_info_file(const std::string& output_dir, const RunInfo& info);

}  // namespace loom
