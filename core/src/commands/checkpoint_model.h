// checkpoint_model.h (core-internal) — what the commands that read a checkpoint (export,
// generate) take from it.
#pragma once

#include <filesystem>

#include "job.h"
#include "loom/safetensors.h"

namespace loom {

// What the commands that read a checkpoint accept: a checkpoint folder, or a run's output_dir
// (its newest checkpoint); a CheckpointError when `path` is no folder.
std::string checkpoint_of(const std::filesystem::path& path);

// The job a checkpoint records, its step, and its weights in fp32 by loom's names: consolidated
// (any world size or ZeRO stage) into a temporary file in `scratch_dir`, then read.
struct CheckpointModel {
  Job job;
  int64_t step = 0;
  NamedTensors weights;
  std::vector<std::string> label_names;  // the data's label map (Dataset::label_names)
};
CheckpointModel checkpoint_model(const std::filesystem::path& checkpoint,
                                 const std::filesystem::path& scratch_dir);

class PreparedJob;
// The tokenizer the job's text went through, as a tokenizer.json path or a folder holding
// one: [data] tokenizer (the jsonl and csv sources), else [model] from_pretrained when that
// folder has a tokenizer.json; "" when neither (token files, random tokens, bytes).
std::string job_tokenizer(const PreparedJob& job);
// The files of a Hugging Face tokenizer at `path` (job_tokenizer's answer): tokenizer.json and
// those of its folder a save_pretrained folder carries beside it (tokenizer_config.json,
// special_tokens_map.json, vocab files, the chat template).
std::vector<std::filesystem::path> tokenizer_files(const std::string& path);

}  // namespace loom
