// The step's sums on the device and their one host read. See step_sums.h.
#include "step_sums.h"

#include <ATen/ops/zeros.h>

#include "loom/comm.h"

namespace loom {

StepSums::StepSums(c10::Device device)
    : sums_(at::zeros({4}, at::TensorOptions().dtype(at::kDouble).device(device))) {}

void StepSums::add_loss(const at::Tensor& loss_sum) {
  sums_.narrow(0, 0, 1).add_(loss_sum.detach().to(at::kDouble).reshape({1}));
}

void StepSums::add_aux(const at::Tensor& aux_loss) {
  sums_.narrow(0, 2, 1).add_(aux_loss.detach().to(at::kDouble).reshape({1}));
}

StepSums::Read StepSums::read(bool stop, bool writer_busy, Comm& comm) {
  sums_.narrow(0, 1, 1).fill_(stop ? 1.0 : 0.0);
  sums_.narrow(0, 3, 1).fill_(writer_busy ? 1.0 : 0.0);
  if (comm.world_size() > 1) {
    // On the backend's device (NCCL takes CUDA tensors only).
    sums_ = sums_.to(comm.device());
    comm.all_reduce(sums_, ReduceOp::sum)->wait();
  }
  const at::Tensor host = sums_.cpu();
  Read out;
  out.loss_sum = host[0].item<double>();
  out.stop = host[1].item<double>() > 0;
  out.aux_sum = host[2].item<double>();
  out.writer_busy = host[3].item<double>() != 0;
  return out;
}

}  // namespace loom
