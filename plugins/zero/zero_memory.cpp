// What one rank of a [zero] job holds, declared for `loom estimate` (zero_memory.h).
#include "zero_memory.h"

#include <algorithm>
#include <string>

#include "loom/memory.h"

namespace loom::zero {
namespace {

// `key`'s device ("none", "cpu", "nvme"): an offload table's, or "none" where there is none.
// Only the device matters here; configure() checks the rest when the job runs.
std::string offload_device(const ConfigSection& table, const char* key) {
  const ConfigValue* offload = table.get(key);
  const ConfigValue* device = offload && offload->is_table() ? offload->find("device") : nullptr;
  const auto* text = device ? std::get_if<std::string>(&device->value) : nullptr;
  return text ? *text : "none";
}

ConfigValue table_of(const std::string& device) {
  ConfigValue value;
  ConfigValue text;
  text.value = device;
  value.value = ConfigTable{{"device", text}};
  return value;
}

}  // namespace

std::vector<memory::MemoryVariant> memory_variants() {
  std::vector<memory::MemoryVariant> out;
  for (int64_t stage = 0; stage <= 3; ++stage)
    for (const char* offload : {"none", "cpu", "nvme", "cpu+p", "nvme+p"}) {
      // offload_param exists for stage 3 only; its rows move the optimizer state to the same
      // device as the weight shards (ZeRO-Infinity's usual pairing).
      const std::string label = offload;
      const bool params = label == "cpu+p" || label == "nvme+p";
      if (params && stage != 3) continue;
      const std::string device = params ? label.substr(0, label.size() - 2) : label;
      memory::MemoryVariant v;
      v.labels = {{"stage", std::to_string(stage)}, {"offload", label}};
      ConfigValue s;
      s.value = stage;
      v.overrides = {{"stage", s},
                     {"offload_optimizer", table_of(device)},
                     {"offload_param", table_of(params ? device : "none")}};
      // Stage 0 shards nothing, so it takes no shard groups (configure() refuses them): the
      // stage-0 variants run, as the estimate's probes (the first variant: the unsharded
      // layout in memory) whatever the job's group size; the stages' arithmetic does not
      // read it at stage 0.
      if (stage == 0) {
        ConfigValue none;
        none.value = int64_t{0};
        v.overrides.emplace_back("shard_group_size", none);
      }
      // sharded_init exists at stage 3 only (configure() refuses it set true below): a job
      // that sets it still has its stage 0-2 variants (the probes among them).
      if (stage < 3) {
        ConfigValue off;
        off.value = false;
        v.overrides.emplace_back("sharded_init", off);
      }
      if (label == "cpu+p")
        v.legend = "cpu+p: offload_param too, the units' weight shards in page-locked host "
                   "memory beside the optimizer state, fetched to the GPU a unit ahead (stage 3, "
                   "full_bf16; on a CPU run the weights are in host memory already: the row is "
                   "stage 3's cpu row)";
      if (label == "nvme+p")
        v.legend = "nvme+p: offload_param too, the units' weight shards on NVMe (stage 3, "
                   "full_bf16)";
      out.push_back(std::move(v));
    }
  return out;
}

// Note [Memory estimate] (app/loom/estimate.h) gives the anatomy; here is its ZeRO part. The
// terms arrive as the precision left them: every weight whole in its dtype (`weights`), fp32 or
// half bytes per element, the rule's state over every trainable element.
void declare_memory(const ConfigSection& t, const memory::MemoryContext& c,
                    memory::MemoryTerms& r) {
  const int stage = static_cast<int>(t.get_int("stage"));
  const std::string optimizer_device = offload_device(t, "offload_optimizer");
  const std::string param_device = offload_device(t, "offload_param");
  const bool offload_params = param_device == "nvme" || param_device == "cpu";
  // The row is named by where the weight shards go ("cpu+p", "nvme+p"), and the table's row
  // moves the optimizer state there too; a job that keeps its state elsewhere is told how its
  // own numbers differ.
  const std::string offload = offload_params ? param_device + "+p" : optimizer_device;
  r.labels["stage"] = std::to_string(stage);
  r.labels["offload"] = offload;
  if (offload_params && optimizer_device == "none") {
    r.labels["optimizer_state"] = "memory";
    r.table_notes.push_back("this job offloads the weight shards but keeps the optimizer state "
                            "in memory: its device memory is the " + offload + " row's plus "
                            "that row's masters and optimizer state");
  } else if (offload_params && optimizer_device != param_device) {
    r.table_notes.push_back("this job offloads the weight shards to " + param_device +
                            " and the optimizer state to " + optimizer_device + ": the " +
                            offload + " row counts the masters and optimizer state on " +
                            param_device + " too");
  }
  // Note [ZeRO without masters] (loom/sharding/zero_driver.h) and Note [Offloaded without
  // masters] (loom/offload/offloaded_driver.h): every stage keeps none (m is 0 here, as for
  // fp32 weights), offloaded or not, offload_param too (its row offloads the state as well,
  // whose walk updates the shards where they live).
  const bool own_masters = c.bf16_masters && r.labels["precision"] == "full_bf16";
  // offload_param drops the half-precision weight shards from memory (the fp32 masters, or the
  // shards themselves without masters, are the truth): with fp32 weights nothing could go.
  if (offload_params && (stage != 3 || (r.master_bytes <= 0 && !own_masters))) {
    r.applicable = false;
    return;
  }
  int buffer_count = c.buffer_count;
  if (const ConfigValue* o = t.get("offload_optimizer"); o && o->is_table())
    if (const ConfigValue* n = o->find("buffer_count"))
      if (const auto* count = std::get_if<int64_t>(&n->value)) buffer_count = static_cast<int>(*count);

  // Stages 1-3 shard over N ranks: the world, or the job's shard group (Note [Hybrid sharding]
  // in loom/sharding/zero_driver.h: replicated across the groups, so nothing more is saved).
  const double world = std::max(c.world_size, 1);
  const double group = static_cast<double>(t.get_int("shard_group_size"));
  const double N = group >= 1 ? std::min(group, world) : world;
  const double w = r.weight_bytes, m = r.master_bytes, k = c.optimizer_per_trainable;
  // Stage 3 shards a unit's trainable tensors of at least stage3_param_persistence_threshold
  // elements; smaller ones stay whole like the parameters outside units, and so do frozen ones
  // (the driver holds only what trains: a LoRA job's base stays whole on every rank).
  const double threshold = t.get_float("stage3_param_persistence_threshold");
  const double unit_params = c.unit_params ? c.unit_params(threshold, false) : 0;
  const double largest_unit = c.unit_params ? c.unit_params(threshold, true) : 0;
  r.unit_params = unit_params;
  r.largest_unit_params = largest_unit;

  // Note [ZeRO's model states] (loom/memory.h): the trainable elements by the one formula the
  // plugin checks its measured state against; what does not train stays as it was.
  const memory::ZeroModelStates z =
      memory::zero_model_states(stage, N, c.trainable, unit_params, w, m, k);
  const double whole_weights = r.weights;  // every weight, before any sharding
  r.weights = whole_weights - c.trainable * w + z.weights;
  // Stage 1's whole gradient: held between the micro-steps of an accumulation window; with
  // none, each .grad goes once packed (Note [Stage 1's gradient once packed]) and the run peaks
  // lower than this counts.
  r.grads = z.grads;
  // Every stage releases its gradients (stages 2-3 their shards) between steps: Note
  // [Gradients released, not zeroed]; MemoryTerms::grads_released stays true.
  r.masters = z.masters;
  r.optimizer = z.optimizer;
  // Stage 3 gathers two units whole (the one computing, the next one prefetched).
  if (stage >= 3 && N > 1) r.weights += 2 * largest_unit * w;
  if (c.optimizer_in_backward) {
    // See Note [Optimizer in backward] (core/src/optimizer_in_backward.h): the zero plugin
    // refuses it at stage 3 and with any offload (validate()), so those rows are not built.
    if (stage >= 3 || optimizer_device != "none" || param_device != "none") {
      r.buildable = false;
    } else if (stage >= 1) {
      // See Note [Updating chunks in backward]: each group's gradient chunk lives from its
      // landing to its update, then goes, and stage 1's whole .grad goes once packed. What is
      // left at the peak is one group's chunk (groups are reduce_bucket_size of fp32 gradients,
      // or one larger tensor). With one group (the whole model) stage 2 saves nothing: the chunk
      // lands after backward and lives through its update, as in the normal step.
      const double group_elements = std::min(
          c.trainable, std::max(t.get_float("reduce_bucket_size") / 4, c.largest_tensor_params));
      r.grads = group_elements / N * r.grad_bytes;
    } else if (c.world_size <= 1) {
      // One process: each parameter's .grad goes once its update ran, in backward.
      r.grads = std::min(c.trainable, c.largest_tensor_params) * r.grad_bytes;
    }
    // Stage 0 over ranks: each averaged gradient is handed over bucket by bucket after
    // backward, when every .grad and every bucket are still held: nothing is saved at the peak.
  }

  // Where the optimizer state and the weight shards go. "cpu" on a CPU run moves nothing: the
  // compute device's memory is host memory already (the zero plugin says so when it runs).
  const bool state_to_host = optimizer_device == "cpu" && !c.cpu_device;
  const bool state_offloaded = optimizer_device == "nvme" || state_to_host;
  const bool shards_move = param_device == "nvme" || (param_device == "cpu" && !c.cpu_device);
  // Stage 0 over ranks: the gradient buckets the all-reduce runs on, an fp32 copy of the
  // gradients (one rank has none; the probes run on one).
  if (stage == 0 && c.world_size > 1) r.buffers += c.trainable * 4;
  // Note [Gradient buckets in the peak]: at stages 1-3 the driver packs each bucket's gradients
  // into an fp32 send buffer as backward makes them, on one rank too; the first bucket fills
  // while the activations are near their peak (the probes, at stage 0 on one rank, have none).
  // Stages 1-2 bucket the whole model, stage 3 a unit at a time. Measured on a 0.36 M-parameter
  // GPT at batch 12 in full_bf16: +1.40 MiB at stages 1-2, +0.55 MiB at stage 3, none with
  // 100 kB buckets.
  if (stage >= 1) {
    const double bucketed = stage >= 3 ? largest_unit : c.trainable;
    r.buffers += std::min(bucketed * 4, t.get_float("reduce_bucket_size"));
  }
  if (state_offloaded && stage >= 1 && m > 0) {
    // Note [Offloaded ZeRO]: what the all-gather sends stays in memory in the weights' dtype;
    // for the groups stage 3 does not shard (all of them below stage 3) that is a values chunk
    // beside the weights. The host store (Note [Host store]) keeps it as the swap file does.
    r.buffers += (stage == 3 ? c.trainable - unit_params : c.trainable) * w / N;
  }
  if (state_offloaded && m <= 0 && !own_masters && !c.cpu_device) {
    // fp32 weights on a GPU: the CPU updates a copy of them where the state lives (a CPU run
    // updates its fp32 weights in place), an fp32 master in all but name.
    r.masters += (stage >= 1 ? c.trainable / N : c.trainable) * 4;
  }
  if (state_offloaded) {
    const double state = r.masters + r.optimizer;
    if (optimizer_device == "nvme") {
      r.to_nvme += state;
      // Each buffer holds the largest tensor's share: its fp32 master and its state (the state
      // alone without masters).
      double share = c.largest_tensor_params * ((own_masters ? 0 : 4) + k);
      if (stage >= 1) share /= N;
      r.host_buffers += buffer_count * share;
    } else {
      r.to_host += state;
    }
  }
  if (state_to_host && stage == 0) {
    // Note [Overlapped update] and Note [Delayed update] (loom/offload/offloaded_driver.h): the
    // unsharded host store lands each gradient in a host copy and stages each updated weight
    // for its way back to the GPU (without masters, its way to the host first); the delayed
    // update keeps a copy of each (its gradients and its new weights), all in the weights'
    // dtype (unless overlap_update = false without the delayed update: then the update reads
    // the gradients after backward).
    const ConfigValue* o = t.get("offload_optimizer");
    auto flag = [o](const char* key, bool otherwise) {
      const ConfigValue* v = o && o->is_table() ? o->find(key) : nullptr;
      const auto* b = v ? std::get_if<bool>(&v->value) : nullptr;
      return b ? *b : otherwise;
    };
    if (flag("delayed_update", false) || flag("overlap_update", true))
      r.host_buffers += 2 * c.trainable * w;
  }
  if (shards_move) {
    // Note [Offloaded parameters]: the units' shards live in the file or the host arena between
    // uses; the device keeps the weights outside units whole and two units gathered (the one
    // computing, and the next, whose shard is fetched while it computes). "nvme" adds three
    // shards in flight in host buffers (one read ahead, two being written); "cpu" copies
    // straight from and into the arena (page-locked on a GPU).
    const double shards = unit_params / N * w;
    r.weights = whole_weights - unit_params * w + 2 * largest_unit * w + shards;
    if (param_device == "nvme") {
      r.to_nvme += shards;
      r.host_buffers += 3 * largest_unit / N * w;
    } else {
      r.to_host += shards;
    }
  }
  if (group >= 1 && group < world)
    r.notes.push_back("stages 1-3 sharded over groups of " +
                      std::to_string(static_cast<int64_t>(group)) + ", [zero] shard_group_size");
}

}  // namespace loom::zero
