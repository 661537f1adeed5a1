// engine_factory.h (core-internal) — what the engine (engine.cpp) offers the rest of the core: a
// Trainer for a prepared job, and a prepared job's model alone for the inference commands.
#pragma once

#include <memory>
#include <string>

#include "loom/model.h"
#include "loom/trainer.h"
#include "prepared_job.h"

namespace loom {

// The Trainer of a prepared job (Note [One resolved job]): nothing is built until setup().
std::unique_ptr<Trainer> make_trainer(std::unique_ptr<PreparedJob> job);

// The model alone, on `device` ("auto": the job's choice), with the structure the job's
// plugins give it at model_built (LoRA adapters, MoE layers) and `weights` (fp32, by loom's
// names; `source` names them in errors) in it, in eval mode. `owner` holds the engine, and so
// the plugins, the model lives with.
struct InferenceBuild {
  std::unique_ptr<Trainer> owner;
  Model* model = nullptr;
};
InferenceBuild build_for_inference(std::unique_ptr<PreparedJob> job, const NamedTensors& weights,
                                   const std::string& device, const std::string& source);

}  // namespace loom
