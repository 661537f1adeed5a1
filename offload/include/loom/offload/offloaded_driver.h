// loom/offload/offloaded_driver.h — a step driver whose fp32 masters and optimizer state live
// in an NVMe swap file (loom/offload/nvme_store.h) between updates: ZeRO-Infinity's optimizer
// offload for the unsharded case (one rank, or data parallelism where every rank holds all).
//
// Note [Pipelined update]: each trainable tensor is one segment whose masters (when the weights
// are not fp32) and state tensors are one region of the swap file. The update walks the
// segments in order through buffer_count aligned buffers: while the rule updates segment i in
// its buffer, segments i+1 .. i+buffer_count-2 are being read into the next buffers and
// segment i-1 written from the previous one (buffer_count >= 3; a buffer is reused only once
// its write is done). The rule runs on the buffer's bytes as tensors, exactly as the in-memory
// driver runs it on its own, so the updated weights are bitwise the same. Between updates only
// the buffers are in memory: buffer_count x the largest segment's region.
#pragma once

#include <memory>
#include <string>

#include "loom/offload/nvme_store.h"
#include "loom/step_driver.h"

#pragma GCC visibility push(default)

namespace loom::offload {

struct OffloadOptions {
  std::string device = "none";  // none | cpu | nvme (DeepSpeed's offload_optimizer.device)
  NvmeOptions nvme;             // path, block_size, queue_depth
  int buffer_count = 4;         // staging buffers (DeepSpeed's buffer_count), at least 3
  bool pin_memory = true;       // CUDA builds: page-locked staging buffers (no effect on CPU)
};

// What the last update did: its wall time, the part spent in the rule (compute) and the part
// spent waiting for the swap file (I/O not hidden behind compute), and the bytes moved.
struct OffloadStats {
  double update_seconds = 0, compute_seconds = 0, io_wait_seconds = 0;
  int64_t bytes_read = 0, bytes_written = 0;
};

class OffloadedStepDriver : public StepDriver {
 public:
  virtual OffloadStats last_stats() const = 0;
};

// The unsharded driver with its masters and state in an NVMe swap file (Note [Pipelined
// update]). Construction writes every segment's initial state to the file, one at a time.
std::unique_ptr<OffloadedStepDriver> make_offloaded_step_driver(const StepDriverOptions& options,
                                                                const OffloadOptions& offload);

}  // namespace loom::offload

#pragma GCC visibility pop
