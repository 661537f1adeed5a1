// loom/offload/offloaded_driver.h — a step driver whose fp32 masters and optimizer state live
// in an NVMe swap file (loom/offload/nvme_store.h) between updates: ZeRO-Infinity's optimizer
// offload for the unsharded case (one rank, or data parallelism where every rank holds all).
//
// Each trainable tensor is one segment of a SegmentSwap (loom/offload/segment_swap.h, Note
// [Pipelined update] there).
#pragma once

#include <memory>
#include <string>

#include "loom/offload/segment_swap.h"
#include "loom/step_driver.h"

#pragma GCC visibility push(default)

namespace loom::offload {

// Note [Delayed update]: ZeRO-Offload's one-step delayed parameter update
// (`offload_optimizer.delayed_update = true`). update(k) first waits for update k-1, still
// running on its own thread, and copies its new weights into the model; then copies step k's
// gradients (on a GPU: to host memory) and starts update k on that thread, and returns. The
// forward and backward of step k+1 thus overlap update k on the CPU and run on the weights of
// update k-1: each gradient is applied one step late, to masters one update ahead of the
// weights it was computed on. The trade: the CPU update leaves the step's critical path
// (DeepSpeed measured ZeRO-Offload's GPU utilisation gain from it), at the cost of one step
// of gradient staleness (harmless after the first few dozen steps, DeepSpeed reports; this
// driver runs no update late for the first step either — there is none before it) and
// memory for one copy of the gradients and one of the weights on the host, both in the
// weights' dtype (bf16 gradients are widened only as the rule reads each segment). Clipping, the
// schedule's learning rate and fp16's overflow skip are decided when update(k) is called, on
// step k's own gradients, so they delay as they are. synchronize() waits for the update in
// flight and applies it: the zero plugin calls it when a checkpoint is saved and when the
// run ends, so a checkpoint holds no update in flight (a resume is bitwise the run that went
// on) and the final weights hold every update. A save thus restarts the delay; evaluation
// does not (it sees the weights the next step trains on).
//
// Note [Overlapped update]: with the host store (device = "cpu", Note [Host store] in
// segment_swap.h) and no delayed update, the update overlaps backward instead of following it.
// As each parameter's gradient is final — on one rank when backward accumulates it on the last
// micro-step, on several when its bucket's all-reduce is waited for (GradBuckets'
// on_final_grad) — grad_final() takes its squared norm (a device scalar, no host sync) and
// starts its copy into a host buffer of the gradient's dtype (a GPU run: device to
// page-locked host on a side stream, an event marking it done; the twin: a memcpy on the
// worker thread, Note [One code for the GPU and its twin] in copy_stream.h). Without clipping
// ([train] max_grad_norm = 0) and without a loss scale, nothing between backward and the
// update can change a gradient, so the update of that parameter's segment is posted behind
// its copy on the same worker thread at once and runs while backward goes on; its new
// weights go back to the model as it finishes (a GPU run: staged in page-locked memory, then
// host to device on the side stream). update() then waits only for what is still running and
// joins the side stream into the compute stream (no device-wide sync, none per tensor). With
// clipping the update waits for the global norm: the copies and norms still land during
// backward, the engine reads the norm (the stacked per-tensor sums, bitwise the
// unoverlapped squared_norm), scale_grads scales the host copies in their dtype as the
// in-memory driver scales .grad, and update() runs every segment then. A loss scale (fp16)
// waits the same way, since the scaler unscales grads() (the host copies) and may skip the
// step. Either way each segment sees the rule, step, lr and gradient bits the in-memory
// driver gives it, so the weights are bitwise the in-memory run's. What can no longer be
// undone: an update applied during backward cannot be skipped after it (no plugin skips
// without a loss scale; zero_grad() refuses to go on if one did), and a run whose loss turns
// out non-finite fails with its last update applied, as it fails anyway. The swap file
// (device = "nvme") keeps its pipelined walk after backward (Note [Pipelined update]): its
// segments are read in their own order, not backward's. `offload_optimizer.overlap_update =
// false` runs the host store's update after backward as before (for comparison; and a way
// around the GPU half, whose test passes on an H200). Stages 1-3 (ZeRO's driver with its
// pieces in the host store) do not overlap yet: they update after their reduce-scatters.
//
// Note [Offloaded without masters]: with [optimizer] master_dtype = "bf16" ([precision] mode =
// "full_bf16") the bf16 weights are their own masters here too (Note [bf16 weights as their own
// masters] in core/src/step_driver.cpp): the store holds each tensor's optimizer state alone
// (SwapSegment::no_master), 4 B/param less on NVMe or in host memory and 4 B/param less moved
// each way per step, which for one GPU and a big model is most of what the host holds (12 ->
// 8 B/param with fp32 moments, 4 with bf16 ones). Each update widens the weights where the
// CPU can read them — the model's own on a CPU run; on a GPU a host copy, brought over beside
// the gradient (the overlapped update), or the whole tensor before its walk — runs the rule on
// them and writes them back rounded stochastically with the core's bits (the [train] seed, the
// step, the name, each element's index), so the weights are bitwise the in-memory run's
// without masters. The delayed update keeps its host copy of the weights as the truth instead:
// update k starts from update k-1's weights (there, not in the model, which forward is reading)
// and synchronize() copies them in as before. A checkpoint holds no masters; a resume from one
// that has them drops them, and a job with masters resumed from one without starts them from
// the weights, each warned. fp32 weights' copies in the store are their weights exactly after
// every applied update, so no checkpoint saves them either (an in-memory run reads it).
class OffloadedStepDriver : public StepDriver {
 public:
  virtual const OffloadStats& last_stats() const = 0;
  // Note [Overlapped update]: whether grad_final() takes this driver's gradients as they are
  // final.
  virtual bool overlaps_backward() const = 0;
  // `param`'s gradient (its .grad, the ranks' average on several) is final for this step: its
  // copy to host memory starts, and with update_now its update (step, lr) after it.
  virtual void grad_final(const at::Tensor& param, bool update_now, int64_t step,
                          double lr) = 0;
  // Note [Delayed update]: waits for the update in flight, if any, and copies its weights into
  // the model. A no-op without delayed_update.
  virtual void synchronize() = 0;
};

// The unsharded driver with its masters and state in an NVMe swap file. Construction writes
// every segment's initial state to the file, one at a time.
std::unique_ptr<OffloadedStepDriver> make_offloaded_step_driver(const StepDriverOptions& options,
                                                                const OffloadOptions& offload);

}  // namespace loom::offload

#pragma GCC visibility pop
