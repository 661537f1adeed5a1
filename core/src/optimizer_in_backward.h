// optimizer_in_backward.h (core-internal) — [train] optimizer_in_backward: each parameter is
// updated as soon as its gradient is final, during backward, and its gradient freed at once.
// It decides when a parameter is updated and keeps the step's books (the gradient norm for the
// report, which parameters were updated); the step driver's update_param runs the rule. Not a
// step driver, and not a gradient sync: a grad_sync plugin hands it synchronised gradients.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "loom/config.h"
#include "loom/engine.h"
#include "loom/step_driver.h"

namespace loom {

class DefaultStepDriver;  // step_driver.h

// Note [Optimizer in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With [train] optimizer_in_backward = true the update of a parameter runs as soon as its
// gradient is final, and its gradient is released right then (torchtune's approach), so the
// step never holds every gradient at once: the peak is lower by the gradients' bytes, less
// what the hooks add while backward's activations are still alive: one gradient's sum of
// squares for the norm (an fp32 square and its fp64 copy, in slices of at most 1 M elements, so
// at most 12 MiB) and the rule's temporaries for one tensor (measured on a 1.26 M-parameter GPT:
// 4.31 of its 5.03 MB of gradients saved; tests/core/test_optimizer_in_backward.cpp). On a GPU
// small gradients (under 1 MiB each) wait in a batch of up to 16 MiB and are applied together
// (Note [Small gradients batched on a GPU] in the .cpp): fewer tiny kernels, at most 16 MiB
// less saved; and the updates run on a side stream beside backward's kernels (Note [Updates on
// a side stream] there).
//
// - When: on the last micro-step of an accumulation window only (earlier micro-steps only
//   accumulate, as without it). One process: from the engine's grad_ready handler, which runs
//   after every plugin's (autograd's post-accumulate-grad hook: the parameter's .grad holds the
//   whole window's gradient, and every node that used the weight has run, so updating it in
//   place disturbs no saved tensor). Several ranks: the grad_sync plugin calls
//   Engine::grad_final with the averaged gradient once that parameter's bucket has been reduced
//   (ddp and zero stage 0 free .grad when they copy it into the bucket, and hand the bucket's
//   values over as each bucket's all-reduce is waited for, after backward, while the later
//   buckets are still on the wire). ZeRO stages 1-2 hold no parameter's whole gradient to hand
//   over: their driver updates its own pieces (StepDriver::updates_pieces_in_backward), each
//   rank's chunk of a flat group as its reduce-scatter lands, during backward or after it, and
//   all-gathers the group's new values at once (Note [Updating chunks in backward] in
//   loom/sharding/zero_driver.h); the engine arms it before the last backward and asks it for
//   the norm after.
// - The same arithmetic: update_param runs the rule on the one tensor exactly as update() would
//   (the same segment, the same context from update_context, the same fp32 masters written
//   back), and with clipping off nothing else reads the gradients, so the weights and the
//   optimizer state are bitwise those of the normal step (tests/core/test_optimizer_in_backward.cpp).
//   The reported grad_norm is kept too: each gradient's squares are summed as it is updated and
//   totalled in parameter order, the same sum the driver's grad_norm_squared makes.
// - What needs every gradient before any update is refused by name, not approximated:
//   clipping by the global norm ([train] max_grad_norm > 0: the factor depends on every
//   gradient; set it to 0), fp16's dynamic loss scaler (an overflow anywhere must skip the whole
//   update; the precision plugin refuses fp16/full_fp16, and a loss scale other than 1 at the
//   first backward is refused here for any other scaler), a plugin that sets skip_update (an
//   error at that step: the update already happened), ZeRO stage 3, offloaded optimizers and,
//   at stages 1-2, rules with whole-tensor statistics (Adafactor) (the zero plugin refuses them
//   when the job is read, the rule's among them through JobTables::update_rule; any other driver
//   that updates neither one parameter nor its own pieces in backward is refused at setup), and
//   parameters placed on some ranks only (expert parallelism: their norm needs a collective
//   after backward).
// - A parameter that had a gradient from an earlier micro-step but none in the last (a branch
//   unused by the last micro-batch) is updated after backward, as the normal step would.
// - A diverged loss is still an error (after before_update, as without it), but the parameters
//   of that step were already updated: no checkpoint of it is written, as before.
class InBackwardUpdate {
 public:
  // params: the engine's trainable parameters; synced_by_plugin: a grad_sync plugin hands the
  // final gradients over through grad_final (Engine::will_hand_final_grads), else grad_ready
  // does, from .grad. Refuses (ConfigError, naming the driver or the parameter) what cannot
  // update in backward.
  InBackwardUpdate(const std::vector<Param>& params, StepDriver& driver, TrainState& state,
                   bool synced_by_plugin, std::string where);

