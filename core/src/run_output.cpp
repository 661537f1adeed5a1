// A run's output_dir besides checkpoints and metrics (run_output.h).
#include "run_output.h"

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint_io.h"
#include "loom/log.h"
#include "loom/plugin.h"
#include "loom/trainer.h"

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
