// A checkpoint's model built for inference (inference.h): what `loom generate` decodes with.
#include <algorithm>
#include <filesystem>
#include <set>

#include "checkpoint_io.h"
#include "engine_factory.h"
#include "inference.h"
#include "plugin_host.h"
#include "resolve.h"
#include "checkpoint_model.h"
#include "loom/error.h"

namespace loom {

InferenceModel open_for_inference(const std::filesystem::path& path, const std::string& device) {
  namespace fs = std::filesystem;
  InferenceModel out;
  out.checkpoint = checkpoint_of(path);
  CheckpointModel saved = checkpoint_model(out.checkpoint, fs::temp_directory_path());
  Job& job = saved.job;
  const NamedTensors& weights = saved.weights;
  out.step = saved.step;
  // What the data was, for the prompt's encoding. Training's own tables go: the core's
  // [optimizer] and [distributed], and every table whose plugin does not shape the model
  // (Plugin::shapes_model: precision, ZeRO, DDP, checkpointing, preloading, a third party's EMA;
  // none changes a weight's meaning). The model, the tables that shape it (lora, moe) and
  // [data] (the model checks its sequence length against it; nothing reads the data) stay.
  out.data_source = "random_tokens";
  if (const ConfigValue* data = job.table("data"))
    if (const ConfigValue* source = data->find("source"))
      if (const auto* name = std::get_if<std::string>(&source->value)) out.data_source = *name;
  std::set<std::string> training_only = {"optimizer", "distributed"};
  {
    PluginHost host;
    for (auto* plugin : resolve(job, host).table_plugins)
      if (!plugin->plugin->shapes_model()) training_only.insert(plugin->name);
  }
  auto& tables = std::get<ConfigTable>(job.root.value);
  tables.erase(std::remove_if(tables.begin(), tables.end(),
                              [&](const auto& t) { return training_only.count(t.first) > 0; }),
               tables.end());
  auto prepared = std::make_unique<PreparedJob>(std::move(job), PreparedJob::Purpose::inference);
  out.tokenizer = job_tokenizer(*prepared);
  InferenceBuild built = build_for_inference(std::move(prepared), weights, device,
                                             "checkpoint '" + out.checkpoint + "'");
  out.model = built.model;
  out.owner = std::move(built.owner);
  return out;
}

}  // namespace loom
