// ZeRO's update rule over the rank's pieces: all of them at once in memory, a group's as its
// chunk lands (Note [Updating chunks in backward]), or one at a time as the swap file's walk
// brings them in (Note [Offloaded ZeRO]); rules with whole-tensor statistics add their partial
// sums over the ranks first. Part of ZeroDriver (zero_driver.h).
#include "loom/sharding/zero_driver.h"

#include <ATen/ATen.h>

#include <map>

#include "loom/error.h"

namespace loom::sharding {

at::Tensor ZeroDriver::piece_weights(size_t g, size_t k) const {
  const Group& group = groups_[g];
  const Piece& piece = group.plan.ranks[rank_][k];
  if (group.sharded) return group.unit.shard.narrow(0, piece.chunk_offset, piece.numel);
  return params_[piece.tensor].tensor.detach().view(-1).narrow(0, piece.offset, piece.numel);
}

bool ZeroDriver::reads_as_is(const at::Tensor& grad) const {
  return grad.is_cpu() && grad.scalar_type() == at::kBFloat16 &&
         (rounded_ ? fused_rule_ : reads_bf16_grads_);
}

std::vector<ZeroDriver::Held> ZeroDriver::hold_pieces(const std::vector<size_t>& groups,
                                                      std::vector<at::Tensor>& fp32_grads,
                                                      bool as_is) {
  std::vector<Held> held;
  for (size_t g : groups) {
    Group& group = groups_[g];
    LOOM_INTERNAL_ASSERT(group.grad.defined(), "ZeRO update without a reduced gradient");
    const bool kept = as_is && reads_as_is(group.grad);
    at::Tensor grad = group.grad.scalar_type() == at::kFloat || kept ? group.grad
                                                                      : group.grad.to(at::kFloat);
    fp32_grads.push_back(grad);
    for (size_t k = 0; k < group.segments.size(); ++k) {
      // Segment k is this rank's piece k (the constructor made them in that order).
      const Piece& piece = group.plan.ranks[rank_][k];
      Segment& segment = group.segments[k];
      segment.grad = grad.narrow(0, piece.chunk_offset, piece.numel);
      Held h{&segment, piece.tensor};
      if (rounded_) {
        h.weights = piece_weights(g, k);
        h.fused = kept;  // a bf16 gradient kept only for a rule that takes the bf16 weights
      }
      held.push_back(std::move(h));
    }
  }
  return held;
}

void ZeroDriver::widen(const Held& h) const {
  if (!rounded_) return;
  h.segment->param = h.fused ? h.weights : h.weights.to(at::kFloat);
}

void ZeroDriver::round_back(const Held& h, int64_t step) const {
  if (!rounded_) return;
  if (!h.fused) write_rounded(*h.segment, h.weights, step);
  h.segment->param = at::Tensor();
}

void ZeroDriver::write_rounded(const Segment& segment, at::Tensor weights, int64_t step) const {
  if (weights.device() == segment.param.device()) {
    round_weights_to_bf16(segment.param, weights, seed_, segment.name, step, segment.offset);
    return;
  }
  // The offloaded walk's fp32 weights are on the host, a GPU run's weights on the device.
  at::Tensor rounded = at::empty(segment.param.sizes(), segment.param.options().dtype(at::kBFloat16));
  round_weights_to_bf16(segment.param, rounded, seed_, segment.name, step, segment.offset);
  weights.copy_(rounded);
}

int64_t ZeroDriver::update_copy_bytes(size_t g) const {
  const Group& group = groups_[g];
  if (!group.grad.defined()) return 0;
  const bool kept = reads_as_is(group.grad);
  const int64_t chunk = group.plan.chunk;
  int64_t bytes = group.grad.scalar_type() == at::kFloat || kept ? 0 : chunk * 4;
  if (rounded_ && !kept) bytes += chunk * 4;  // the widened weights
  return bytes;
}

void ZeroDriver::update_groups(const std::vector<size_t>& groups, int64_t step, double lr) {
  // Note [Update copies bounded] (core/src/step_driver.cpp): the fp32 copies of half gradients
  // and (Note [ZeRO without masters]) of weights are made a few groups at a time, each batch's
  // released before the next; a batch's results do not depend on its batching.
  constexpr int64_t kUpdateCopyBytes = int64_t{128} << 20;
  if (groups.size() > 1) {
    std::vector<std::vector<size_t>> batches(1);
    int64_t bytes = 0;
    for (size_t g : groups) {
      const int64_t more = update_copy_bytes(g);
      if (!batches.back().empty() && bytes + more > kUpdateCopyBytes) {
        batches.emplace_back();
        bytes = 0;
      }
      batches.back().push_back(g);
      bytes += more;
    }
    if (batches.size() > 1) {  // else all of them in one batch, below
      for (const auto& batch : batches) update_groups(batch, step, lr);
      return;
    }
  }
  std::vector<at::Tensor> fp32_grads;  // keep the converted chunks alive during the update
  const std::vector<Held> held = hold_pieces(groups, fp32_grads, /*as_is=*/true);
  for (const Held& h : held) widen(h);
  // As the default driver: segments sharing lr and weight decay go to the rule together.
  std::map<std::pair<double, double>, std::vector<Segment*>> batches;
  for (const Held& h : held) {
    const auto context = update_context(params_[h.param], step, lr, weight_decay_);
    batches[{context.lr, context.weight_decay}].push_back(h.segment);
  }
  for (auto& [key, segments] : batches) {
    UpdateContext context;
    context.step = step;
    context.lr = key.first;
    context.weight_decay = key.second;
    rule_.update_many(segments, context);
  }
  for (const Held& h : held) {
    round_back(h, step);
    h.segment->grad = at::Tensor();
  }
}

void ZeroDriver::run_rule(int64_t step, double lr) {
  std::vector<size_t> all(groups_.size());
  for (size_t g = 0; g < all.size(); ++g) all[g] = g;
  const int rounds = rule_.reduction_rounds();
  if (rounds == 0) {
    update_groups(all, step, lr);
    return;
  }
  // Whole-tensor statistics: every rank folds its pieces into a zero accumulator per tensor,
  // the accumulators of all tensors go into one all-reduce per round, and each piece is then
  // updated with its tensor's totals (UpdateRule::reduction_rounds).
  std::vector<at::Tensor> fp32_grads;  // keep the converted chunks alive during the update
  const std::vector<Held> held = hold_pieces(all, fp32_grads);
  std::vector<const Held*> mine(params_.size(), nullptr);
  for (const Held& h : held) mine[h.param] = &h;
  std::vector<UpdateContext> contexts;
  for (size_t i = 0; i < params_.size(); ++i)
    contexts.push_back(update_context(params_[i], step, lr, weight_decay_));
  for (int round = 0; round < rounds; ++round) {
    std::vector<at::Tensor> accumulators;
    for (size_t i = 0; i < params_.size(); ++i) {
      const Held* h = mine[i];
      if (h) widen(*h);  // Note [ZeRO without masters]: one piece's fp32 weights at a time
      at::Tensor accumulator =
          h ? rule_.make_accumulator(*h->segment, round) : empty_accumulator(i, round);
      if (h) rule_.accumulate(*h->segment, contexts[i], round, accumulator);
      if (h && rounded_) h->segment->param = at::Tensor();  // read only: nothing to write back
      accumulators.push_back(accumulator);
    }
    reduce_accumulators(accumulators);
    for (size_t i = 0; i < params_.size(); ++i) contexts[i].totals.push_back(accumulators[i]);
  }
  for (const Held& h : held) {
    widen(h);
    rule_.update(*h.segment, contexts[h.param]);
    round_back(h, step);
    h.segment->grad = at::Tensor();
  }
}

at::Tensor ZeroDriver::empty_accumulator(size_t index, int round) const {
  Segment stand_in;  // no piece of the tensor here: the accumulator's shape, nothing to add
  stand_in.name = params_[index].name;
  stand_in.shape = tensors_[index].shape;
  stand_in.group = params_[index].group;
  // Where the rank's own pieces are: offloaded ones in the swap file's (CPU) buffers.
  const c10::Device on = swap_ ? c10::Device(c10::kCPU) : device_;
  stand_in.param = at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(on));
  stand_in.grad = at::empty({0}, stand_in.param.options());
  return rule_.make_accumulator(stand_in, round);
}

