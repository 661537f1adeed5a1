// adamw.h (core-internal) — the built-in AdamW update rule, so the core trains without an
// optimizer plugin.
#pragma once

#include <memory>

#include "loom/config.h"
#include "loom/update_rule.h"

namespace loom {
std::unique_ptr<UpdateRule> make_adamw(const ConfigSection& table);
}
