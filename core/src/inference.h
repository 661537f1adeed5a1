// inference.h (core-internal) — a checkpoint's model built for inference: what `loom generate`
// decodes with. engine.cpp builds it (the job's model-shaping plugins run at model_built);
// generate.cpp runs it.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "loom/model.h"
#include "loom/trainer.h"

namespace loom {

struct InferenceModel {
  std::unique_ptr<Trainer> owner;  // the engine holding the plugins and the model
  Model* model = nullptr;          // eval mode, fp32, the checkpoint's weights
  std::string checkpoint;          // the folder read
  int64_t step = 0;
  std::string data_source;         // the job's [data] source ("text": byte-level tokens)
  std::string tokenizer;           // the job's Hugging Face tokenizer (job_tokenizer), or ""
};

// `path`: a checkpoint folder, or a run's output_dir (its newest checkpoint). `device`: cpu,
// cuda, cuda:N, or "auto" (the job's [train] device).
InferenceModel open_for_inference(const std::filesystem::path& path, const std::string& device);

}  // namespace loom
