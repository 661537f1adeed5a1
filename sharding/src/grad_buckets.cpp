// Gradient buckets for data-parallel reduction. See grad_buckets.h.
#include "loom/sharding/grad_buckets.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "loom/error.h"
#include "loom/model.h"
#include "loom/nn.h"

namespace loom::sharding {

using Clock = std::chrono::steady_clock;

GradBuckets::GradBuckets(const std::vector<Param>& params, int64_t bucket_bytes, Comm& comm,
                         bool overlap)
    : comm_(comm), overlap_(overlap) {
  LOOM_CHECK_AS(ConfigError, bucket_bytes > 0, "the gradient bucket size must be positive");
  // A bucket holds parameters of one replica group only (Note [Placed parameters]): expert
  // parameters are reduced over their replicas, the rest over every rank.
  std::vector<std::vector<const Param*>> groups(1);
  int64_t filled = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const int64_t bytes = it->tensor.numel() * 4;
    if (!groups.back().empty() && (filled + bytes > bucket_bytes ||
                                   groups.back().front()->replicas != it->replicas)) {
      groups.emplace_back();
      filled = 0;
    }
    groups.back().push_back(&*it);
    filled += bytes;
  }
  for (const auto& group : groups) {
    Bucket bucket;
    bucket.comm = group.front()->replicas ? group.front()->replicas.get() : &comm_;
    int64_t offset = 0;
    for (const Param* p : group) {
      where_[p->tensor.unsafeGetTensorImpl()] = {buckets_.size(), bucket.slots.size()};
      bucket.slots.push_back({p->tensor, offset, p->tensor.numel(), false});
      offset += p->tensor.numel();
    }
    bucket.flat = at::zeros({offset}, at::TensorOptions().dtype(at::kFloat).device(
                                          group.front()->tensor.device()));
    bucket.pending = bucket.slots.size();
    buckets_.push_back(std::move(bucket));
  }
}

void GradBuckets::on_final_grad(FinalGrad keep, FinalGradHandler final_grad) {
  LOOM_INTERNAL_ASSERT(!final_grad_, "GradBuckets::on_final_grad set twice: its final "
                       "gradients have one receiver");
  keep_ = keep;
  final_grad_ = std::move(final_grad);
}

int64_t GradBuckets::buffer_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) bytes += bucket.flat.numel() * bucket.flat.element_size();
  return bytes;
}

void GradBuckets::grad_ready(const Param& param) {
  auto found = where_.find(param.tensor.unsafeGetTensorImpl());
  LOOM_INTERNAL_ASSERT(found != where_.end(), "grad_ready for unknown parameter ", param.name);
  Bucket& bucket = buckets_[found->second.first];
  Slot& slot = bucket.slots[found->second.second];
  if (slot.ready) return;  // a parameter used twice in one graph reports twice
  at::NoGradGuard no_grad;
  bucket.flat.narrow(0, slot.offset, slot.numel).copy_(param.tensor.grad().reshape(-1));
  // Note [Final gradients]: handed over, the bucket holds it now; .grad's bytes go back at once.
  if (final_grad_ && keep_ == FinalGrad::handed_over) param.tensor.mutable_grad() = at::Tensor();
  slot.ready = true;
  if (--bucket.pending == 0 && overlap_) launch(bucket);
}

void GradBuckets::launch(Bucket& bucket) {
  bucket.launched = Clock::now();
  bucket.work = bucket.comm->all_reduce(bucket.flat, ReduceOp::sum);
}

void GradBuckets::finish() {
  stats_ = {};
  // Summed over each bucket's replicas, divided by the job's world size: the average for an
  // ordinary parameter, and for a placed one (whose gradient already sums what other ranks'
  // tokens contributed) the same normalisation (Note [Placed parameters]).
  const double world = comm_.world_size();
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    if (!bucket.work) {
      // Parameters without a gradient this step contribute zeros, so every rank launches the
      // same buckets in the same order.
      for (auto& slot : bucket.slots)
        if (!slot.ready) bucket.flat.narrow(0, slot.offset, slot.numel).zero_();
      launch(bucket);
    }
  }
  for (auto& bucket : buckets_) {
    const auto waited = Clock::now();
    bucket.work->wait();
    const auto done = Clock::now();
    stats_.exposed_seconds += std::chrono::duration<double>(done - waited).count();
    stats_.comm_seconds += std::chrono::duration<double>(done - bucket.launched).count();
    stats_.buckets += 1;
    stats_.bytes += bucket.flat.numel() * 4;
    bucket.flat.div_(world);
    for (auto& slot : bucket.slots) {
      at::Tensor& grad = slot.param.mutable_grad();
      at::Tensor averaged = bucket.flat.narrow(0, slot.offset, slot.numel).view(slot.param.sizes());
      if (final_grad_ && keep_ == FinalGrad::handed_over) {
        // What .grad would have held (the parameter's dtype), so the update's bits are the same.
        final_grad_(slot.param, averaged.to(slot.param.scalar_type()));
      } else {
        if (grad.defined())
          grad.copy_(averaged);
        else
          grad = averaged.to(slot.param.scalar_type()).clone();
        if (final_grad_) final_grad_(slot.param, grad);
      }
      slot.ready = false;
    }
    bucket.pending = bucket.slots.size();
    bucket.work.reset();
  }
}

void start_from_rank0(Engine& engine, bool buffers) {
  auto& comm = engine.comm();
  if (comm.world_size() == 1) return;
  at::NoGradGuard no_grad;
  std::unordered_map<const void*, Comm*> replicas;
  for (const auto& param : engine.params())
    if (param.replicas) replicas[param.tensor.unsafeGetTensorImpl()] = param.replicas.get();
  for (const auto& item : engine.model().named_parameters(true)) {
    at::Tensor t = item.value().detach();
    // A unit weight cut as it was built was broadcast then (Note [Sharded initialization]).
    if (nn::storage_released(t)) continue;
    // A placed parameter starts as its replica group's first rank's (each group's rows differ).
    auto placed = replicas.find(item.value().unsafeGetTensorImpl());
    Comm& within = placed != replicas.end() ? *placed->second : comm;
    if (within.world_size() > 1) within.broadcast(t, 0)->wait();
  }
  if (buffers)
    for (const auto& item : engine.model().named_buffers(true)) {
      at::Tensor t = item.value();
      comm.broadcast(t, 0)->wait();
    }
}

}  // namespace loom::sharding
