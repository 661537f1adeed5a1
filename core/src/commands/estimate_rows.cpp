// The rows of `loom estimate` from the plugins' memory declarations (estimate_rows.h).
#include "estimate_rows.h"

#include <algorithm>
#include <cstdlib>
#include <set>

#include "loom/error.h"

namespace loom::estimate {
namespace {

Schema own_schema(const Plugin& plugin) {
  for (const auto& schema : plugin.schemas())
    if (schema.table() == plugin.name() && schema.provider().empty()) return schema;
  return Schema(plugin.name());
}

// `table` with a variant's keys over it; a table value is merged key by key (a variant's
// offload device keeps the job's buffer_count).
ConfigSection with_overrides(const ConfigSection& table, const ConfigTable& overrides) {
  ConfigTable values = table.values();
  for (const auto& [key, value] : overrides) {
    auto at = std::find_if(values.begin(), values.end(),
                           [&key = key](const auto& kv) { return kv.first == key; });
    if (at == values.end()) {
      values.emplace_back(key, value);
    } else if (at->second.is_table() && value.is_table()) {
      for (const auto& [k, v] : std::get<ConfigTable>(value.value)) {
        auto& inner = std::get<ConfigTable>(at->second.value);
        auto hit = std::find_if(inner.begin(), inner.end(),
                                [&k = k](const auto& kv) { return kv.first == k; });
        if (hit == inner.end())
          inner.emplace_back(k, v);
        else
          hit->second = v;
      }
    } else {
      at->second = value;
    }
  }
  return ConfigSection(table.name(), std::move(values), table.schema(), "");
}

// The declared terms of one configuration, twice where the probes measured its precision: the
// first pass says which precision it is, the second declares over its measured fixed part.
memory::MemoryTerms declare_measured(const Declarers& all, const Choice& choice,
                                     memory::MemoryContext context,
                                     const Activations activations[3]) {
  memory::MemoryTerms terms = declare(all, choice, context, 0);
  const Activations& a = activations[precision_index(terms)];
  if (!a.measured) return terms;
  context.activations_measured = true;
  return declare(all, choice, context, a.fixed);
}

// The declarers of a configuration with no job (every plugin's defaults), loaded once.
const Declarers& standalone_declarers() {
  static PluginHost* host = new PluginHost;  // never freed: its plugins stay loaded
  static const Declarers all = declarers(*host, nullptr, "loom estimate");
  return all;
}

}  // namespace



Declarers declarers(PluginHost& host, const ResolvedJob* job, const std::string& file) {
  host.load_all();  // a plugin that does not load offers nothing: `loom plugins` reports it
  ResolvedJob all = job ? *job : ResolvedJob{};
  std::set<LoadedPlugin*> in_job;
  if (job) in_job.insert(job->active.begin(), job->active.end());
  for (const auto& loaded : host.plugins())
    if (!in_job.count(loaded.get()) && !loaded->plugin->memory_variants().empty())
      all.table_plugins.push_back(loaded.get());
  Declarers out;
  for (LoadedPlugin* plugin : order_plugins(all, host, file)) {
    Declarer d;
    d.plugin = plugin;
    d.variants = plugin->plugin->memory_variants();
    d.in_job = in_job.count(plugin) > 0;
    const std::string& name = plugin->plugin->name();
    if (job && plugin == job->model.provider) {
      d.table = job->section("model");
    } else if (job && plugin == job->data.provider) {
      d.table = job->section("data");
    } else if (job && plugin == job->update_rule.provider) {
      d.table = job->section("optimizer");
    } else if (job && job->sections.count(name)) {
      d.table = job->section(name);
    } else {
      d.table = ConfigSection(name, {}, own_schema(*plugin->plugin), file);
    }
    out.push_back(std::move(d));
  }
  return out;
}

memory::MemoryTerms declare(const Declarers& all, const Choice& choice,
                            const memory::MemoryContext& context, double fixed_buffers) {
  memory::MemoryTerms terms;  // the plain run: fp32 weights and gradients, no masters
  terms.weights = context.params * terms.weight_bytes;
  terms.grads = context.trainable * terms.grad_bytes;
  terms.optimizer = context.trainable * context.optimizer_per_trainable;
  terms.buffers = fixed_buffers;
  for (size_t i = 0; i < all.size(); ++i) {
    const Declarer& d = all[i];
    if (choice[i] < 0 && !d.in_job) continue;
    if (choice[i] < 0) {
      d.plugin->plugin->declare_memory(d.table, context, terms);
    } else {
      d.plugin->plugin->declare_memory(with_overrides(d.table, d.variants[choice[i]].overrides),
                                       context, terms);
    }
  }
  return terms;
}

std::string label(const memory::MemoryTerms& terms, const std::string& column,
                  const std::string& otherwise) {
  const auto at = terms.labels.find(column);
  return at == terms.labels.end() ? otherwise : at->second;
}

int stage_label(const memory::MemoryTerms& terms) {
  const std::string text = label(terms, "stage", "0");
  char* end = nullptr;
  const long stage = std::strtol(text.c_str(), &end, 10);
  LOOM_CHECK(!text.empty() && *end == '\0', "a plugin's memory declaration labels the stage '",
             text, "'; loom estimate's stage column takes a number");
  return static_cast<int>(stage);
}

int precision_index(const memory::MemoryTerms& terms) {
  const std::string name = label(terms, "precision", "fp32");
  for (int i = 0; i < 3; ++i)
    if (name == to_string(kPrecisions[i])) return i;
  return 0;
}

Row finish(const memory::MemoryTerms& t, const Activations& activations, int64_t batch,
           bool cpu_device) {
  Row r;
  r.stage = stage_label(t);
  const std::string offload = label(t, "offload", "none");
  for (Offload o : kOffloads)
    if (offload == to_string(o)) r.offload = o;
  r.precision = kPrecisions[precision_index(t)];
  r.weights = t.weights;
  r.grads = t.grads;
  r.masters = t.masters;
  r.optimizer = t.optimizer;
  r.buffers = t.buffers;
  r.activations_measured = activations.measured;
  if (activations.measured) {
    r.activations = activations.per_sample * static_cast<double>(batch);
    r.setup_peak = activations.setup_peak;
    r.update_extra = activations.update;
  }
  // Gradients the driver releases between steps are not there in forward; backward makes them
  // as it frees activations, and the probes' activations count those made by the peak
  // (MemoryTerms::grads_released). The update holds them all.
  const double released = t.grads_released && activations.measured ? r.grads : 0.0;
  r.device = r.model_states() - released + r.activations + r.buffers - t.to_host - t.to_nvme;
  r.host = t.to_host + t.host_buffers;
  r.nvme = t.to_nvme;
  if (cpu_device) {  // one memory: the host column folds into the device's
    r.device += r.host;
    r.host = 0;
  }
  // The update runs after the activations are freed: its own extra (the rule's temporaries,
  // half weights written back) over the model states on the device.
  r.peak = std::max(
      {r.device, r.device + released - r.activations - r.buffers + r.update_extra, r.setup_peak});
  r.buildable = t.buildable;
  return r;
}

std::vector<Combination> combinations(const Declarers& all, const memory::MemoryContext& context,
                                      const Activations activations[3]) {
  std::vector<size_t> axes;
  for (size_t i = 0; i < all.size(); ++i)
    if (!all[i].variants.empty()) axes.push_back(i);
  Choice choice(all.size(), -1);
  for (size_t axis : axes) choice[axis] = 0;
  std::vector<Combination> out;
  while (true) {
    memory::MemoryTerms terms = declare_measured(all, choice, context, activations);
    if (terms.applicable) out.push_back({choice, std::move(terms)});
    size_t a = 0;
    for (; a < axes.size(); ++a) {
      if (++choice[axes[a]] < static_cast<int>(all[axes[a]].variants.size())) break;
      choice[axes[a]] = 0;
    }
    if (a == axes.size()) break;
  }
  return out;
}

Choice choice_for(const Declarers& all, const std::map<std::string, std::string>& want) {
  Choice choice(all.size(), -1);
  for (size_t i = 0; i < all.size(); ++i)
    for (size_t v = 0; v < all[i].variants.size() && choice[i] < 0; ++v) {
      bool agrees = true;
      for (const auto& [column, value] : all[i].variants[v].labels) {
        const auto at = want.find(column);
        agrees = agrees && (at == want.end() || at->second == value);
      }
      if (agrees) choice[i] = static_cast<int>(v);
    }
  return choice;
}

memory::MemoryContext context_of(const ModelCounts& m, int world_size, bool cpu_device,
                                 int buffer_count) {
  memory::MemoryContext c;
  c.params = m.params;
  c.trainable = m.trainable;
  c.optimizer_per_trainable = m.optimizer_per_trainable;
  c.largest_tensor_params = m.largest_tensor_params;
  c.frozen_linear_params = m.frozen_linear_params;
  // Stage 3 shards a unit's trainable tensors of at least the threshold (unit_group_params in
  // loom/sharding/sharded_init.h): counted from the units' tensors where they are known.
  if (!m.unit_tensors.empty()) {
    c.unit_params = [units = m.unit_tensors](double min_elements, bool largest_unit) {
      double all = 0, largest = 0;
      for (const auto& unit : units) {
        double n = 0;
        for (double elements : unit)
          if (elements >= min_elements) n += elements;
        all += n;
        largest = std::max(largest, n);
      }
      return largest_unit ? largest : all;
    };
  } else {
    // Bare counts: no tensor is known to fall below any threshold (ModelCounts::unit_tensors).
    c.unit_params = [unit = m.unit_params, largest = m.largest_unit_params](double, bool one) {
      return one ? largest : unit;
    };
  }
  c.world_size = world_size;
  c.cpu_device = cpu_device;
  c.buffer_count = buffer_count;
  c.optimizer_in_backward = m.optimizer_in_backward;
  c.bf16_masters = m.bf16_masters;
  return c;
}

// The exception the Note in estimate_rows.h names: ModelCounts' [zero] settings, as keys.
Declarers standalone_for(const ModelCounts& m) {
  Declarers all = standalone_declarers();
  for (auto& d : all)
    for (auto& v : d.variants)
      if (v.labels.count("stage")) {
        ConfigValue group, bucket;
        group.value = static_cast<int64_t>(m.shard_group_size);
        bucket.value = m.reduce_bucket_bytes;
        v.overrides.emplace_back("shard_group_size", group);
        v.overrides.emplace_back("reduce_bucket_size", bucket);
      }
  return all;
}

memory::MemoryContext context_with_units(const ModelCounts& m,
                                         const std::vector<std::vector<double>>& units,
                                         int world_size, bool cpu_device, int buffer_count) {
  ModelCounts with = m;
  with.unit_tensors = units;
  return context_of(with, world_size, cpu_device, buffer_count);
}

std::vector<std::string> legends(const Declarers& all, const std::vector<Combination>& table) {
  std::vector<std::string> out;
  for (const Combination& c : table)
    for (size_t i = 0; i < all.size(); ++i)
      if (c.choice[i] >= 0) {
        const std::string& legend = all[i].variants[c.choice[i]].legend;
        if (!legend.empty() && std::find(out.begin(), out.end(), legend) == out.end())
          out.push_back(legend);
      }
  return out;
}

Row row(const ModelCounts& m, int stage, Offload offload, Precision precision, int world_size,
        const Activations& activations, int64_t batch, bool cpu_device, int buffer_count) {
  const Declarers all = standalone_for(m);
  const Choice choice = choice_for(all, {{"stage", std::to_string(stage)},
                                         {"offload", to_string(offload)},
                                         {"precision", to_string(precision)}});
  Activations by_precision[3];
  by_precision[static_cast<int>(precision)] = activations;
  const memory::MemoryTerms terms = declare_measured(
      all, choice, context_of(m, world_size, cpu_device, buffer_count), by_precision);
  return finish(terms, activations, batch, cpu_device);
}

std::vector<Row> rows(const ModelCounts& model, const Activations activations[3], int world_size,
                      int64_t batch, bool cpu_device, int buffer_count) {
  std::vector<Row> out;
  for (const Combination& c : combinations(standalone_for(model),
                                           context_of(model, world_size, cpu_device, buffer_count),
                                           activations))
    out.push_back(finish(c.terms, activations[precision_index(c.terms)], batch, cpu_device));
  return out;
}

}  // namespace loom::estimate
