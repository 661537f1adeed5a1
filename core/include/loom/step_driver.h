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
#include <functional>
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
  // [optimizer] master_dtype: "fp32" keeps an fp32 master beside every parameter stored in
  // another dtype; "bf16" keeps none, and each bf16 weight is updated in fp32 and written back
  // rounded stochastically (Note [bf16 weights as their own masters] in core/src/
  // step_driver.cpp). The core's driver offers both, and the zero plugin's; a plugin driver that
  // keeps masters anyway (master_bytes() > 0) is refused before the run writes anything.
  std::string master_dtype = "fp32";
  // [train] seed: the stream of that rounding, the same on every rank.
  uint64_t seed = 0;
};

// One piece of a checkpoint tensor: rows [offset, offset + tensor.size(0)) along dim 0 of the
// global tensor `name`, whose shape is global_shape. An unsharded tensor is one piece at offset
// 0 with its own shape. Several ranks may hold the same rows (state a rule keeps whole on every
// holder of a tensor, e.g. Adafactor's column statistics): a reader takes them from any one.
struct StatePiece {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> global_shape;
  int64_t offset = 0;
  // For a flattened tensor (global_shape {numel}): its own shape, which `loom consolidate`
  // restores ("weight/<param>" pieces of sharded weights). Empty: global_shape is the shape.
  std::vector<int64_t> tensor_shape = {};
  // Set for a piece that is not in memory (state offloaded to NVMe): `tensor` then only
  // describes it (dtype and shape, on the meta device), and load() reads its values; the
  // checkpoint writer calls it once, when it writes the piece (safetensors::save_streamed).
  std::function<at::Tensor()> load = {};
};
using StatePieces = std::vector<StatePiece>;

// The saved pieces of every rank of a checkpoint, for a driver's load_state.
class StateReader {
 public:
  virtual ~StateReader();
  // Fills `into` with rows [offset, offset + into.size(0)) of the global tensor `name` of shape
  // global_shape (into's dtype must be the saved one). Missing tensor, another global shape or
  // dtype, or rows no saved piece covers: a CheckpointError naming the tensor and the files.
  virtual void read(const std::string& name, const std::vector<int64_t>& global_shape,
                    int64_t offset, at::Tensor& into) = 0;
  // Saved tensor names no read() asked for, for the check that nothing is left over. The
  // model's weights are readable too, flattened, as "weight/<param>" (global shape {numel}),
  // whether the checkpoint holds them whole in model.safetensors or as shards; those names are
  // never reported here (the engine checks the model's tensors itself).
  virtual std::vector<std::string> unread() const = 0;
  // Whether the checkpoint holds tensor `name` (read or not). The default says true, so a
  // reader that cannot tell leaves the question to read()'s error for a missing tensor.
  virtual bool holds(const std::string& name) const;
  // The files, for messages ("checkpoint-10/optimizer-*.safetensors").
  virtual std::string where() const = 0;
};

// The rule's context for `param` at this step: the schedule's lr times the parameter's
// lr_scale, and its weight decay (the parameter's own, else default_weight_decay ([optimizer]
// weight_decay) for group 0, none for group 1). Every driver resolves them the same way.
UpdateContext update_context(const Param& param, int64_t step, double lr,
                             double default_weight_decay);

// The global shape and dim-0 offset of a piece of state that a rule made for a segment, found
// from the state the rule makes for the whole tensor (`whole`, e.g. made on the meta device):
// per-element and per-block state scales with the segment; state as large as the whole tensor's
// on a partial segment is kept whole on every holder (offset 0).
StatePiece state_piece(const std::string& name, const at::Tensor& piece, const at::Tensor& whole,
                       int64_t segment_offset, int64_t segment_numel, int64_t tensor_numel);
// A rule's state for a whole tensor of `shape`, made on the meta device: shapes only, no memory.
NamedTensors whole_tensor_state_shapes(const UpdateRule& rule, const std::string& name,
                                       const std::vector<int64_t>& shape, int group);
// Checks after a load_state that the reader has nothing left (else a CheckpointError).
void check_nothing_unread(const StateReader& reader);
// Note [bf16 weights as their own masters] (core/src/step_driver.cpp), for a driver that keeps
// no fp32 masters: writes `from` ((n) fp32, contiguous) into `into` ((n) bf16, contiguous, the
// same device), element i rounded stochastically with the bits of element offset + i of
// parameter `name`'s weights at update `step` under the run's `seed`. The core's driver rounds
// with these bits, so a driver that updates pieces of a tensor (ZeRO's shards) writes the bits
// the whole tensor's update writes.
void round_weights_to_bf16(const at::Tensor& from, at::Tensor& into, uint64_t seed,
                           const std::string& name, int64_t step, int64_t offset);
// The warnings of a resume across a change of [optimizer] master_dtype: `dropped`, the first
// "master/<param>" the checkpoint holds that this job keeps none of (its extra bits go);
// `widened`, the first this job keeps that the checkpoint lacks (started from the weights).
// Either may be empty: nothing to say of it.
void warn_master_dtype_switch(const StateReader& reader, const std::string& dropped,
                              const std::string& widened);
