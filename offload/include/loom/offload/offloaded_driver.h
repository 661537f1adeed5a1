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
// memory for one copy of the gradients and one of the weights on the host. Clipping, the
// schedule's learning rate and fp16's overflow skip are decided when update(k) is called, on
// step k's own gradients, so they delay as they are. synchronize() waits for the update in
// flight and applies it: the zero plugin calls it when a checkpoint is saved and when the
// run ends, so a checkpoint holds no update in flight (a resume is bitwise the run that went
// on) and the final weights hold every update. A save thus restarts the delay; evaluation
// does not (it sees the weights the next step trains on).
class OffloadedStepDriver : public StepDriver {
 public:
  virtual const OffloadStats& last_stats() const = 0;
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
