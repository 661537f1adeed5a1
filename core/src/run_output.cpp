// What a run says about itself and keeps in its output_dir (run_output.h).
#include "run_output.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint_io.h"
#include "dist_env.h"
#include "loom/comm.h"
#include "loom/cpu.h"
#include "loom/log.h"
#include "loom/plugin.h"
#include "loom/trainer.h"
#include "prepared_job.h"

namespace loom {

std::string resume_folder(const ConfigSection& train, const std::string& output_dir,
                          const std::function<std::string(const std::string&)>& resolve) {
  std::string resume = train.get_string("resume");
  if (!resume.empty() && resume != "latest") return resolve(resume);
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (resume.empty() && restarts && std::atoi(restarts) > 0) {
    // A launcher restarted this job after a failure: carry on from where it was.
    log::info("restart ", restarts, " of this job: resuming from the latest checkpoint");
    resume = "latest";
  }
  if (resume.empty()) return "";
  std::string folder = latest_checkpoint(output_dir);
  if (folder.empty())
    log::info("resume = \"latest\": no checkpoint in ", output_dir, " yet, starting fresh");
  return folder;
}

OpenedOutputDir open_output_dir(const ConfigSection& train, const std::string& output_dir,
                                const Comm& comm, c10::Device device, bool tensorboard,
                                const std::function<std::string(const std::string&)>& resolve) {
  OpenedOutputDir out;
  std::filesystem::create_directories(output_dir);
  if (comm.rank() == 0) {
    out.claim = std::make_unique<OutputDirClaim>(output_dir);
    for (const auto& name : out.claim->removed_temp_folders())
      log::info("removed ", output_dir, "/", name, ": a checkpoint save that never finished");
  }
  out.resume_from = resume_folder(train, output_dir, resolve);
  StepReport::Options report;
  report.metrics_path = output_dir + "/metrics.jsonl";
  report.rank = comm.rank();
  report.world_size = comm.world_size();
  report.progress_bar = train.get_bool("progress_bar");
  report.logging_steps = train.get_int("logging_steps");
  report.logging_first_step = train.get_bool("logging_first_step");
  if (tensorboard)
    report.tensorboard_dir = train.get_string("logging_dir").empty()
                                 ? output_dir + "/runs"
                                 : resolve(train.get_string("logging_dir"));
  report.device = device;
  out.report = std::make_unique<StepReport>(report);
  return out;
}

void log_run_start(PreparedJob& job, const Comm& comm, c10::Device device,
                   const std::string& malloc_note) {
  log::info("loom ", LOOM_VERSION, " | torch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
            ".", TORCH_VERSION_PATCH, " (", LOOM_BUILD_CUDA, " build) | device ", device.str(),
            " | intra-op threads ", at::get_num_threads(), " | ranks ", comm.world_size(), " (",
            comm.backend(), ")");
  // Where the rendezvous (gloo, nccl) met, when loom derived the address or port from Slurm's
  // variables rather than being told.
  if (comm.backend() == "gloo" || comm.backend() == "nccl") {
    const std::string derived = describe_derived_rendezvous(detect_dist_env());
    if (!derived.empty()) log::info(derived);
  }
  log::info("job ", job.job().file.string(), " (config hash ", job.job().hash(), ")");
  for (const auto& note : job.job().notes) log::info("job: ", note);
  for (const auto& warning : job.job().warnings) log::warn("job: ", warning);
  // The code this run loads, by the real file of each plugin (a link named with its target).
  for (const auto& plugin : job.host().plugins())
    if (!plugin->builtin())
      log::info("plugin ", plugin->name, " ", plugin->version, " from ", plugin->file_label());
  log::info("cpu ", cpu::read_cpu_info().model, " | oneDNN isa ", cpu::isa_in_effect().summary());
  if (!malloc_note.empty()) log::info(malloc_note);  // Note [Freed memory kept]
}

void log_run_plan(const RunPlan& plan) {
  log::info("model ", plan.model, ": ", plan.model_state.describe());
  log::info("data ", plan.data, "; ", plan.batch_size, " samples x ", plan.accumulation_steps,
            " micro-batches x ", plan.world_size, " rank(s) = ",
            plan.batch_size * plan.accumulation_steps * plan.world_size, " samples per step");
  if (!plan.evaluation.empty()) log::info("eval data ", plan.evaluation);
  log::info("optimizer ", plan.optimizer, ", lr ", plan.learning_rate, " (", plan.schedule,
            "), max_grad_norm ", plan.max_grad_norm);
}

void log_run_end(const TrainState& state, int64_t first_step, double seconds, c10::Device device) {
  log::info("done: ", state.step, " steps, final loss ", state.loss, ", ", state.step - first_step,
            " steps in ", seconds, " s, peak memory ",
            memory::format_bytes(memory::device_stats(device).peak_bytes), " (peak RSS ",
            memory::format_bytes(memory::peak_rss_bytes()), ")");
}

void write_run_info_file(const std::string& output_dir, const RunInfo& run) {
  const auto& ms = run.model_state;
  nlohmann::ordered_json info = {
      {"loom_version", LOOM_VERSION},
      {"build", LOOM_BUILD_STRING},
      {"device", run.device},
      {"threads", run.threads},
      {"world_size", run.world_size},
      {"backend", run.backend},
      {"config_hash", run.config_hash},
      {"model", run.model},
      {"optimizer", run.optimizer},
      {"model_state",
       {{"params", ms.param_count},
        {"trainable_params", ms.trainable_count},
        {"param_bytes", ms.param_bytes},
        {"master_bytes", ms.master_bytes},
        {"grad_bytes", ms.grad_bytes},
        {"optimizer_bytes", ms.optimizer_bytes}}}};
  std::ofstream(output_dir + "/run.json") << info.dump(2) << "\n";
}

}  // namespace loom
