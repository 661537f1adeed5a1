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
};
CheckpointModel checkpoint_model(const std::filesystem::path& checkpoint,
                                 const std::filesystem::path& scratch_dir);

}  // namespace loom