  // A grad_sync plugin said it hands the final gradients over (after construction: ZeRO's
  // buckets are made with the driver).
  void plugin_hands_final_grads() { synced_by_plugin_ = true; }
  // After params_ready: several ranks need a grad_sync plugin that hands them over
  // (`grad_sync`: that plugin's name, empty for none).
  void check_sync(int world_size, const std::string& grad_sync) const;
  // Before each micro-batch's backward: on the last, arms a driver that updates its own pieces
  // (StepDriver::updates_pieces_in_backward) with this step's update.
  void before_backward();
  // Runs after every plugin's grad_ready handler: when no plugin syncs gradients, on the last
  // micro-step, updates `param` from its .grad and frees it (else nothing).
  void grad_ready(const Param& param);
  // Engine::grad_final: updates `param` from `grad` now.
  void grad_final(const at::Tensor& param, const at::Tensor& grad);
  // After the last micro-batch's after_backward: updates what had a gradient but no final one
  // (see the Note), frees every gradient, checks that a grad_sync plugin handed every gradient
  // over. Returns the squared global gradient norm (a 0-d fp64 tensor; reading it is the step's
  // host sync) and starts the books of the next step.
  at::Tensor finish_backward();

 private:
  size_t index_of(const at::Tensor& param) const;
  // may_hold: a small CUDA gradient may wait in the batch (Note [Small gradients batched on a
  // GPU] in the .cpp) when the driver is the default one.
  void update(size_t index, const at::Tensor& grad, bool may_hold = false);
  void flush_held();  // updates the held batch
  // On a GPU with the default driver: makes `guard` set the side stream current, after it
  // waits for the work queued so far on `grad`'s current stream (Note [Updates on a side
  // stream] in the .cpp). Elsewhere leaves `guard` empty and returns false.
  bool enter_side_stream(const at::Tensor& grad, c10::OptionalStreamGuard& guard);
  void check_unscaled() const;  // ConfigError while the loss is scaled

  std::vector<Param> params_;
  StepDriver& driver_;
  TrainState& state_;
  bool synced_by_plugin_;
  bool by_pieces_;  // the driver updates its own pieces (ZeRO stages 1-2), no update_param
  std::string where_;  // the job's key, for messages
  std::unordered_map<const void*, size_t> index_;  // TensorImpl -> position in params_
  // This step's sum(g^2) per parameter (CPU), or its fp32 norm (CUDA: Note [Small gradients
  // batched on a GPU] in the .cpp); undefined: not updated (or held).
  std::vector<at::Tensor> squares_;
  std::vector<char> taken_;  // this step: the parameter's gradient was taken (updated or held)
  DefaultStepDriver* batching_driver_;  // the default driver (the only one that batches), or null
  std::vector<std::pair<const Param*, at::Tensor>> held_;  // small CUDA gradients not yet applied
  std::vector<size_t> held_index_;
  int64_t held_bytes_ = 0;
  int64_t held_limit_ = int64_t{1} << 24;  // 16 MiB held, then applied
  bool batch_on_cpu_ = false;               // LOOM_IN_BACKWARD_BATCH: the CPU twin
  bool side_stream_enabled_ = true;         // LOOM_IN_BACKWARD_STREAM=0 turns it off
  std::optional<c10::Stream> side_;         // the updates' stream, once a GPU gradient came
  std::optional<c10::Event> side_ready_;    // the main stream's work, waited for by side_
  std::optional<c10::Event> side_done_;     // side_'s work, waited for after backward
};

// Note [One resolved job]: what a job with [train] optimizer_in_backward = true may not have,
// refused before anything is built (ConfigError naming the key).
void check_optimizer_in_backward(const ConfigSection& train);

}  // namespace loom
