// The job, step and weights of a checkpoint, for the commands that read one.
#include "checkpoint_model.h"

#include <unistd.h>

#include "checkpoint_io.h"
#include "loom/error.h"
#include "loom/tokenizer.h"
#include "prepared_job.h"

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
  return {std::move(job), info.step, std::move(weights), info.label_names};
}

std::string job_tokenizer(const PreparedJob& job) {
  const ConfigSection& data = job.section("data");
  if (data.schema().find("tokenizer") && !data.get_string("tokenizer").empty())
    return job.resolve_path(data.get_string("tokenizer"));
  const ConfigSection& model = job.section("model");
  if (model.schema().find("from_pretrained") && !model.get_string("from_pretrained").empty()) {
    const std::string folder = job.resolve_path(model.get_string("from_pretrained"));
    if (Tokenizer::present(folder)) return folder;
  }
  return "";
}

std::vector<std::filesystem::path> tokenizer_files(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool is_folder = fs::is_directory(path, ec);
  const fs::path folder = is_folder ? fs::path(path) : fs::path(path).parent_path();
  std::vector<fs::path> out = {is_folder ? folder / "tokenizer.json" : fs::path(path)};
  for (const char* name : {"tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                           "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                           "chat_template.json"})
    if (fs::is_regular_file(folder / name, ec)) out.push_back(folder / name);
  return out;
}

}  // namespace loom
