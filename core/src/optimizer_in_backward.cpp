// Each parameter updated as its gradient becomes final. See optimizer_in_backward.h and
// Note [Optimizer in backward] there.
#include "optimizer_in_backward.h"

#include <algorithm>
#include <cstdlib>

#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "loom/error.h"
#include "step_driver.h"

namespace loom {

InBackwardUpdate::InBackwardUpdate(const std::vector<Param>& params, StepDriver& driver,
                                   TrainState& state, bool synced_by_plugin, std::string where)
    : params_(params), driver_(driver), state_(state), synced_by_plugin_(synced_by_plugin),
      by_pieces_(driver.updates_pieces_in_backward()), where_(std::move(where)) {
  LOOM_CHECK_AS(ConfigError, driver_.updates_in_backward() || by_pieces_, where_,
                ": [train] optimizer_in_backward needs a step driver that updates as gradients "
                "become final, but this job's is '", driver_.name(), "'; turn "
                "optimizer_in_backward off for it (ZeRO stage 3 and offloaded optimizers update "
                "sharded or swapped state after backward)");
  for (size_t i = 0; i < params_.size(); ++i) {
    LOOM_CHECK_AS(ConfigError, !params_[i].placed(), where_,
                  ": [train] optimizer_in_backward does not take parameters placed on some "
                  "ranks only ('", params_[i].name, "': expert parallelism, whose gradient norm "
                  "needs a collective after backward); use [moe] expert_parallel_size = 1 or "
                  "turn optimizer_in_backward off");
    index_[params_[i].tensor.unsafeGetTensorImpl()] = i;
  }
  squares_.resize(params_.size());
  taken_.assign(params_.size(), 0);
  batching_driver_ = dynamic_cast<DefaultStepDriver*>(&driver_);
  // The CPU twin of Note [Small gradients batched on a GPU]: LOOM_IN_BACKWARD_BATCH=BYTES holds
  // small gradients on any device, applying them once BYTES are held (the tests' knob).
  if (const char* bytes = std::getenv("LOOM_IN_BACKWARD_BATCH"); bytes && *bytes) {
    batch_on_cpu_ = true;
    held_limit_ = std::max<int64_t>(1, std::atoll(bytes));
  }
  if (const char* side = std::getenv("LOOM_IN_BACKWARD_STREAM"); side && std::string(side) == "0")
    side_stream_enabled_ = false;
}

size_t InBackwardUpdate::index_of(const at::Tensor& param) const {
  auto found = index_.find(param.unsafeGetTensorImpl());
  LOOM_INTERNAL_ASSERT(found != index_.end(), "grad_final for a tensor that is not a trainable "
                       "parameter of this job");
  return found->second;
}

// Note [Small gradients batched on a GPU]: on a GPU each parameter's update is a few tiny
// kernels whose fixed cost (launch and drain, a few microseconds each) adds up over a model's
// ~150 tensors, most of them biases and norms of a few thousand elements. squared_norm's five
// kernels for one tensor and the fused AdamW's step tensor made it 7 kernels a parameter, and
// the step 1.11x the normal one on GPT-2 124M (H200, docs/BENCHMARKS.md "Optimizer in
// backward"). So on a GPU a gradient under kSmallTensorBytes is held, and the held ones are
// applied together once they pass 16 MiB (held_limit_) and at the end of backward: one
// multi-tensor norm and one update_many for the batch, as the normal step runs them. A large tensor is
// updated at once with one norm kernel (its fp32 norm is kept; finish_backward squares and sums
// them all in fp64, as squared_norm does for the normal step: the same per-tensor norms, so the
// same bits). The saving gives up at most 16 MiB of small gradients held at a time. On a
// CPU every update runs at once (no launch cost; the gradient is still in cache), but for the
// twin the tests run (LOOM_IN_BACKWARD_BATCH: the same holding and batched updates on the CPU,
// each norm the CPU's squared_norm, bitwise the normal step: test_optimizer_in_backward.cpp).
constexpr int64_t kSmallTensorBytes = int64_t{1} << 20;

// Note [Updates on a side stream]: on a GPU the updates queued on backward's own stream run
// between its kernels, one after another, so each norm and AdamW kernel (memory-bound, a few
// microseconds to a fraction of a millisecond) adds its whole time to the step: GPT-2 124M on an
// H200 took 1.087x forward + backward (docs/BENCHMARKS.md "Optimizer in backward"). So with the
// default driver they go to a side stream from LibTorch's pool, where the GPU runs them beside
// backward's matrix products. Ordering, through c10's device-generic stream API (the core links
// only LibTorch's CPU half, Note [CUDA loaded on demand]):
// - before each update (or held batch) the side stream waits for an event recorded on the
//   current stream: the gradient, and every earlier write to the parameter, are done;
// - the gradient is recorded on the side stream (record_stream), so the caching allocator does
//   not hand its bytes to backward's next allocation before the update has read them;
// - after backward the current stream waits for the side stream (finish_backward), before the
//   norm is totalled and the next forward reads the weights.
// The parameter itself is safe to update while backward goes on: its gradient is final, so
// every node that reads the weight has run (Note [Optimizer in backward]). The arithmetic is the
// same kernels on another stream, so the weights stay bitwise the normal step's (the GPU test).
// Measured (GPT-2 124M, batch 8, H200): 1.039-1.055x forward + backward against 1.092x on
// backward's stream; a high-priority side stream was slower (1.069x: it delays backward's own
// kernels, the critical path). LOOM_IN_BACKWARD_STREAM=0 queues the updates on backward's
// stream instead (the benchmark's `--one-stream`).
bool InBackwardUpdate::enter_side_stream(const at::Tensor& grad,
                                         c10::OptionalStreamGuard& guard) {
  if (!grad.is_cuda() || !side_stream_enabled_ || !batching_driver_) return false;
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  const c10::Device device = grad.device();
  if (!side_ || side_->device() != device) {
    side_ = impl.getStreamFromGlobalPool(device);
    side_ready_.emplace(c10::DeviceType::CUDA);
    side_done_.emplace(c10::DeviceType::CUDA);
  }
  side_ready_->record(impl.getStream(device));
  side_ready_->block(*side_);
  guard.reset_stream(*side_);
  return true;
}

void InBackwardUpdate::update(size_t index, const at::Tensor& grad, bool may_hold) {
  const Param& param = params_[index];
  // A post-accumulate-grad hook fires once per backward; twice means a second backward through
  // the same parameters within one step, whose contribution would miss this update.
  LOOM_CHECK(!taken_[index], "step ", state_.step + 1, ": the gradient of ",
             param.name, " became final twice in one step; [train] optimizer_in_backward "
             "updates a parameter once per step, so it cannot take several backward passes per "
             "micro-batch; turn it off for this job");
  check_unscaled();
  taken_[index] = 1;
  at::NoGradGuard no_grad;
  if (may_hold && batching_driver_ && (grad.is_cuda() || batch_on_cpu_) &&
      static_cast<int64_t>(grad.nbytes()) < kSmallTensorBytes) {
    held_.emplace_back(&param, grad);
    held_index_.push_back(index);
    held_bytes_ += static_cast<int64_t>(grad.nbytes());
    if (held_bytes_ >= held_limit_) flush_held();
    return;
  }
  c10::OptionalStreamGuard side;
  const bool on_side = enter_side_stream(grad, side);
  squares_[index] = grad.is_cuda() ? at::_foreach_norm({grad}, 2).front() : squared_norm({grad});
  driver_.update_param(param, grad, state_.step + 1, state_.lr);
  if (on_side) grad.record_stream(*side_);
}

void InBackwardUpdate::flush_held() {
  if (held_.empty()) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& item : held_) grads.push_back(item.second);
  c10::OptionalStreamGuard side;
  const bool on_side = enter_side_stream(grads.front(), side);
  if (grads.front().is_cuda()) {
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
    for (size_t k = 0; k < held_index_.size(); ++k) squares_[held_index_[k]] = norms[k];
  } else {  // the CPU twin: the CPU's own per-tensor sums (squared_norm's), as update() keeps
    for (size_t k = 0; k < held_index_.size(); ++k)
      squares_[held_index_[k]] = squared_norm({grads[k]});
  }
  batching_driver_->update_params(held_, state_.step + 1, state_.lr);
  if (on_side)
    for (const at::Tensor& grad : grads) grad.record_stream(*side_);
  held_.clear();
  held_index_.clear();
  held_bytes_ = 0;
}

