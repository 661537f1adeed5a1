// trainable_params.h (core-internal) — the model's trainable parameters as the step driver sees
// them (loom::Param: name, weight-decay group, placement, [optimizer] param_groups' settings),
// and the model state's sizes a run reports. Collected once, at params_ready; not the update.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/config.h"
#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/step_driver.h"

namespace loom {

class Model;

// Engine::place_param's check of a placement (Note [Placed parameters] in loom/engine.h): the
// tensor must be rows of the global shape; an Error naming both shapes otherwise.
void check_placement(const at::Tensor& param, const ParamPlacement& placement);

struct TrainableParams {
  std::vector<Param> params;  // requires_grad, in named_parameters' order
  // As built, before any driver shards or frees a weight: every parameter, the trainable ones,
  // and the trainable ones' bytes (the gradients of an unsharded step).
  int64_t param_count = 0, trainable_count = 0, trainable_bytes = 0;
};

// The model's trainable parameters, placed by `placements` (Engine::place_param's, keyed by
// TensorImpl; a placement's group overrides Model::no_weight_decay's) and given [optimizer]
// param_groups' settings. A model without one is an Error naming `model_name`.
TrainableParams collect_trainable_params(Model& model, const std::string& model_name,
                                         const std::map<const void*, ParamPlacement>& placements,
                                         const ConfigSection& optimizer);

// What the model state holds now: counts as built, bytes as held (a sharding driver may have
// released whole weights, or keep sharded gradients). `grads_freed_in_backward`: Note
// [Optimizer in backward] with no accumulation holds no gradient from backward to the update.
memory::ModelState model_state_of(Model& model, const TrainableParams& built,
                                  const StepDriver& driver, bool grads_freed_in_backward);

}  // namespace loom
