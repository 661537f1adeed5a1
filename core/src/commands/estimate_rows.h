// estimate_rows.h (core-internal) — the rows of `loom estimate` as sums of what plugins declare
// (Note [Memory declarations] in loom/memory_declarations.h): which plugins declare and from
// which tables, every combination of their variants, and the terms summed into a Row. No
// probing (estimate.cpp measures) and no printing.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "loom/estimate.h"
#include "loom/memory_declarations.h"
#include "plugin_host.h"
#include "resolve.h"

namespace loom::estimate {

inline constexpr Precision kPrecisions[] = {Precision::fp32, Precision::bf16,
                                            Precision::full_bf16};
inline constexpr Offload kOffloads[] = {Offload::none, Offload::cpu, Offload::nvme,
                                        Offload::cpu_params, Offload::nvme_params};

// The core's part of Note [Memory declarations] (loom/memory_declarations.h): the plugins that
// declare, in Note [Plugin order] — the job's active ones and, whether or not the job has their
// table, those offering variants (the what-if table's axes) — each with the table it declares
// from: the job's, or its schema's defaults. The core names no technique's table or key; the
// exceptions, each for a reason:
// - the table's columns are the labels "stage", "offload" and "precision" (Row, and the API
//   the tests and auto_find_batch_size call with ZeRO's stages: DeepSpeed's table), and the
//   label "optimizer_state" = "memory" sets Report::job_offload_params_only;
// - the probes measure activations per "precision" label (the three of Report::activations);
// - row() of bare ModelCounts (no job: tests, --params) passes its shard_group_size and
//   reduce_bucket_bytes to the variant labelled "stage" as [zero]'s keys.
struct Declarer {
  LoadedPlugin* plugin = nullptr;
  ConfigSection table;
  std::vector<memory::MemoryVariant> variants;  // empty: not an axis of the table
  bool in_job = false;
};
using Declarers = std::vector<Declarer>;

// The declarers of `job` (loading every plugin on `host`'s search path to find the axes), or
// with no job every axis plugin with its schema's defaults. `file` names the job in messages.
Declarers declarers(PluginHost& host, const ResolvedJob* job, const std::string& file);

// Which table each declarer declares from: the index of one of its variants, or -1 for its own
// table (a plugin outside the job then declares nothing).
using Choice = std::vector<int>;

// The terms of one configuration: the core's plain run (`fixed_buffers`: the probes' fixed
// part), then every declarer in order.
memory::MemoryTerms declare(const Declarers& all, const Choice& choice,
                            const memory::MemoryContext& context, double fixed_buffers);

// A column's label, `otherwise` where no plugin set it; the stage column's as a number; the
// index of the precision column's label in kPrecisions (0 where none).
std::string label(const memory::MemoryTerms& terms, const std::string& column,
                  const std::string& otherwise);
int stage_label(const memory::MemoryTerms& terms);
int precision_index(const memory::MemoryTerms& terms);

// The terms summed into a row: what the plugins moved leaves the device, the activations of
// `batch` samples join it.
Row finish(const memory::MemoryTerms& terms, const Activations& activations, int64_t batch,
           bool cpu_device);

// Every combination of the axes' variants, the first axis varying fastest (so the last in
// Note [Plugin order], zero after precision, orders the table), with each one's terms.
struct Combination {
  Choice choice;
  memory::MemoryTerms terms;
};
std::vector<Combination> combinations(const Declarers& all, const memory::MemoryContext& context,
                                      const Activations activations[3]);

// The choice of the variants whose labels agree with `want` (-1 for plugins of no axis).
Choice choice_for(const Declarers& all, const std::map<std::string, std::string>& want);

// The context of counts: its unit_params(threshold) counts the units' tensors of at least the
// threshold where ModelCounts::unit_tensors knows them, else (bare counts: a parameter count, a
// report's counts, taken at the job's threshold) the counts' own; and of a probed model whose
// units' trainable tensors are `units`.
memory::MemoryContext context_of(const ModelCounts& m, int world_size, bool cpu_device,
                                 int buffer_count);
memory::MemoryContext context_with_units(const ModelCounts& m,
                                         const std::vector<std::vector<double>>& units,
                                         int world_size, bool cpu_device, int buffer_count);

// The declarers with no job, ModelCounts' [zero] settings over the variant labelled "stage".
Declarers standalone_for(const ModelCounts& m);

// The legends of the variants the table shows, once each.
std::vector<std::string> legends(const Declarers& all, const std::vector<Combination>& table);

}  // namespace loom::estimate
