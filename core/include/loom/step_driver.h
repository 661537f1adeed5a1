// loom/step_driver.h — what turns accumulated gradients into updated parameters: the step
// driver. It owns where fp32 masters and optimizer state live and how they are cut, the global
// gradient norm, gradient scaling (clipping), the update rule's run over Segments, writing
// updated values back to the compute parameters, its checkpoint state and its byte report.
// The core's default driver (ZeRO stage 0: every rank holds everything) is
// make_default_step_driver(); a plugin that fills Slot::step_driver (ZeRO stages 1-3) returns
// its own from Plugin::create_step_driver. The engine is the loop and event dispatch only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/engine.h"
#include "loom/update_rule.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

class Comm;

// What a driver is built from, in params_ready's world: the trainable parameters (names,
// tensors, groups, per-group lr scale and weight decay) in model order, the job's update rule
// (owned by the engine, alive as long as the driver), [optimizer] weight_decay for group 0, and
// the job's Comm.
struct StepDriverOptions {
  std::vector<Param> params;
  const UpdateRule* rule = nullptr;
  double weight_decay = 0.0;
  Comm* comm = nullptr;
};

class StepDriver {
 public:
  virtual ~StepDriver();
  virtual std::string name() const = 0;

  // Before each step's first micro-batch: gradients to zero (or released, for a driver that
  // keeps them elsewhere).
  virtual void zero_grad() = 0;
  // The squared global gradient norm over every trainable parameter of the model, summed over
  // all ranks and shards (a sharded driver all-reduces its partial sums): a 0-d fp64 tensor on
  // the parameters' device, so reading it is the caller's one host sync.
  virtual at::Tensor grad_norm_squared() = 0;
  // Multiplies every gradient by factor (clipping).
  virtual void scale_grads(double factor) = 0;
  // Runs the update rule; step is the 1-based update count, lr the schedule's value (times each
  // parameter's lr_scale). Afterwards the compute parameters hold the updated values.
  virtual void update(int64_t step, double lr) = 0;

  // This rank's checkpoint state ("state/<param>/<key>", "master/<param>" for the default
  // driver), and back: a missing or misshapen tensor is a CheckpointError naming it and `file`.
  virtual NamedTensors state_tensors() const = 0;
  virtual void load_state(const NamedTensors& tensors, const std::string& file) = 0;
  // Bytes this rank holds for optimizer state and for fp32 masters kept apart from the
  // parameters (the model-state report and run.json).
  virtual int64_t state_bytes() const = 0;
  virtual int64_t master_bytes() const = 0;
};

// The core's driver: one segment per trainable tensor, fp32 masters for parameters stored in
// another dtype, the rule over whole tensors (batched through UpdateRule::update_many).
std::unique_ptr<StepDriver> make_default_step_driver(const StepDriverOptions& options);

}  // namespace loom

#pragma GCC visibility pop
