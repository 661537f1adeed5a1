// step_sums.h (core-internal) — the numbers a training step's micro-batches leave on the device
// (the summed loss, the auxiliary losses), kept there until the step's one host read, which on
// several ranks is one all-reduce that also carries what the ranks must agree on at the step's
// end. Not the loss arithmetic of backward: the engine's step does that.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace loom {

class Comm;

class StepSums {
 public:
  // What the host read gives: over every rank on several ranks, this rank's on one.
  struct Read {
    double loss_sum = 0;     // the window's summed loss (divide by its targets)
    double aux_sum = 0;      // the micro-batches' auxiliary losses, summed
    bool stop = false;       // some rank was asked to stop (Note [Graceful stop])
    bool writer_busy = false;  // some rank's checkpoint writer is still busy (Note
                               // [Asynchronous checkpoints])
  };
  explicit StepSums(c10::Device device);
  // A micro-batch's summed loss (a one-element tensor, any float dtype), added without a sync.
  void add_loss(const at::Tensor& loss_sum);
  // A micro-batch's auxiliary loss (Note [Auxiliary losses]), likewise.
  void add_aux(const at::Tensor& aux_loss);
  // The step's one host read, with this rank's `stop` request and `writer_busy`. Every rank
  // together when there are several.
  Read read(bool stop, bool writer_busy, Comm& comm);

 private:
  // [loss sum, stop requests, aux losses, busy writers] in fp64 on the step's device.
  at::Tensor sums_;
};

}  // namespace loom
