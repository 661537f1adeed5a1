// `loom export CKPT OUT_DIR [--merge]`: a checkpoint as a transformers folder, by the model
// plugin's export_pretrained and the job the checkpoint records (Note [Merged export] in
// loom/trainer.h).
#include <filesystem>
#include <nlohmann/json.hpp>

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

// config.json with the data's label map as id2label/label2id (transformers' PretrainedConfig
// fields, for every model type), in place of the LABEL_i names a plugin writes by default. A
// model with more outputs than named classes keeps LABEL_i for the rest.
std::string with_label_names(const std::string& config_json,
                             const std::vector<std::string>& names) {
  auto config = nlohmann::ordered_json::parse(config_json);
  const int64_t outputs = config.contains("id2label") ? static_cast<int64_t>(config["id2label"].size())
                                                      : static_cast<int64_t>(names.size());
  LOOM_CHECK_AS(CheckpointError, outputs >= static_cast<int64_t>(names.size()),
                "the data's label map has ", names.size(), " classes but the model has ",
                outputs, " outputs");
  config["id2label"] = nlohmann::ordered_json::object();
  config["label2id"] = nlohmann::ordered_json::object();
  for (int64_t i = 0; i < outputs; ++i) {
    const std::string name = i < static_cast<int64_t>(names.size()) ? names[static_cast<size_t>(i)]
                                                                   : "LABEL_" + std::to_string(i);
    config["id2label"][std::to_string(i)] = name;
    config["label2id"][name] = i;
  }
  return config.dump(2) + "\n";
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
  auto [job, step, weights, label_names] = checkpoint_model(checkpoint, parent);
  // Resolved and validated; nothing is built.
  const PreparedJob prepared(std::move(job), PreparedJob::Purpose::inference);
  pretrained::Export out = to_pretrained(prepared, std::move(weights), options.merge);
  if (!label_names.empty()) out.config_json = with_label_names(out.config_json, label_names);
  // The tokenizer goes along: the folder is what pipeline() and from_pretrained need.
  if (const std::string tokenizer = job_tokenizer(prepared); !tokenizer.empty())
    out.files = tokenizer_files(tokenizer);
  pretrained::write_folder(out_dir, out);
}

}  // namespace loom
