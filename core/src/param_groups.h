// param_groups.h (core-internal) — [optimizer] param_groups: each entry {match = "regex",
// lr_scale = x, weight_decay = y} sets Param::lr_scale / Param::weight_decay of the trainable
// parameters whose whole name matches; the first entry that matches a parameter wins. A bad
// entry, or one that matches nothing, is a ConfigError naming its file:line.
#pragma once

#include <vector>

#include "loom/config.h"
#include "loom/engine.h"

namespace loom {

void apply_param_groups(const ConfigSection& optimizer, std::vector<Param>& params);

}  // namespace loom
