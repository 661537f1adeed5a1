// deepspeed_config.h (core-internal) — a DeepSpeed config file (ds_config.json) read onto
// loom's own tables when a job is parsed (Note [DeepSpeed config files]).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "loom/config.h"

namespace loom {

struct DeepSpeedMapping {
  std::vector<std::string> notes;     // one line per key taken, for the log and `loom check`
  std::vector<std::string> warnings;  // keys that change nothing in loom, named
};

// When [train] deepspeed names a file (relative to `job_dir`), reads it and rewrites `root`: the
// key is removed and every DeepSpeed setting becomes the loom key it means. Runs before the
// Trainer's names are mapped (Note [Trainer names]), since under DeepSpeed the Trainer's bf16
// and fp16 flags mean DeepSpeed's half-precision weights. ConfigError for a file that is not
// JSON (line and column), a value of the wrong type, a setting the job also sets to another
// value, a batch size that does not add up, and every key whose behaviour loom lacks.
// `world_size`: the ranks the launcher started (train_batch_size counts all of them).
DeepSpeedMapping map_deepspeed_config(ConfigValue& root, const std::filesystem::path& job_dir,
                                      int world_size);

}  // namespace loom
