// loom/engine.h — what a plugin sees of the engine: the events it can handle, the training
// state it can read and steer, and the objects of the run (model, data, comm, parameters,
// checkpoint contents). The loop itself lives in core/src/engine.cpp.
//
// Event order (Note [Event order], also in docs/architecture.md):
//   setup → model_built → params_ready → [load, when resuming]
//   per optimizer step:
//     per micro-batch k = 0..A-1:  batch → before_forward → after_forward
//                                  → before_backward → grad_ready(param)* → after_backward
//     before_update → (update, unless skipped) → after_update → step_end
//     → [evaluation: per eval batch before_forward → after_forward (state.evaluating), then
//        evaluate] → [save]
//   teardown (also after an error, best effort)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/batch.h"
#include "loom/config.h"
#include "loom/memory.h"
#include "loom/update_rule.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

class Model;
class DataSource;
class Comm;
class StepDriver;
namespace nn {
class UnitInterceptor;
class UnitList;
}  // namespace nn

enum class Event {
  setup, model_built, params_ready, batch, before_forward, after_forward, before_backward,
  grad_ready, after_backward, before_update, after_update, step_end, evaluate, save, load,
  teardown
};
const char* to_string(Event event);

// The loop's state. Plugins read it and may steer through the marked fields.
struct TrainState {
  int64_t step = 0;                 // optimizer steps completed
  int64_t max_steps = 0;
  int64_t micro_step = 0;           // index in the accumulation window
  int64_t accumulation_steps = 1;
  int64_t window_targets = 0;       // loss targets in the whole window (all ranks)
  double lr = 0.0;                  // this step's base learning rate
  double loss = 0.0;                // mean loss of the last completed window
  double grad_norm = 0.0;           // global norm before clipping, of the last update
  int64_t skipped_updates = 0;      // total updates skipped (e.g. fp16 overflow)
  // Steering:
  double loss_scale = 1.0;          // backward runs on loss * loss_scale (fp16 scaler)
  bool skip_update = false;         // set in before_update to skip this update
  bool grads_scaled = false;        // grads are still multiplied by loss_scale
  bool sync_grads = true;           // false on micro-steps where grad_sync must not communicate
  // Note [Evaluation]: true during an evaluation's forwards (model in eval mode, no gradients,
  // no backward or update follows; before_forward and after_forward fire for each eval batch).
  bool evaluating = false;
  // The last evaluation's numbers ("eval_loss", ...), from the evaluate event on.
  std::vector<std::pair<std::string, double>> eval_metrics;
  // Extra numbers of this step for metrics.jsonl (plugins add; cleared when a step starts).
  std::vector<std::pair<std::string, double>> metrics;
  bool is_last_micro_step() const { return micro_step + 1 == accumulation_steps; }
};

// A parameter as the step driver sees it.
struct Param {
  std::string name;
  at::Tensor tensor;  // the model's parameter
  int group = 0;      // 0: weight decay, 1: no weight decay
  // From the first matching [optimizer] param_groups entry, if any:
  double lr_scale = 1.0;       // this parameter's lr = the schedule's lr x lr_scale
  double weight_decay = -1.0;  // >= 0: overrides the group's weight decay
  // Note [Placed parameters] — from Engine::place_param (expert parallelism); the defaults
  // describe an ordinary data-parallel parameter:
  // - global_shape: this rank holds rows [row_offset, row_offset + size(0)) of a global tensor
  //   of this shape (empty: the tensor is whole). Checkpoints save each rank's rows as pieces
  //   of the global tensor ("weight/<name>"), and `loom consolidate`/`loom export` join them.
  // - replicas: the ranks that hold the same rows (gradient sync reduces over them, the start
  //   broadcast stays within them); nullptr: every rank of the job's Comm. Gradients are summed
  //   over the replicas and divided by the job's world size either way: each rank's loss is
  //   scaled by world / global targets (Note [Loss normalisation]), and a placed parameter's
  //   gradient already sums the contributions that other ranks' tokens sent it.
  std::vector<int64_t> global_shape;
  int64_t row_offset = 0;
  std::shared_ptr<Comm> replicas;
  bool placed() const { return !global_shape.empty() || replicas != nullptr; }
};