void InBackwardUpdate::before_backward() {
  if (!by_pieces_ || !state_.sync_grads) return;
  check_unscaled();
  driver_.begin_update_in_backward(state_.step + 1, state_.lr);
}

void InBackwardUpdate::check_unscaled() const {
  // Note [Optimizer in backward]: a loss scaler must see every gradient before any update.
  LOOM_CHECK_AS(ConfigError, !state_.grads_scaled, where_, ": [train] optimizer_in_backward "
                "updates each parameter during backward, but the loss is scaled (loss_scale ",
                state_.loss_scale, ": a dynamic loss scaler, which must check every gradient "
                "for overflow before any update); use bf16 instead of fp16, or turn "
                "optimizer_in_backward off");
}

void InBackwardUpdate::grad_ready(const Param& param) {
  // An earlier micro-step only accumulates; a grad_sync plugin, or a driver updating its own
  // pieces, takes the gradients itself.
  if (!state_.sync_grads || synced_by_plugin_ || by_pieces_) return;
  const size_t index = index_of(param.tensor);
  at::Tensor& grad = param.tensor.mutable_grad();
  LOOM_INTERNAL_ASSERT(grad.defined(), "grad_ready for ", param.name, " without a gradient");
  update(index, grad, /*may_hold=*/true);
  grad = at::Tensor();  // the point: this gradient's bytes are free (or held in a small batch)
}

