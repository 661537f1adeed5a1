// trainer_names.h (core-internal) — Hugging Face TrainingArguments' spellings in [train],
// rewritten onto loom's tables when a job is parsed (Note [Trainer names] in the .cpp).
#pragma once

#include <string>
#include <vector>

#include "loom/config.h"

namespace loom {

// Rewrites `root` (a job's table of tables) in place; returns one "where: what" line per
// rewrite, for the run's log. ConfigError for a setting spelled both ways, a value of the wrong
// type, or a name with no loom equivalent.
std::vector<std::string> map_trainer_names(ConfigValue& root);

}  // namespace loom
