// loom/estimate.h — `loom estimate`: the memory one rank needs for every ZeRO stage, offload
// choice and precision, by category, from a job's model (and a short probe of its activations)
// or from a parameter count alone (Note [Memory estimate]).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/memory_declarations.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::estimate {

// Note [Memory estimate]: each row is the sum of what the plugins declare (Note [Memory
// declarations] in loom/memory_declarations.h); with loom's plugins that is this anatomy.
// Model states follow the ZeRO paper's anatomy with loom's byte counts
// per trainable parameter: fp32 and bf16 (autocast) keep fp32 weights and gradients (4 + 4) and
// no masters; full_bf16 keeps bf16 weights and gradients (2 + 2) and fp32 masters (4); the update
// rule adds its state (AdamW 8; the job's own rule is measured from the state it makes). Stage 1
// divides masters and optimizer state by the world size (by [zero] shard_group_size where the
// job shards within groups of ranks), stage 2 the gradients too, stage 3 the
// weights too (the units' trainable tensors above stage3_param_persistence_threshold; the rest,
// frozen tensors included, stays whole on every rank), plus the units it
// gathers (one and the one prefetched); stage 0 over several ranks adds the gradient buckets
// (an fp32 copy of the gradients), and offloaded stages 1-3 the values chunk the all-gather
// sends (the weights' dtype, outside stage 3's shards). Offloading moves masters
// and optimizer state to host RAM (cpu) or NVMe (nvme; host RAM keeps buffer_count buffers of the
// largest tensor's share); with fp32 weights on a GPU the CPU updates an fp32 copy of them there
// (counted as masters), and stage 0's host store on a GPU keeps a host copy of the gradients and
// of the weights on their way back (Note [Overlapped update]). cpu+p and nvme+p (stage 3,
// offload_param) also move the units' weight shards there, the device keeping the weights
// outside units and two gathered units, and nvme+p's host RAM three shards in flight. On a CPU
// run "cpu" moves nothing (one memory), so cpu+p is stage 3's cpu row there. With [train]
// optimizer_in_backward the probes run the job without it and the zero plugin declares the gradient
// held: one group's chunk at stages 1-2, one tensor's on one process at stage 0, as before over
// ranks at stage 0 (stage 3 and offloads refuse it). Activations and the rest of the peak
// (workspace, data, autocast's half copies, the driver's buffers) are measured: the job runs two
// steps at per-device batches 2 and 3 (1 and 2 where the job's batch is below 3: Note [Probe
// batches]; the second step's peaks count) in each precision on one rank, and the forward +
// backward peak above the model states less the gradients released between steps (Note
// [Gradients released, not zeroed]) is split into a part per sample and a fixed part. With bf16 autocast the half copies
// are 2 B per parameter of the fixed part. fp16 and full_fp16 cost what bf16 and full_bf16 do.
enum class Precision { fp32, bf16, full_bf16 };
// cpu_params ("cpu+p") and nvme_params ("nvme+p"): the optimizer state and (stage 3,
// half-precision weights) the units' weight shards in host memory or on NVMe, [zero]
// offload_param (Note [Offloaded parameters]).
enum class Offload { none, cpu, nvme, cpu_params, nvme_params };
const char* to_string(Precision p);
const char* to_string(Offload o);

// What the model and its update rule hold, counted once. A job's report fills the unit and
// frozen counts from what its plugins declared (at the job's persistence threshold and
// frozen_weights); row() of bare counts passes reduce_bucket_bytes and shard_group_size to the
// zero plugin's variants (the exceptions in estimate.cpp's declarers), and a job's report leaves
// them at their defaults: its rows and job_row() read the job's own [zero] table.
struct ModelCounts {
  double params = 0, trainable = 0;
  double optimizer_per_trainable = 8;  // bytes of update-rule state per trainable parameter
  std::string rule = "adamw";
  // Stage 3 shards the units' trainable tensors above its persistence threshold (the rest,
  // frozen ones included, stay whole; with no model, as for a parameter count, all of it):
  double largest_unit_params = 0;    // one unit's: held gathered (twice: with prefetch)
  double unit_params = 0;            // all units': what stage 3 shards (and offload_param moves)
  double largest_tensor_params = 0;  // NVMe offload's buffers each hold this tensor's share
  // Each unit's trainable tensors' elements, where they are known: stage 3's unit counts at any
  // persistence threshold are then taken from them (MemoryContext::unit_params), and the two
  // counts above are ignored. Empty (a parameter count, a report's counts): the two counts
  // above stand at any threshold, the units' tensors taken as no smaller than it.
  std::vector<std::vector<double>> unit_tensors;
  // Frozen tensors held only as Linear weights/biases: 2 B, not 4, under autocast (Note [Frozen
  // weights in half]; 0 where the job sets [precision] frozen_weights = "fp32").
  double frozen_linear_params = 0;
  // [zero] reduce_bucket_size: stages 1-3 pack each bucket's gradients into an fp32 send buffer
  // during backward (Note [Gradient buckets in the peak] in plugins/zero/zero_memory.cpp).
  double reduce_bucket_bytes = 25.0 * (1 << 20);
  // [zero] shard_group_size: stages 1-3 shard over groups of this many ranks and replicate
  // across them (Note [Hybrid sharding] in loom/sharding/zero_driver.h), so the sharded terms
  // are divided by it; 0 (or the world size or more): by the world size.
  double shard_group_size = 0;
  // [train] optimizer_in_backward: each gradient is freed once it updated its parameter during
  // backward (MemoryContext::optimizer_in_backward); the probes run the step without it.
  bool optimizer_in_backward = false;
  // [optimizer] master_dtype = "bf16": full_bf16's weights are their own masters
  // (MemoryContext::bf16_masters).
  bool bf16_masters = false;
};