void InBackwardUpdate::check_sync(int world_size, const std::string& grad_sync) const {
  LOOM_CHECK_AS(ConfigError, world_size == 1 || synced_by_plugin_ || by_pieces_, where_,
                ": [train] optimizer_in_backward on ", world_size, " ranks needs the gradient "
                "sync to hand each averaged gradient over as it lands, which [", grad_sync,
                "] does not; use [ddp] or [zero] stage = 0, or turn optimizer_in_backward off");
}

void InBackwardUpdate::grad_final(const at::Tensor& param, const at::Tensor& grad) {
  LOOM_INTERNAL_ASSERT(!by_pieces_, "grad_final for ", params_[index_of(param)].name, " while "
                       "step driver ", driver_.name(), " updates its own pieces in backward");
  update(index_of(param), grad);
}

at::Tensor InBackwardUpdate::finish_backward() {
  if (by_pieces_) {
    // The driver updated (or updates, as the last chunks land) every piece it holds; what is
    // left in .grad (a whole stage-1 gradient) is not read again.
    for (const Param& param : params_) param.tensor.mutable_grad() = at::Tensor();
    return driver_.grad_norm_squared();
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].tensor.grad();
    if (taken_[i] || !grad.defined()) continue;
    // A plugin syncs gradients: an un-handed one is that plugin's gap, and updating from this
    // rank's own gradient would let the replicas drift apart.
    LOOM_CHECK_AS(ConfigError, !synced_by_plugin_, where_, ": the gradient of ",
                  params_[i].name, " was not handed over after its synchronisation (a "
                  "grad_sync plugin's bug: it said it would, Engine::will_hand_final_grads)");
    update(i, grad, /*may_hold=*/true);  // a gradient from an earlier micro-step only (the Note)
  }
  flush_held();
  if (side_) {  // the current stream (the next forward's) waits for the updates
    side_done_->record(*side_);
    side_done_->block(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(side_->device()));
  }
  std::vector<at::Tensor> squares;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].tensor.mutable_grad() = at::Tensor();
    if (squares_[i].defined()) squares.push_back(squares_[i]);
    squares_[i] = at::Tensor();
    taken_[i] = 0;
  }
  // The normal step's squared_norm: per-tensor sums stacked in parameter order, then summed
  // (on a GPU per-tensor norms, squared in fp64 first).
  if (squares.empty()) return at::zeros({}, at::kDouble);
  if (squares.front().is_cuda()) return at::stack(squares).to(at::kDouble).pow(2).sum();
  return at::stack(squares).sum();
}

void check_optimizer_in_backward(const ConfigSection& train) {
  if (!train.get_bool("optimizer_in_backward")) return;
  LOOM_CHECK_AS(ConfigError, train.get_float("max_grad_norm") == 0, train.where("max_grad_norm"),
                ": [train] max_grad_norm = ", train.get_float("max_grad_norm"), " clips by the "
                "global gradient norm, which needs every gradient before any update, but [train] "
                "optimizer_in_backward = true (", train.where("optimizer_in_backward"),
                ") updates each parameter as its gradient arrives; set max_grad_norm = 0 (its "
                "default is 1.0, the Trainer's) or turn optimizer_in_backward off");
}

}  // namespace loom
