// checkpoint_io.h (core-internal) — the checkpoint folder: safetensors files plus manifest.json
// (step, seed, RNG, data position, config hash, per-file size and crc32). Written under a
// temporary name and renamed, so a crash never leaves a folder that looks complete.
#pragma once

#include <string>

#include "loom/data.h"
#include "loom/engine.h"

namespace loom {

struct CheckpointContents {
  int64_t step = 0;
  uint64_t seed = 0;
  std::string config_hash, update_rule;
  int world_size = 1;
  DataPosition data;
  int64_t skipped_updates = 0;
  double loss_scale = 1.0;
  NamedTensors model;      // model.safetensors
  NamedTensors optimizer;  // optimizer.safetensors
  at::Tensor rng_cpu;      // trainer.safetensors
  at::Tensor rng_device;   // trainer.safetensors "rng.cuda": the GPU's generator (CUDA jobs)
  CheckpointData plugin;   // <stem>.safetensors files and manifest values
};

// Writes <output_dir>/checkpoint-<step>; keeps only the newest `keep` (0 = all). Returns it.
std::string write_checkpoint(const std::string& output_dir, const CheckpointContents& contents,
                             int64_t keep);
// Reads and verifies a checkpoint folder. Throws CheckpointError naming the file for a missing,
// truncated or corrupt one.
CheckpointContents read_checkpoint(const std::string& folder);
// The newest complete checkpoint folder in output_dir, or "".
std::string latest_checkpoint(const std::string& output_dir);

}  // namespace loom
