// ZeRO's gradient reduction: each bucket packed as its gradients arrive, reduce-scattered, and
// landed in the rank's gradient chunk (Note [Bucket memory]); with shard groups, each landed
// chunk all-reduced across them (Note [Hybrid sharding]). Part of ZeroDriver (zero_driver.h).
#include "loom/sharding/zero_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "loom/error.h"

namespace loom::sharding {

using Clock = std::chrono::steady_clock;

void ZeroDriver::pack(Group& group, size_t index, const at::Tensor& grad) {
  const int64_t chunk = group.plan.chunk;
  if (!group.send.defined())
    group.send = at::zeros({chunk * world_}, at::TensorOptions().dtype(at::kFloat).device(device_));
  if (!grad.defined()) return;  // unused this backward: its elements stay zero
  at::Tensor flat = grad.reshape(-1);
  for (const Placement& where : placements_[index])
    group.send.narrow(0, where.rank * chunk + where.piece.chunk_offset, where.piece.numel)
        .copy_(flat.narrow(0, where.piece.offset, where.piece.numel));
}

void ZeroDriver::grad_ready(const Param& param) {
  auto found = index_of_.find(param.tensor.unsafeGetTensorImpl());
  LOOM_INTERNAL_ASSERT(found != index_of_.end(), "grad_ready for unknown parameter ", param.name);
  const size_t index = found->second;
  if (ready_[index]) return;
  ready_[index] = true;
  if (!backward_open_) {  // this backward's first gradient: its statistics start here
    backward_open_ = true;
    stats_.comm_seconds = stats_.exposed_seconds = 0.0;
  }
  Group& group = groups_[group_of_[index]];
  at::NoGradGuard no_grad;
  // Note [Unit buckets in flight]: a reduce-scatter that finished lands now, not at the next
  // launch (completed() never blocks).
  if (group.sharded) land_finished();
  pack(group, index, param.tensor.grad());
  // Once in its bucket, .grad goes (Note [Stage 1's gradient once packed] in zero_driver.h):
  // stages 2-3 pack on every micro-step, stage 1 on the window's last only, after which its
  // .grad is read by nothing.
  at::Tensor(param.tensor).mutable_grad() = at::Tensor();
  if (--group.pending == 0) {
    // Backward is done with this unit: its weights go, and the reduce-scatters launched
    // before it land, before its reduce-scatter's buffers come (Note [Unit buckets in flight]).
    if (group.sharded) release(group_of_[index]);
    if (options_.overlap) {
      if (group.sharded) land_all();
      launch(group_of_[index]);
    }
  }
}

void ZeroDriver::launch(size_t g) {
  Group& group = groups_[g];
  group.received = at::empty({group.plan.chunk}, group.send.options());
  group.launched = Clock::now();
  group.work = comm_.reduce_scatter(group.received, group.send, ReduceOp::sum);
  group.launched_this_backward = true;
  stats_.elements += group.send.numel();
  flying_.push_back(g);
  flying_bytes_ += bucket_bytes(group);
  land_finished();
}

// Note [Bucket memory]: a launched group holds its send buffer (world x chunk fp32: the
// group's whole gradient) and its received chunk until it lands. Landing them all after
// backward would hold the model's whole fp32 gradient at backward's end, which is what stages
// 2 and 3 exist to avoid. So groups land in launch order as they go: any that finished, and,
// past kBucketsInFlight reduce buckets in flight (send and received counted), the oldest even
// if it has not (backward then waits on it, which the exposed-communication metric shows).
// Two buckets starved gloo on 2 CPU cores (16 % of the reduction hidden, against 66 % with no
// cap; docs/BENCHMARKS.md); four is DeepSpeed's order too (its overlap_comm documents about
// 4.5 x reduce_bucket_size).
constexpr int64_t kBucketsInFlight = 4;

int64_t ZeroDriver::bucket_bytes(const Group& group) {
  return group.send.nbytes() + group.received.nbytes();
}

// Note [Unit buckets in flight]: at stage 3 a unit's reduce-scatter holds more than its
// gradient: the packed send buffer (world x chunk fp32, the whole unit), the received chunk,
// and, on gloo, the all-to-all's receive buffer of the send's size (Note [Gloo reduce-scatter]
// in core/src/comm_c10d.cpp) -- at width 1600 on 2 ranks 117 + 59 + 117 MiB. Bounded by
// kBucketsInFlight reduce buckets, two of them flew at once during a unit's backward, beside
// the unit computing, its gradients and the next unit's gather: the step's peak (the 2-rank
// stand-in in docs/BENCHMARKS.md). So when a unit's gradients are all packed, its weights are
// released first, then every reduce-scatter launched before it lands (it has had the whole
// unit's backward to finish: a wait here shows in exposed_seconds), and only then are its own
// buffers made: one unit's reduce-scatter in flight at a time. The sums are the same
// collectives in the same order: the gradients are bitwise those of any other landing order.
void ZeroDriver::land_all() {
  for (; !flying_.empty(); flying_.pop_front()) land(groups_[flying_.front()]);
  flying_bytes_ = 0;  // nothing in flight
}

void ZeroDriver::land_finished() {
  while (!flying_.empty()) {
    Group& oldest = groups_[flying_.front()];
    const bool over =
        flying_bytes_ > kBucketsInFlight * options_.reduce_bucket_bytes && flying_.size() > 1;
    if (!over && !oldest.work->completed()) break;
    flying_bytes_ -= bucket_bytes(oldest);
    flying_.pop_front();
    land(oldest);
  }
}

void ZeroDriver::land(Group& group) {
  const auto waited = Clock::now();
  group.work->wait();
  const auto done = Clock::now();
  stats_.exposed_seconds += std::chrono::duration<double>(done - waited).count();
  stats_.comm_seconds += std::chrono::duration<double>(done - group.launched).count();
  // The engine scaled each rank's loss by world / global targets: the average is the gradient
  // (over every rank, the other shard groups' part added by reduce_across_replicas).
  group.received.div_(world_comm_.world_size());
  const size_t g = static_cast<size_t>(&group - groups_.data());
  // Stages 2-3: the shard is made at the group's first landing of each step (zero_grad
  // released it: Note [Gradients released, not zeroed]), and again after Note [Updating chunks
  // in backward] freed it.
  if (options_.stage >= 2 && !group.grad.defined())
    group.grad = at::zeros({group.plan.chunk}, group.received.options().dtype(weight_dtype_));
  const bool across = replica_comm_ && window_end_;
  if (across) {
    // Note [Hybrid sharding]: the window's chunk so far plus this one, in fp32, across groups.
    at::Tensor sum = group.received;
    if (options_.stage >= 2) sum = group.grad.to(at::kFloat).add_(group.received);
    launch_across_replicas(g, std::move(sum));
  } else if (options_.stage >= 2) {
    group.grad.add_(group.received);
  } else {
    // Stage 1: the window's whole gradient arrives at once, kept in the weights' dtype as the
    // unsharded driver keeps .grad (so both update from the same values).
    group.grad = weight_dtype_ == at::kFloat ? group.received : group.received.to(weight_dtype_);
  }
  group.work.reset();
  group.send = at::Tensor();
  group.received = at::Tensor();
  group.pending = group.plan.tensors.size();
  if (!across) chunk_final(g);  // else once its sum across the groups lands
}

void ZeroDriver::finish_backward(bool window_end) {
  at::NoGradGuard no_grad;
  if (!backward_open_) stats_.comm_seconds = stats_.exposed_seconds = 0.0;
  backward_open_ = false;
  // Every rank launches every group, in the same order: parameters without a gradient this
  // backward count as zeros.
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& group = groups_[g];
    if (group.launched_this_backward) continue;
    for (size_t index : group.plan.tensors)
      if (!ready_[index]) {
        pack(group, index, at::Tensor());
        at::Tensor(params_[index].tensor).mutable_grad() = at::Tensor();
      }
    launch(g);
  }
  for (size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].sharded) release(g);
  in_backward_ = false;
  land_all();
  for (auto& group : groups_) group.launched_this_backward = false;
  std::fill(ready_.begin(), ready_.end(), false);
  LOOM_INTERNAL_ASSERT(!replica_comm_ || window_end == window_end_, "hybrid sharding: the zero "
                       "plugin's begin_backward and finish_backward disagree on the window's end");
  if (window_end) reduce_across_replicas();
}

