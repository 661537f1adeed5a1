// Each parameter updated as its gradient becomes final. See optimizer_in_backward.h and
// Note [Optimizer in backward] there.
#include "optimizer_in_backward.h"

#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/grad_mode.h>

#include "loom/error.h"

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
}

size_t InBackwardUpdate::index_of(const at::Tensor& param) const {
  auto found = index_.find(param.unsafeGetTensorImpl());
  LOOM_INTERNAL_ASSERT(found != index_.end(), "grad_final for a tensor that is not a trainable "
                       "parameter of this job");
  return found->second;
}

void InBackwardUpdate::update(size_t index, const at::Tensor& grad) {
  const Param& param = params_[index];
  // A post-accumulate-grad hook fires once per backward; twice means a second backward through
  // the same parameters within one step, whose contribution would miss this update.
  LOOM_CHECK(!squares_[index].defined(), "step ", state_.step + 1, ": the gradient of ",
             param.name, " became final twice in one step; [train] optimizer_in_backward "
             "updates a parameter once per step, so it cannot take several backward passes per "
             "micro-batch; turn it off for this job");
  check_unscaled();
  at::NoGradGuard no_grad;
  squares_[index] = squared_norm({grad});
  driver_.update_param(param, grad, state_.step + 1, state_.lr);
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
  update(index, grad);
  grad = at::Tensor();  // the point: this gradient's bytes are free for the rest of backward
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
  std::vector<at::Tensor> squares;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].tensor.mutable_grad();
    if (!squares_[i].defined() && grad.defined()) {
      // A plugin syncs gradients: an un-handed one is that plugin's gap, and updating from this
      // rank's own gradient would let the replicas drift apart.
      LOOM_CHECK_AS(ConfigError, !synced_by_plugin_, where_, ": the gradient of ",
                    params_[i].name, " was not handed over after its synchronisation (a "
                    "grad_sync plugin's bug: it said it would, Engine::will_hand_final_grads)");
      update(i, grad);  // a gradient from an earlier micro-step only (see the Note)
    }
    grad = at::Tensor();
    if (squares_[i].defined()) squares.push_back(squares_[i]);
    squares_[i] = at::Tensor();
  }
  // The normal step's squared_norm: per-tensor sums stacked in parameter order, then summed.
  if (squares.empty()) return at::zeros({}, at::kDouble);
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
