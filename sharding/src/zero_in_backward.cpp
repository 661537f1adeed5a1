// ZeRO stages 1-2 with [train] optimizer_in_backward: each group's chunk updated as it lands,
// its gradient freed and its new values all-gathered while backward goes on (Note [Updating
// chunks in backward] in zero_driver.h). Part of ZeroDriver; not the update rule's arithmetic
// (zero_update.cpp) nor the gathers' (zero_gather.cpp), which it calls.
#include "loom/sharding/zero_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "loom/error.h"

namespace loom::sharding {

bool ZeroDriver::updates_pieces_in_backward() const {
  return options_.stage <= 2 && !swap_ && rule_.reduction_rounds() == 0;
}

void ZeroDriver::begin_update_in_backward(int64_t step, double lr) {
  LOOM_INTERNAL_ASSERT(updates_pieces_in_backward(), "ZeRO stage ", options_.stage,
                       " cannot update its chunks in backward (the zero plugin refuses it)");
  LOOM_INTERNAL_ASSERT(!backward_update_.armed, "begin_update_in_backward twice before update");
  // Collective on the shard group: every rank arms at the same point of the same step, with
  // no collective of comm_ in flight (the earlier micro-steps' chunks have all landed).
  if (world_ > 1 && !values_comm_) values_comm_ = comm_.split(0, rank_);
  backward_update_.armed = true;
  backward_update_.step = step;
  backward_update_.lr = lr;
  backward_update_.squares.assign(params_.size(), at::Tensor());
  backward_update_.groups_updated = 0;
}

void ZeroDriver::chunk_final(size_t g) {
  if (!backward_update_.armed) return;
  at::NoGradGuard no_grad;
  Group& group = groups_[g];
  // The normal step's norm reads the same pieces of the same chunk (grad_norm_squared).
  for (const Piece& piece : group.plan.ranks[rank_])
    backward_update_.squares[piece.tensor] =
        squared_norm({group.grad.narrow(0, piece.chunk_offset, piece.numel)});
  update_groups({g}, backward_update_.step, backward_update_.lr);
  group.grad = at::Tensor();  // stage 2's shard is made again when the group next lands
  ++backward_update_.groups_updated;
  start_values_gather(g, values_comm_ ? *values_comm_ : comm_);
}

}  // namespace loom::sharding
