// `loom export CKPT OUT_DIR [--merge]`: a checkpoint as a transformers folder, by the model
// plugin's export_pretrained and the job the checkpoint records (Note [Merged export] in
// loom/trainer.h).
#include <filesystem>

#include "prepared_job.h"
#include "checkpoint_model.h"
#include "loom/error.h"
#include "loom/pretrained.h"
#include "loom/trainer.h"

namespace loom {
namespace {

// The model plugin's transformers form of `weights`, with the table plugins' additions folded
// in first when `merge` (Note [Merged export]).
pretrained::Export to_pretrained(const PreparedJob& job, NamedTensors weights, bool merge) {
const ResolvedJob& resolved = job.resolved();
  const auto& model = resolved.model;
  LOOM_CHECK_AS(ConfigError, model.provider, "the job names no model to export");
  const auto resolve = [&job](const std::string& path) { return job.resolve_path(path); };
  if (merge) {
    bool merged = false;
    for (auto* plugin : resolved.table_plugins)
      merged = plugin->plugin->merge_for_export(resolved.section(plugin->name), weights,
                                                resolve) ||
               merged;
    LOOM_CHECK_AS(ConfigError, merged, "--merge: nothing in this job folds into the base "
                  "model (no [lora] adapters); export it without --merge");
  }
  auto out = model.provider->plugin->export_pretrained(model.name, resolved.section("model"),
                                                       weights, resolve);
  LOOM_CHECK_AS(ConfigError, out.has_value(), "model '", model.name, "' (plugin ",
                plugin_label(model.provider),
                ") has no transformers form to export; `loom consolidate` writes its weights "
                "as one safetensors file");
  return std::move(*out);
}

}  // namespace

void export_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& out_dir,
                       const ExportOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  LOOM_CHECK_AS(CheckpointError, !fs::exists(out_dir, ec) || (fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)),
                "'", out_dir.string(), "' exists and is not an empty folder; choose a new folder "
                "(an export never overwrites)");
  const fs::path parent = fs::absolute(out_dir).lexically_normal().parent_path();
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(parent, ec), "cannot export into '",
                out_dir.string(), "': its parent folder '", parent.string(), "' does not exist");
  auto [job, step, weights] = checkpoint_model(checkpoint, parent);
  // Resolved and validated; nothing is built.
  const PreparedJob prepared(std::move(job), PreparedJob::Purpose::inference);
  pretrained::write_folder(out_dir, to_pretrained(prepared, std::move(weights), options.merge));
}

}  // namespace loom