// Whether `rule` updates a CPU segment whose param is the bf16 weights themselves and whose
// grad is their bf16 gradient (both contiguous), writing its result into them rounded with
// round_weights_to_bf16's bits in the same pass (the core's adamw, seeded with `seed`).
bool rule_takes_bf16_weights(const UpdateRule& rule, uint64_t seed);
// Whether `rule` reads a contiguous bf16 gradient of a contiguous fp32 CPU segment as it is,
// with the bits of its fp32 widening (the core's adamw), so a driver need not widen it first.
bool rule_reads_bf16_gradients(const UpdateRule& rule);
// The squared global norm of `grads` (fp32 squares summed in fp64; on CUDA one multi-tensor norm
// kernel): a 0-d fp64 tensor on the grads' device, so reading it is the caller's one host sync.
// What an unsharded driver returns from grad_norm_squared(); zero for no grads.
at::Tensor squared_norm(const std::vector<at::Tensor>& grads);
// Multiplies every tensor of `grads` in place by `factor` (the clipping factor): the bits of
// at::_foreach_mul_(grads, factor), fp32 and bf16 CPU tensors in one threaded pass over all of
// them (Note [Gradient scale in one pass], core/src/grad_scale.cpp). What a driver's
// scale_grads() runs.
void scale_gradients(const std::vector<at::Tensor>& grads, double factor);

class StepDriver {
 public:
  virtual ~StepDriver();
  virtual std::string name() const = 0;

  // Before each step's first micro-batch: gradients released (the default driver: Note
  // [Gradients released, not zeroed] in core/src/step_driver.cpp) or zeroed.
  virtual void zero_grad() = 0;
  // The squared global gradient norm over every trainable parameter of the model, summed over
  // all ranks and shards (a sharded driver all-reduces its partial sums): a 0-d fp64 tensor on
  // the parameters' device, so reading it is the caller's one host sync.
  virtual at::Tensor grad_norm_squared() = 0;
  // The gradient tensors the next update reads, once backward (and the grad sync) is done: the
  // parameters' .grad for the default driver, this rank's gradient shards for ZeRO. A loss
  // scaler unscales and checks these in before_update.
  virtual std::vector<at::Tensor> grads() = 0;
  // Multiplies every gradient by factor (clipping).
  virtual void scale_grads(double factor) = 0;
  // Runs the update rule; step is the 1-based update count, lr the schedule's value (times each
  // parameter's lr_scale). Afterwards the compute parameters hold the updated values.
  virtual void update(int64_t step, double lr) = 0;
  // Note [Optimizer in backward] (core/src/optimizer_in_backward.h): whether this driver can
  // update one parameter at a time, as its final gradient arrives during backward. A driver that
  // cannot (the default) makes the engine refuse [train] optimizer_in_backward, naming it.
  virtual bool updates_in_backward() const { return false; }
  // Runs the rule on `param` alone from its final gradient `grad` (the parameter's shape and
  // dtype; read, never kept), exactly as update(step, lr) would have for it, and writes the
  // updated values back to the parameter. Called only when updates_in_backward().
  virtual void update_param(const Param& param, const at::Tensor& grad, int64_t step,
                            double lr);
  // Note [Optimizer in backward], for a driver that updates the pieces it holds itself, each as
  // soon as its gradient is final (ZeRO stages 1-2: the rank's chunk of a flat group when its
  // reduce-scatter lands), instead of one parameter at a time through update_param: whether it
  // does. The engine then calls begin_update_in_backward(step, lr) before the window's last
  // backward, with the step and lr update() will get; after backward grad_norm_squared() (the
  // driver keeps each piece's sum of squares before freeing its gradient) and update(step, lr),
  // which then only completes the step (every parameter holds its updated values after it).
  // grads() and scale_grads() are not called (a loss scaler and clipping are refused).
  virtual bool updates_pieces_in_backward() const { return false; }
  virtual void begin_update_in_backward(int64_t step, double lr);

  // This rank's checkpoint state as pieces of global tensors ("state/<param>/<key>",
  // "master/<param>"): see StatePiece. Every rank writes its pieces when state_is_sharded(),
  // else rank 0 alone. load_state asks the reader for the rows it holds, whatever cut (stage,
  // world size) the checkpoint was written with, and fails with a CheckpointError naming the
  // tensor and file for anything missing, misshapen or left over.
  virtual StatePieces state_pieces() const = 0;
  virtual void load_state(StateReader& reader) = 0;
  virtual bool state_is_sharded() const { return false; }
  // Bytes this rank holds for optimizer state and for fp32 masters kept apart from the
  // parameters (the model-state report and run.json).
  virtual int64_t state_bytes() const = 0;
  virtual int64_t master_bytes() const = 0;
  // Bytes of gradients this rank holds between backward and update; -1: the engine counts
  // every trainable parameter's gradient at the parameter's dtype (the unsharded case).
  virtual int64_t grad_bytes() const { return -1; }
  // Parameters whose weights the driver keeps as shards (ZeRO stage 3): the engine leaves them
  // out of model.safetensors and out of its own loading; the driver saves and reads them as
  // "weight/<param>" pieces. sharded_weight_bytes: what this rank holds of them.
  virtual std::vector<std::string> sharded_weights() const { return {}; }
  virtual int64_t sharded_weight_bytes() const { return 0; }
};

// The core's driver: one segment per trainable tensor, fp32 masters for parameters stored in
// another dtype (or, master_dtype "bf16", the weights as their own masters), the rule over whole
// tensors (batched through UpdateRule::update_many).
std::unique_ptr<StepDriver> make_default_step_driver(const StepDriverOptions& options);

}  // namespace loom

#pragma GCC visibility pop