// Where a placed parameter lives (see Param). Given in model_built, before params_ready.
struct ParamPlacement {
  std::vector<int64_t> global_shape;
  int64_t row_offset = 0;
  std::shared_ptr<Comm> replicas;
  // The parameter's weight-decay group, when its rank misleads Model::no_weight_decay (stacked
  // expert biases are 2-D): 0 decay, 1 none; -1: the model decides.
  int group = -1;
};

// What save/load handlers add to or read from a checkpoint: extra safetensors files and
// string values in the manifest (under the plugin's own key prefix).
struct CheckpointData {
  std::map<std::string, NamedTensors> files;       // file stem -> tensors ("precision")
  std::map<std::string, std::string> values;       // "precision.scale" -> "65536"
};

class Engine {
 public:
  using Handler = std::function<void(Engine&)>;
  using GradHandler = std::function<void(Engine&, const Param&)>;
  virtual ~Engine();

  // Handlers of one event run in the plugins' order (Note [Plugin order] in loom/plugin.h),
  // then in registration order.
  virtual void on(Event event, Handler handler) = 0;
  // After param.grad accumulated this micro-batch's gradient (an autograd post-accumulate hook),
  // so gradient sync can start while backward goes on. Register in attach() or in a setup,
  // model_built or params_ready handler; later is an error.
  virtual void on_grad_ready(GradHandler handler) = 0;
  virtual void add_unit_interceptor(std::shared_ptr<nn::UnitInterceptor> interceptor) = 0;

  virtual const ConfigSection& section(const std::string& table) const = 0;
  // A path from the job file, made absolute relative to the job file's folder.
  virtual std::string resolve_path(const std::string& path) const = 0;
  virtual c10::Device device() const = 0;
  virtual uint64_t seed() const = 0;
  virtual TrainState& state() = 0;

  virtual Model& model() = 0;
  virtual std::shared_ptr<Model> model_ptr() = 0;
  // In model_built: swap the model for a transformed one.
  virtual void set_model(std::shared_ptr<Model> model) = 0;
  virtual std::vector<nn::UnitList*> unit_lists() = 0;
  // In model_built: `param` (a parameter of the final model) is placed, not replicated on
  // every rank (Note [Placed parameters]), and/or its weight-decay group is set; params()
  // carries both from params_ready on.
  virtual void place_param(const at::Tensor& param, ParamPlacement placement) = 0;

  virtual DataSource& data() = 0;
  // In setup: wrap the data source (preloading). take_data() hands the current one over.
  virtual std::unique_ptr<DataSource> take_data() = 0;
  virtual void set_data(std::unique_ptr<DataSource> data) = 0;

  virtual Comm& comm() = 0;
  // Trainable parameters, from params_ready on.
  virtual const std::vector<Param>& params() const = 0;
  virtual Batch& batch() = 0;    // the current micro-batch (from batch on)
  // The current forward's output, from after_forward on. Its logits are released after the
  // micro-batch's after_backward (the loss stays): (batch x tokens x vocabulary) values would
  // otherwise live through the update into the next forward.
  virtual Output& output() = 0;
  // During save and load.
  virtual CheckpointData& checkpoint() = 0;
  // Bytes of weights, fp32 masters, grads and optimizer state on this rank (from params_ready).
  virtual memory::ModelState model_state() const = 0;
  // The job's update rule, from setup on (its partitioning cuts ZeRO's flat groups; Note
  // [Sharded initialization] cuts them while the model is built).
  virtual const UpdateRule& update_rule() const = 0;
  // What turns gradients into updates (from params_ready on): its grads() are the gradients
  // the update will read, wherever the driver keeps them (a loss scaler unscales those).
  virtual StepDriver& step_driver() = 0;
  // Note [Optimizer in backward] (core/src/optimizer_in_backward.h): with [train]
  // optimizer_in_backward, the grad_sync plugin hands each parameter's synchronised gradient
  // here on the last micro-step (`param`: the model's tensor; `grad`: its final gradient, the
  // parameter's shape and dtype, read at once and not kept), and the step driver updates the
  // parameter now. Such a plugin says so once, before the first backward (from
  // create_step_driver or params_ready), with will_hand_final_grads(); on several ranks a job
  // whose grad_sync plugin does not is refused, and a plugin that cannot should refuse the key
  // in validate(). Without one (a single process) the engine updates each parameter from its
  // .grad after every grad_ready handler has seen it.
  virtual void grad_final(const at::Tensor& param, const at::Tensor& grad) = 0;
  virtual void will_hand_final_grads() = 0;
};

}  // namespace loom

#pragma GCC visibility pop
