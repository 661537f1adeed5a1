// The job, step and weights of a checkpoint, for the commands that read one.
#include "checkpoint_model.h"

#include <unistd.h>

#include "checkpoint_io.h"
#include "loom/error.h"

namespace loom {

std::string checkpoint_of(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(path, ec), "'", path.string(),
                "' is not a folder; give a checkpoint folder (runs/x/checkpoint-300) or a run's "
                "output_dir (its newest checkpoint is used)");
  if (!fs::exists(path / "manifest.json", ec))
    if (std::string newest = latest_checkpoint(path.string()); !newest.empty()) return newest;
  return path.string();
}

CheckpointModel checkpoint_model(const std::filesystem::path& checkpoint,
                                 const std::filesystem::path& scratch_dir) {
  namespace fs = std::filesystem;
  const CheckpointContents info = read_checkpoint_info(checkpoint.string());
  LOOM_CHECK_AS(CheckpointError, !info.job_text.empty(), "checkpoint '",
                checkpoint.string(), "' does not record its job (written by an older loom); "
                "resume it for one step with this loom and use that checkpoint");
  Job job = Job::parse(info.job_text, fs::path(info.job_dir) / "job.toml (saved in the checkpoint)");
  const fs::path temp = scratch_dir / (".loom-weights-" + std::to_string(::getpid()) + ".safetensors");
  std::error_code ec;
  NamedTensors weights;
  try {
    consolidate_checkpoint_folder(checkpoint.string(), temp.string());
    weights = safetensors::load(temp).tensors;
  } catch (...) {
    fs::remove(temp, ec);
    throw;
  }
  fs::remove(temp, ec);
  return {std::move(job), info.step, std::move(weights)};
}

}  // namespace loom
