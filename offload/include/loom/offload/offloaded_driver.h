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

class OffloadedStepDriver : public StepDriver {
 public:
  virtual const OffloadStats& last_stats() const = 0;
};

// The unsharded driver with its masters and state in an NVMe swap file. Construction writes
// every segment's initial state to the file, one at a time.
std::unique_ptr<OffloadedStepDriver> make_offloaded_step_driver(const StepDriverOptions& options,
                                                                const OffloadOptions& offload);

}  // namespace loom::offload

#pragma GCC visibility pop