// Activations of one precision, measured by the probe.
struct Activations {
  bool measured = false;
  double per_sample = 0, fixed = 0;  // bytes
  double update = 0;                 // the update's peak above all model states
  double setup_peak = 0;             // building the model (before sharding), bytes
  bool proxied = false;              // measured on proxies of 1, 2 and 3 units (Note [Proxy probes])
  std::string note;                  // why not measured
};

struct Row {
  int stage = 0;
  Offload offload = Offload::none;
  Precision precision = Precision::fp32;
  // Bytes per rank, wherever they live.
  double weights = 0, grads = 0, masters = 0, optimizer = 0, activations = 0, buffers = 0;
  // Where: the compute device's memory (RAM on a CPU run), host RAM besides it, NVMe.
  double device = 0, host = 0, nvme = 0;
  // Building the model peaks apart from the step (a half-precision model is built in fp32
  // first); `peak` is the larger of the two on the device.
  double setup_peak = 0, update_extra = 0, peak = 0;
  bool activations_measured = false;
  bool buildable = true;  // loom runs this combination today
  double model_states() const { return weights + grads + masters + optimizer; }
};

struct Options {
  int world_size = 1;
  int64_t batch = 0;            // per-device batch of the activations (0: the job's)
  bool probe = true;            // run the probes (else model states only)
  double budget_bytes = 0;      // > 0: also the largest batch that fits (auto_find_batch_size)
  int buffer_count = 4;         // NVMe offload buffers
  bool job_precision_only = false;  // probe the job's own precision only (auto_find_batch_size)
  bool proxy = true;            // probe proxies of 1, 2 and 3 units where the model allows (Note
                                // [Proxy probes]); false: the whole model
};

struct Report {
  std::string job;  // empty for a parameter count alone
  std::string model_name, device;
  // The job's [train] device is CUDA and this machine has none: probed on the CPU, the rows
  // split as the GPU run's (Note [GPU jobs estimated on a CPU] in estimate.cpp).
  bool gpu_probed_on_cpu = false;
  ModelCounts model;
  Options options;
  int64_t batch = 0;            // per-device batch the activations are for
  int64_t effective_batch = 0;  // the job's samples per step on one rank (batch x accumulation)
  Activations activations[3];   // by Precision
  int job_stage = 0;
  Offload job_offload = Offload::none;
  bool job_offload_params_only = false;  // offload_param, the optimizer state in memory
  Precision job_precision = Precision::fp32;
  int64_t units = 0;            // the model's units (its UnitLists' children)
  bool uniform_units = true;    // each of them holds as many elements
  std::vector<Row> rows;        // stages 0-3 x offload x precision
  // What the job's plugins declared for the job's row (without the activations' samples), and
  // what they say about the job and the table's variants (see Note [Memory declarations]).
  memory::MemoryTerms job_terms;
  bool has_job_terms = false;
  std::vector<std::string> notes;        // in the first line ("sharded over groups of 2")
  std::vector<std::string> table_notes;  // under the table
  std::vector<std::string> legends;      // the variants' ("nvme+p: ...")
};

// One configuration's row (pure arithmetic: the tests hold it to the ZeRO paper's numbers).
Row row(const ModelCounts& model, int stage, Offload offload, Precision precision,
        int world_size, const Activations& activations, int64_t batch, bool cpu_device,
        int buffer_count = 4);

// The rows for `model`, every stage x offload x precision.
std::vector<Row> rows(const ModelCounts& model, const Activations activations[3], int world_size,
                      int64_t batch, bool cpu_device, int buffer_count = 4);

// A job: its model set up once on one rank (nothing written beside a temporary folder that is
// removed), then the probes. Throws ConfigError for a bad job, as `loom check` would.
Report estimate_job(const std::filesystem::path& job, const std::vector<std::string>& overrides,
                    const Options& options);
// A parameter count alone (DeepSpeed's estimate_zero*_model_states_mem_needs): AdamW, model
// states only, every parameter trainable.
Report estimate_params(double params, const Options& options);

// The job's own row at a per-device batch of `batch` samples.
Row job_row(const Report& report, int64_t batch);

// The largest per-device batch whose estimated peak in `r`'s job configuration fits
// `budget_bytes`; 0 if none does.
int64_t largest_batch(const Report& r, double budget_bytes);

// A per-device batch and accumulation that keep a job's samples per step and rank
// (`effective`) exact with at most `fits` samples per micro-batch: the largest multiple of 8
// (the seed guide's advice) dividing `effective`, else its largest divisor; {0, 0} if fits < 1.
struct BatchPlan {
  int64_t batch = 0, accumulation = 0;
};
BatchPlan plan_batch(int64_t effective, int64_t fits);

// "20GiB", "512MB", "1e9": bytes (KiB/MiB/GiB/TiB binary, KB/MB/GB/TB decimal); a
// ConfigError naming `what` for anything else, or a size that is not positive.
double parse_size(const std::string& what, const std::string& text);

// The table `loom estimate` prints.
std::string format(const Report& report);

}  // namespace loom::estimate

#pragma GCC visibility pop
