// training_plan.h (core-internal) — how much a run trains, on what batches: the sampler's
// options from [train] and [data], num_train_epochs counted in optimizer steps, the epoch the
// data is in, each step's accumulation window drawn and its loss targets counted, and the one
// per-device batch every rank trains with. Not the forward or backward: the engine's step.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/config.h"
#include "loom/data.h"

namespace loom {

class Comm;
class PreparedJob;

// The training sampler's options: per_device_train_batch_size, [data] shuffle and drop_last,
// and [train] data_seed (the Trainer's: the data order's own seed; -1 = `seed`).
SamplerOptions sampler_options(const ConfigSection& train, const ConfigSection& data,
                               uint64_t seed, int rank, int world_size);

// [train] num_train_epochs as the Trainer counts it: optimizer steps per epoch = the rank's
// batches per epoch // gradient_accumulation_steps (at least 1), and max_steps = ceil(epochs x
// that); the job's schedule (warm-up ratio, decay) is made to span them. Returns max_steps and
// says the sum in the log.
int64_t count_steps_by_epochs(PreparedJob& job, const Sampler& sampler,
                              int64_t accumulation_steps);

// The epoch of the batch `data` gives next. The data position is of the next batch, and an
// epoch whose last batch was taken rolls over only when the next is drawn: {e, end of e} is the
// start of e + 1.
int64_t epoch_of_next_batch(const DataSource& data);

// One optimizer step's micro-batches, drawn before any forward so their loss targets can be
// counted first (see Note [Loss normalisation] in engine.cpp).
struct Window {
  std::vector<Batch> batches;  // as the source gave them (on the host, or moved by preload)
  int64_t local_targets = 0;   // this rank's loss targets
  int64_t targets = 0;         // every rank's (one all-reduce on several ranks)
  int64_t samples = 0, tokens = 0;  // this rank's
};
// `accumulation_steps` batches from `data`. Their counts are taken on the host where the batch
// is there; a source that moved it to the device counted it before (preload), else the models
// count on the device.
Window draw_window(DataSource& data, int64_t accumulation_steps, Comm& comm);

// Note [Auto batch size] (commands/estimate.cpp): with auto_find_batch_size each rank chose its
// batch alone; a rank that chose otherwise (another machine, another budget) would train with
// another batch than its peers. A ConfigError when the ranks differ; one all-reduce, every rank.
void check_same_batch_on_every_rank(const ConfigSection& train, int64_t accumulation_steps,
                                    Comm& comm);

}  // namespace loom