// Note [Hybrid sharding]: `sum` (fp32; for fp32 stage-2 chunks, the chunk itself) is summed
// over the replica Comm in flight; past kBucketsInFlight reduce buckets of them, the oldest
// lands first (Note [Bucket memory]).
void ZeroDriver::launch_across_replicas(size_t g, at::Tensor sum) {
  Group& group = groups_[g];
  LOOM_INTERNAL_ASSERT(!group.across_work, "a chunk sent across groups twice in one backward");
  group.across = sum.to(replica_comm_->device());
  group.across_work = replica_comm_->all_reduce(group.across, ReduceOp::sum);
  stats_.elements += group.across.numel();
  stats_.cross_group_elements += group.across.numel();
  across_flying_.push_back(g);
  across_bytes_ += group.across.nbytes();
  while (across_bytes_ > kBucketsInFlight * options_.reduce_bucket_bytes &&
         across_flying_.size() > 1) {
    land_across(across_flying_.front());
    across_flying_.pop_front();
  }
}

void ZeroDriver::land_across(size_t g) {
  Group& group = groups_[g];
  const auto waited = Clock::now();
  group.across_work->wait();
  stats_.exposed_seconds += std::chrono::duration<double>(Clock::now() - waited).count();
  at::Tensor sum = group.across.to(device_);
  if (options_.stage == 1) {
    group.grad = sum.to(weight_dtype_);  // the dtype the update reads, as without groups
  } else if (!sum.is_same(group.grad)) {
    group.grad.copy_(sum);
  }
  across_bytes_ -= group.across.nbytes();
  group.across = at::Tensor();
  group.across_work.reset();
  chunk_final(g);  // Note [Updating chunks in backward]
}

void ZeroDriver::reduce_across_replicas() {
  for (; !across_flying_.empty(); across_flying_.pop_front()) land_across(across_flying_.front());
  across_bytes_ = 0;
}

}  // namespace loom::sharding