void ZeroDriver::reduce_accumulators(std::vector<at::Tensor>& accumulators) {
  if (world_ == 1) return;
  std::vector<at::Tensor> flat;
  for (const auto& a : accumulators) flat.push_back(a.reshape(-1).to(comm_.device()));
  at::Tensor all = at::cat(flat);
  comm_.all_reduce(all, ReduceOp::sum)->wait();
  int64_t at = 0;
  for (auto& a : accumulators) {
    a.copy_(all.narrow(0, at, a.numel()).view(a.sizes()));
    at += a.numel();
  }
}

at::Tensor ZeroDriver::values_of(size_t i) const {
  const auto [g, k] = swapped_[i];
  const Group& group = groups_[g];
  if (group.values.defined()) {  // made only for groups stage 3 does not shard
    const Piece& piece = group.plan.ranks[rank_][k];
    return group.values.narrow(0, piece.chunk_offset, piece.numel);
  }
  return piece_weights(g, k);
}

// Note [Offloaded ZeRO]: the same rule calls as run_rule, one segment at a time as the walk
// brings them in (the rules are elementwise or blockwise within a segment, so the result does
// not depend on how segments are batched).
void ZeroDriver::run_rule_offloaded(int64_t step, double lr) {
  std::vector<at::Tensor> grads(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const at::Tensor& grad = groups_[g].grad;
    LOOM_INTERNAL_ASSERT(grad.defined(), "ZeRO update without a reduced gradient");
    grads[g] = grad.scalar_type() == at::kFloat && grad.is_cpu() ? grad : grad.to(at::kCPU, at::kFloat);
  }
  auto piece_of = [&](size_t i) -> const Piece& {
    return groups_[swapped_[i].first].plan.ranks[rank_][swapped_[i].second];
  };
  auto with_grad = [&](size_t i, Segment& segment) {
    const Piece& piece = piece_of(i);
    segment.grad = grads[swapped_[i].first].narrow(0, piece.chunk_offset, piece.numel);
  };
  // Note [Offloaded parameters]: the unit whose shard the updating walk is in, resident (read
  // from its home without masters, fresh to be rebuilt whole from them); the last unit's goes
  // home as soon as the walk leaves it.
  size_t open_group = groups_.size();
  auto open_shard = [&](size_t i, bool read) {
    const size_t g = swapped_[i].first;
    if (!param_file_ || !groups_[g].sharded || open_group == g) return;
    if (open_group < groups_.size()) param_file_->flush(groups_[open_group].unit);
    open_group = g;
    param_file_->make_resident(groups_[g].unit, read);
  };
  // A reading walk's view of segment i's weights: with offload_param a copy of its unit's
  // shard, read once per unit, so nothing becomes resident that no write will send home.
  size_t read_group = groups_.size();
  at::Tensor read_shard;
  auto reading_values = [&](size_t i) {
    const size_t g = swapped_[i].first;
    if (!param_file_ || !groups_[g].sharded || groups_[g].unit.shard.defined()) return values_of(i);
    if (read_group != g) {
      read_shard = param_file_->read(groups_[g].unit);
      read_group = g;
    }
    return read_shard.narrow(0, piece_of(i).chunk_offset, piece_of(i).numel);
  };
  // Note [ZeRO without masters]: segment i's fp32 weights for the rule (on the CPU, where the
  // walk's buffers are), and written back rounded into the weights wherever they live (with
  // offload_param, the unit's resident shard).
  auto widen_swapped = [&](size_t i, Segment& segment, bool updating) {
    if (!rounded_) return;
    if (updating) open_shard(i, /*read=*/true);
    segment.param = (updating ? values_of(i) : reading_values(i)).to(at::kCPU, at::kFloat);
  };
  auto round_swapped = [&](size_t i, Segment& segment, int64_t at_step) {
    if (!rounded_) return;
    write_rounded(segment, values_of(i), at_step);
    segment.param = at::Tensor();
  };
  auto store = [&](size_t i, const Segment& segment) {
    if (!swap_->separate_master(i)) return;
    open_shard(i, /*read=*/false);
    values_of(i).copy_(segment.param);
  };
  std::vector<UpdateContext> contexts;
  for (size_t i = 0; i < params_.size(); ++i)
    contexts.push_back(update_context(params_[i], step, lr, weight_decay_));
  if (rule_.reduction_rounds() == 0) {
    swap_->walk([&](size_t i, Segment& segment) {
      with_grad(i, segment);
      widen_swapped(i, segment, /*updating=*/true);
      const UpdateContext& context = contexts[piece_of(i).tensor];
      rule_.update_many({&segment}, context);
      round_swapped(i, segment, step);
      store(i, segment);
      return true;
    });
    return;
  }
  for (int round = 0; round < rule_.reduction_rounds(); ++round) {
    std::vector<at::Tensor> accumulators(params_.size());
    swap_->walk([&](size_t i, Segment& segment) {  // reading only
      with_grad(i, segment);
      widen_swapped(i, segment, /*updating=*/false);
      const size_t index = piece_of(i).tensor;
      accumulators[index] = rule_.make_accumulator(segment, round);
      rule_.accumulate(segment, contexts[index], round, accumulators[index]);
      return false;
    });
    for (size_t i = 0; i < params_.size(); ++i)
      if (!accumulators[i].defined()) accumulators[i] = empty_accumulator(i, round);
    reduce_accumulators(accumulators);
    for (size_t i = 0; i < params_.size(); ++i) contexts[i].totals.push_back(accumulators[i]);
  }
  read_shard = at::Tensor();  // the reading walks' last copy, not kept through the update
  swap_->walk([&](size_t i, Segment& segment) {
    with_grad(i, segment);
    widen_swapped(i, segment, /*updating=*/true);
    rule_.update(segment, contexts[piece_of(i).tensor]);
    round_swapped(i, segment, step);
    store(i, segment);
    return true;
  });
}

}  // namespace loom::sharding
