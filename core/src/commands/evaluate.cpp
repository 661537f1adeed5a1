// `loom eval` (Note [Evaluation]): a checkpoint's model over its job's evaluation set, alone.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "checkpoint_io.h"
#include "checkpoint_model.h"
#include "loom/comm.h"
#include "loom/error.h"
#include "loom/trainer.h"

namespace loom {

CheckpointEvaluation evaluate_checkpoint(const std::filesystem::path& path,
                                         const std::filesystem::path& job_file,
                                         const std::vector<std::string>& overrides) {
  namespace fs = std::filesystem;
  CheckpointEvaluation out;
  out.checkpoint = fs::absolute(checkpoint_of(path)).lexically_normal().string();
  const CheckpointContents info = read_checkpoint_info(out.checkpoint);
  out.step = info.step;
  LOOM_CHECK_AS(CheckpointError, !job_file.empty() || !info.job_text.empty(), "checkpoint '",
                out.checkpoint, "' does not record its job (written by an older loom); give the "
                "job file: loom eval CHECKPOINT JOB.toml");
  // The run resumes the checkpoint into a scratch output_dir, which goes afterwards: the
  // checkpoint's own run folder is never written to.
  std::string scratch = (fs::temp_directory_path() / "loom-eval-XXXXXX").string();
  LOOM_CHECK(::mkdtemp(scratch.data()) != nullptr, "cannot create a scratch folder in ",
             fs::temp_directory_path().string());
  struct RemoveScratch {
    std::string folder;
    ~RemoveScratch() {
      std::error_code ignored;
      fs::remove_all(folder, ignored);
    }
  } remove_scratch{scratch};
  std::vector<std::string> sets = overrides;
  sets.push_back("train.resume=\"" + out.checkpoint + "\"");
  sets.push_back("train.output_dir=\"" + scratch + "\"");
  sets.push_back("train.progress_bar=false");
  sets.push_back("train.report_to=\"none\"");  // the run's TensorBoard folder stays untouched
  std::unique_ptr<Trainer> trainer =
      job_file.empty() ? Trainer::from_text(info.job_text, info.job_dir, sets)
                       : Trainer::from_file(job_file, sets);
  out.metrics = trainer->evaluate();
  out.rank = trainer->engine().comm().rank();
  return out;
}

}  // namespace loom
