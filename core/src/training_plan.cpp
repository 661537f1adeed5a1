// The run's batches and steps counted from the job and the sampler. See training_plan.h.
#include "training_plan.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <cmath>

#include "loom/comm.h"
#include "loom/error.h"
#include "loom/log.h"
#include "prepared_job.h"

namespace loom {

SamplerOptions sampler_options(const ConfigSection& train, const ConfigSection& data,
                               uint64_t seed, int rank, int world_size) {
  SamplerOptions sampler;
  sampler.batch_size = train.get_int("per_device_train_batch_size");
  sampler.shuffle = data.get_bool("shuffle");
  sampler.drop_last = data.get_bool("drop_last");
  const int64_t data_seed = train.get_int("data_seed");
  sampler.seed = data_seed >= 0 ? static_cast<uint64_t>(data_seed) : seed;
  sampler.rank = rank;
  sampler.world_size = world_size;
  return sampler;
}

int64_t count_steps_by_epochs(PreparedJob& job, const Sampler& sampler,
                              int64_t accumulation_steps) {
  const double epochs = job.section("train").get_float("num_train_epochs");
  const int64_t per_epoch = std::max<int64_t>(1, sampler.batches_per_epoch() / accumulation_steps);
  const int64_t steps = static_cast<int64_t>(std::ceil(epochs * static_cast<double>(per_epoch)));
  job.set_total_steps(steps);
  log::info("num_train_epochs ", epochs, " x ", per_epoch, " optimizer steps per epoch = ", steps,
            " steps");
  return steps;
}

int64_t epoch_of_next_batch(const DataSource& data) {
  const DataPosition next = data.position();
  const Sampler& sampler = data.sampler();
  const int64_t per_rank = sampler.samples_per_rank(), batch = sampler.options().batch_size;
  const bool finished = next.cursor >= per_rank ||
                        (sampler.options().drop_last && next.cursor + batch > per_rank);
  return finished ? next.epoch + 1 : next.epoch;
}

Window draw_window(DataSource& data, int64_t accumulation_steps, Comm& comm) {
  Window window;
  for (int64_t k = 0; k < accumulation_steps; ++k) {
    window.batches.push_back(data.next());
    Batch& drawn = window.batches.back();
    if (!drawn.host_stats.known && (!drawn.input_ids.defined() || drawn.input_ids.is_cpu()))
      drawn.compute_host_stats();
    window.local_targets += drawn.num_loss_targets();
    window.samples += drawn.num_samples();
    window.tokens += drawn.num_tokens();
  }
  window.targets = window.local_targets;
  if (comm.world_size() > 1) {
    // On the backend's device (NCCL takes CUDA tensors only); one sync per step.
    at::Tensor counts = at::full({1}, static_cast<double>(window.local_targets),
                                 at::TensorOptions().dtype(at::kDouble).device(comm.device()));
    comm.all_reduce(counts, ReduceOp::sum)->wait();
    window.targets = static_cast<int64_t>(counts.item<double>());
  }
  return window;
}

void check_same_batch_on_every_rank(const ConfigSection& train, int64_t accumulation_steps,
                                    Comm& comm) {
  const int64_t mine[2] = {train.get_int("per_device_train_batch_size"), accumulation_steps};
  // Maxima of the values and of their negations: one all-reduce gives the largest and smallest.
  at::Tensor both = at::tensor({mine[0], mine[1], -mine[0], -mine[1]}, at::kLong).to(comm.device());
  comm.all_reduce(both, ReduceOp::max)->wait();
  both = both.cpu();
  const int64_t most = both[0].item<int64_t>(), least = -both[2].item<int64_t>();
  LOOM_CHECK_AS(ConfigError, most == least && both[1].item<int64_t>() == -both[3].item<int64_t>(),
                train.where("auto_find_batch_size"), ": auto_find_batch_size chose "
                "per-device batches from ", least, " to ", most, " on different ranks (this "
                "rank ", mine[0], "); set [train] memory_budget to the same size for every "
                "rank, or set per_device_train_batch_size yourself");
}

}  // namespace loom
