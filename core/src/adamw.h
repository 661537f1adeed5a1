// adamw.h (core-internal) — the built-in AdamW update rule, so the core trains without an
// optimizer plugin.
#pragma once

#include <memory>

#include "loom/config.h"
#include "loom/update_rule.h"

namespace loom {
std::unique_ptr<UpdateRule> make_adamw(const ConfigSection& table);
// Note [bf16 weights as their own masters] (step_driver.cpp): whether `rule` is the core's
// adamw drawing its rounding from `seed`, which then takes a CPU segment whose param is the bf16
// weights themselves and whose grad is bf16, and rounds its result into them in one pass: the
// bits of the driver's generic path.
bool takes_bf16_weights(const UpdateRule& rule, uint64_t seed);
// Note [bf16 gradients read as they are] (adamw.cpp): whether `rule` is the core's adamw, whose
// CPU kernels (fp32 or bf16 moments) read a segment's gradient in bf16 (the same bits as its fp32
// widening).
bool takes_bf16_gradients(const UpdateRule& rule);
}
