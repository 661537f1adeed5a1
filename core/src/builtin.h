// builtin.h (core-internal) — the plugins compiled into the core: the data sources
// (random_tokens, text, tokens) and the AdamW update rule, so a job trains with no plugin
// library besides its model.
#pragma once

#include <memory>
#include <vector>

#include "loom/plugin.h"

namespace loom {
std::vector<std::unique_ptr<Plugin>> make_builtin_plugins();
}
