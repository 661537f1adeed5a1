// loom/sharding/grad_buckets.h — gradients packed into flat buckets that are reduced across
// ranks as soon as every gradient of a bucket is ready, so communication overlaps the rest of
// backward. DDP all-reduces the buckets; ZeRO-2/3 will reduce-scatter the same buckets.
// Not a scheduler of its own: it reacts to the engine's grad_ready events.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "loom/comm.h"
#include "loom/engine.h"

#pragma GCC visibility push(default)

namespace loom::sharding {

struct BucketStats {
  double comm_seconds = 0.0;       // wall time from each launch to its completion, summed
  double exposed_seconds = 0.0;    // time spent waiting in finish(): communication not hidden
  int64_t buckets = 0, bytes = 0;  // per synchronisation
};

class GradBuckets {
 public:
  // Buckets are filled in reverse parameter order (the order backward produces gradients),
  // each holding up to bucket_bytes (at least one tensor). overlap = false launches every
  // bucket only in finish(), for comparison.
  GradBuckets(const std::vector<Param>& params, int64_t bucket_bytes, Comm& comm, bool overlap);

  // A parameter's grad is complete for this backward: copy it into its bucket; launch the
  // bucket's all-reduce once all its gradients are in.
  void grad_ready(const Param& param);
  // Launches what is left, waits for every bucket, writes the rank-averaged gradients back.
  void finish();
  // Note [Final gradients]: finish() hands each parameter's averaged gradient to `final_grad`
  // as soon as its bucket has been waited for, bucket by bucket, so what the caller does with
  // it overlaps the later buckets' all-reduces. `grad` is the gradient in the parameter's dtype,
  // valid during the call only (it may view the bucket). With `keep` = FinalGrad::in_grad it is
  // the parameter's .grad, written first (Note [Overlapped update] in
  // loom/offload/offloaded_driver.h: the offloaded host store reads it there); with
  // FinalGrad::handed_over, Note [Optimizer in backward] (core/src/optimizer_in_backward.h),
  // .grad is never written and grad_ready releases it once copied into its bucket, its bytes
  // back at once (the caller passes engine.grad_final and says so with
  // Engine::will_hand_final_grads). One receiver: set once.
  enum class FinalGrad { in_grad, handed_over };
  using FinalGradHandler = std::function<void(const at::Tensor& param, const at::Tensor& grad)>;
  void on_final_grad(FinalGrad keep, FinalGradHandler final_grad);
  const BucketStats& last_stats() const { return stats_; }
  size_t bucket_count() const { return buckets_.size(); }
  // The buckets' own bytes (kept between steps: a second fp32 copy of the gradients).
  int64_t buffer_bytes() const;

 private:
  struct Slot {
    at::Tensor param;
    int64_t offset = 0, numel = 0;
    bool ready = false;
  };
  struct Bucket {
    Comm* comm = nullptr;  // its parameters' replicas (the job's Comm, or a placed group's)
    at::Tensor flat;  // fp32 (n)
    std::vector<Slot> slots;
    size_t pending = 0;
    std::shared_ptr<Work> work;
    std::chrono::steady_clock::time_point launched;
  };
  void launch(Bucket& bucket);

  Comm& comm_;
  bool overlap_;
  FinalGrad keep_ = FinalGrad::in_grad;
  FinalGradHandler final_grad_;  // on_final_grad's; empty: .grad is written, nothing called
  std::vector<Bucket> buckets_;
  std::unordered_map<const void*, std::pair<size_t, size_t>> where_;  // impl -> (bucket, slot)
  BucketStats stats_;
};

// One starting point for every replica: rank 0's parameters (and buffers when `buffers`) are
// broadcast to every rank; a placed parameter (expert parallelism) is broadcast within its
// replicas. Collective (from params_ready on); a no-op on one rank.
void start_from_rank0(Engine& engine, bool buffers);

}  // namespace loom::sharding

#pragma GCC visibility pop
