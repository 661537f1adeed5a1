// Job resolution: schemas, providers, slots. Every error names the file:line of the value and
// says what to change.
#include "resolve.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "loom/log.h"
#include "loom/trainer.h"

namespace loom {
namespace {

const char* kSelectorKey(const std::string& table) {
  if (table == "data") return "source";
  if (table == "optimizer") return "name";
  return nullptr;
}

Slot slot_of_selector(const std::string& table) {
  if (table == "model") return Slot::model;
  if (table == "data") return Slot::data;
  return Slot::update_rule;
}

bool type_matches(ValueType want, const ConfigValue& value) {
  const ValueType got = value.type();
  if (want == ValueType::Any) return true;
  if (want == ValueType::Float) return got == ValueType::Float || got == ValueType::Int;
  if (want == ValueType::Int && got == ValueType::Float) {
    // A whole number written as a float (max_steps = 1e3) is the integer it names.
    const double d = std::get<double>(value.value);
    return std::isfinite(d) && std::floor(d) == d && std::abs(d) < 9.007199254740992e15;
  }
  return want == got;
}

std::string hint(const std::string& word, const std::vector<std::string>& candidates) {
  auto best = closest_match(word, candidates);
  return best ? "; did you mean '" + *best + "'?" : "";
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out.empty() ? "(none)" : out;
}

// Providers of a selector table's choice among the loaded plugins.
std::vector<LoadedPlugin*> providers_of(PluginHost& host, const std::string& table,
                                        const std::string& choice) {
  std::vector<LoadedPlugin*> found;
  for (const auto& record : host.plugins())
    for (const auto& schema : record->plugin->schemas())
      if (schema.table() == table && schema.provider() == choice) found.push_back(record.get());
  return found;
}

std::vector<std::string> choices_of(PluginHost& host, const std::string& table) {
  std::vector<std::string> names;
  for (const auto& record : host.plugins())
    for (const auto& schema : record->plugin->schemas())
      if (schema.table() == table && !schema.provider().empty())
        names.push_back(schema.provider());
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

const Schema& schema_for(LoadedPlugin& plugin, const std::string& table,
                         const std::string& provider, std::vector<Schema>& storage) {
  storage = plugin.plugin->schemas();
  for (const auto& schema : storage)
    if (schema.table() == table && schema.provider() == provider) return schema;
  throw InternalError("schema vanished for " + table + "/" + provider);
}

ResolvedJob::Choice choose(PluginHost& host, const std::string& table, const std::string& choice,
                           const std::string& where, const std::string& what) {
  auto found = providers_of(host, table, choice);
  if (found.empty()) {
    // A plugin file named after the choice, then every plugin on the path.
    host.find(choice);  // a broken file of that name is an error of its own (PluginError)
    found = providers_of(host, table, choice);
    if (found.empty()) {
      auto failures = host.load_all();
      found = providers_of(host, table, choice);
      if (found.empty()) {
        auto known = choices_of(host, table);
        std::string note;
        if (!failures.empty()) note = " (plugins that failed to load: " + failures.front() + ")";
        throw ConfigError(detail::cat(where, ": no plugin provides ", what, " '", choice, "'",
                                      hint(choice, known), " Available: ", joined(known),
                                      note, ". `loom plugins` lists what was found."));
      }
    }
  }
  if (found.size() > 1) {
    std::string names;
    for (auto* p : found) names += " " + (p->builtin() ? "core" : p->file.string());
    throw ConfigError(detail::cat(where, ": ", what, " '", choice,
                                  "' is provided by several plugins:", names,
                                  "; remove all but one from the plugin search path"));
  }
  return {found.front(), choice};
}

Schema merged(const Schema& common, const Schema& provider_schema) {
  Schema out(common.table(), provider_schema.provider());
  for (const auto& key : common.keys()) out.add(key);
  for (const auto& key : provider_schema.keys()) out.add(key);
  return out;
}


// The slots (roles) an active plugin fills in this job: a provider's selector slot, a table
// plugin's own.
std::vector<Slot> roles_of(const ResolvedJob& job, LoadedPlugin* plugin) {
  std::vector<Slot> roles;
  if (job.model.provider == plugin) roles.push_back(Slot::model);
  if (job.data.provider == plugin) roles.push_back(Slot::data);
  if (job.update_rule.provider == plugin) roles.push_back(Slot::update_rule);
  if (std::find(job.table_plugins.begin(), job.table_plugins.end(), plugin) !=
      job.table_plugins.end())
    for (Slot slot : plugin->plugin->slots()) roles.push_back(slot);
  return roles;
}

}  // namespace

// Note [Plugin order] (loom/plugin.h): a topological sort of the active plugins by their
// declared constraints; among plugins free to go, the one first in the job's order goes first
// (the providers of model, data and update rule, then the tables by name). "*" is weaker
// than a name: it orders a plugin against every plugin that no name orders against it and
// that does not say "*" the same way (two "first" plugins must name each other).
std::vector<LoadedPlugin*> order_plugins(const ResolvedJob& job, PluginHost& host,
                                         const std::string& file) {
  std::vector<LoadedPlugin*> nodes;
  {
    std::vector<LoadedPlugin*> base = {job.model.provider, job.data.provider,
                                       job.update_rule.provider};
    base.insert(base.end(), job.table_plugins.begin(), job.table_plugins.end());
    std::set<LoadedPlugin*> seen;
    for (auto* p : base)
      if (p && seen.insert(p).second) nodes.push_back(p);
  }
  const size_t n = nodes.size();
  std::vector<Plugin::Order> orders(n);
  std::vector<std::vector<Slot>> roles(n);
  for (size_t i = 0; i < n; ++i) {
    orders[i] = nodes[i]->plugin->order();
    roles[i] = roles_of(job, nodes[i]);
  }
  auto matches = [&](size_t i, const std::string& name) {
    if (nodes[i]->name == name) return true;
    for (Slot slot : roles[i])
      if (name == to_string(slot)) return true;
    return false;
  };
  auto is_role = [](const std::string& name) {
    for (Slot slot : {Slot::model, Slot::data, Slot::precision, Slot::update_rule,
                      Slot::grad_sync, Slot::step_driver})
      if (name == to_string(slot)) return true;
    return false;
  };
  // A name that no plugin loom can find: said once (it may be a typo, or simply not installed).
  std::vector<std::string> known = host.discoverable();
  for (const auto& record : host.plugins()) known.push_back(record->name);
  for (size_t i = 0; i < n; ++i)
    for (const auto* list : {&orders[i].after, &orders[i].before})
      for (const auto& name : *list)
        if (name != "*" && !is_role(name) &&
            std::find(known.begin(), known.end(), name) == known.end())
          log::warn("plugin '", nodes[i]->name, "' orders itself ",
                    list == &orders[i].after ? "after" : "before", " '", name,
                    "', which names no plugin loom can find", hint(name, known),
                    " (the constraint is ignored)");

  std::vector<std::set<size_t>> next(n);  // i -> j: i runs before j
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      for (const auto& name : orders[i].before)
        if (name != "*" && matches(j, name)) next[i].insert(j);
      for (const auto& name : orders[i].after)
        if (name != "*" && matches(j, name)) next[j].insert(i);
    }
  auto reaches = [&](size_t from, size_t to) {
    std::vector<bool> seen(n);
    std::vector<size_t> stack = {from};
    while (!stack.empty()) {
      const size_t at = stack.back();
      stack.pop_back();
      if (at == to) return true;
      if (seen[at]) continue;
      seen[at] = true;
      for (size_t k : next[at]) stack.push_back(k);
    }
    return false;
  };
  auto says = [](const std::vector<std::string>& list) {
    return std::find(list.begin(), list.end(), "*") != list.end();
  };
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      if (says(orders[i].before) && !says(orders[j].before) && !reaches(j, i))
        next[i].insert(j);
      if (says(orders[i].after) && !says(orders[j].after) && !reaches(i, j))
        next[j].insert(i);
    }

  std::vector<int> waiting(n, 0);
  for (size_t i = 0; i < n; ++i)
    for (size_t j : next[i]) ++waiting[j];
  std::vector<LoadedPlugin*> sorted;
  std::vector<bool> done(n);
  while (sorted.size() < n) {
    size_t pick = n;
    for (size_t i = 0; i < n && pick == n; ++i)
      if (!done[i] && waiting[i] == 0) pick = i;
    if (pick == n) {
      // A cycle: walk the constraints among the plugins left until one repeats.
      std::vector<size_t> path;
      size_t at = 0;
      while (done[at]) ++at;
      std::vector<int> position(n, -1);
      while (position[at] < 0) {
        position[at] = static_cast<int>(path.size());
        path.push_back(at);
        for (size_t k : next[at])
          if (!done[k]) {
            at = k;
            break;
          }
      }
      // Said from its alphabetically first plugin, whichever the walk met first.
      std::vector<std::string> members;
      for (size_t k = static_cast<size_t>(position[at]); k < path.size(); ++k)
        members.push_back(nodes[path[k]]->name);
      std::rotate(members.begin(), std::min_element(members.begin(), members.end()),
                  members.end());
      std::string cycle;
      for (const auto& name : members) cycle += name + " -> ";
      cycle += members.front();
      throw PluginError(detail::cat(
          file,
          ": the plugins' order constraints form a cycle: ", cycle,
          " (each must run before the next: see each plugin's order() in `loom plugins`); "
          "switch one of them off, or fix the plugin that names the other"));
    }
    done[pick] = true;
    sorted.push_back(nodes[pick]);
    for (size_t j : next[pick]) --waiting[j];
  }
  return sorted;
}

std::vector<Schema> core_schemas() {
  std::vector<Schema> schemas;
  Schema train("train");
  train.key_required("model", ValueType::String, "the model plugin to train (gpt, bert, ...)")
      .key_int("max_steps", 100, "optimizer steps to run")
      .key_float("num_train_epochs", 0.0,
                 "passes over the data instead of max_steps (the Trainer's: ceil(epochs x "
                 "optimizer steps per epoch); a max_steps the job sets wins); 0 = max_steps")
      .key_int("per_device_train_batch_size", 8, "samples per micro-batch on each rank")
      .key_int("gradient_accumulation_steps", 1, "micro-batches per optimizer step")
      .key_bool("auto_find_batch_size", false,
                "before training, measure the job's activations (two short probe runs) and take "
                "the largest per-device batch (a multiple of 8 where it can) that fits "
                "memory_budget, with gradient_accumulation_steps raised so the samples per step "
                "stay per_device_train_batch_size x gradient_accumulation_steps")
      .key_string("memory_budget", "auto",
                  "auto_find_batch_size's budget per rank: a size such as \"20GiB\", or auto "
                  "(90 % of the GPU's memory; on the CPU 90 % of RAM, or of the cgroup's limit, "
                  "shared by the node's ranks)")
      .key_float("learning_rate", 5e-5, "peak learning rate")
      .key_string("lr_scheduler_type", "constant",
                  "Hugging Face's schedules: constant (no warm-up) | constant_with_warmup | "
                  "linear | cosine | cosine_with_restarts | polynomial | inverse_sqrt | "
                  "cosine_with_min_lr")
      .key_int("warmup_steps", 0, "steps of linear warm-up from 0 to learning_rate")
      .key_float("warmup_ratio", 0.0,
                 "warm-up as a share of max_steps, rounded up (instead of warmup_steps)")
      .key_optional("lr_scheduler_kwargs", ValueType::Table,
                    "the schedule's extra arguments, as HF's: num_cycles (cosine, "
                    "cosine_with_restarts), lr_end and power (polynomial), timescale "
                    "(inverse_sqrt), min_lr or min_lr_rate (cosine_with_min_lr)")
      .key_float("max_grad_norm", 1.0, "clip the global gradient norm to this (0 = off)")
      .key_bool("optimizer_in_backward", false,
                "update each parameter as soon as its gradient is final, during backward, and "
                "free the gradient at once (lower peak memory; needs max_grad_norm = 0; "
                "Note [Optimizer in backward])")
      .key_int("seed", 42, "seed of every random number loom draws")
      .key_int("data_seed", -1,
               "seed of the data order and validation_split alone (the Trainer's); -1 = seed")
      .key_int("num_threads", 0, "intra-op threads (0 = the cores available)")
      .key_string("cpu_isa", "auto",
                  "oneDNN's CPU kernel level: auto (probed at start) | avx512_core_amx | "
                  "avx512_core_fp16 | avx512_core_bf16 | avx512_core | avx2 | ... (loom env)")
      .key_string("device", "auto", "cpu | cuda | cuda:N | auto (cuda when available)")
      .key_string("output_dir", "runs/default", "checkpoints and metrics.jsonl go here")
      .key_int("save_steps", 0, "save a checkpoint every N steps (0 = only at the end)")
      .key_bool("save_final", true, "save a checkpoint after the last step")
      .key_bool("save_on_signal", true,
                "on SIGTERM/SIGINT finish the step and save a checkpoint, if the job saves at "
                "all (save_steps or save_final); a second signal stops at once")
      .key_int("save_total_limit", 0, "keep only the newest N checkpoints (0 = all)")
      .key_bool("async_save", false,
                "write save_steps' checkpoints on a thread of their own while training goes "
                "on (a host copy of the state; one save in flight at a time)")
      .key_string("resume", "", "\"\" (fresh) | \"latest\" | path of a checkpoint folder")
      .key_int("logging_steps", 10,
               "log a line every N steps, 0 = none (metrics.jsonl gets every step)")
      .key_bool("logging_first_step", false, "also log the first step's line (the Trainer's key)")
      .key_optional("report_to", ValueType::Any,
                    "\"tensorboard\" (or a list with it; \"all\" too): every scalar of "
                    "metrics.jsonl also in TensorBoard event files | \"none\" (the default)")
      .key_string("logging_dir", "", "TensorBoard's folder (default: output_dir/runs)")
      .key_string("log_level", "info", "debug | info | warn | error")
      .key_bool("log_all_ranks", false, "let every rank log, not only rank 0")
      .key_bool("progress_bar", true, "show a progress bar when stderr is a terminal")
      .key_string("eval_strategy", "no",
                  "when to evaluate (Note [Evaluation]): no | steps (every eval_steps) | epoch "
                  "(when [data] starts a new epoch); needs [eval_data] or [data] validation_split")
      .key_int("eval_steps", 0, "evaluate every N steps with eval_strategy = \"steps\" (0 = "
               "logging_steps, as Hugging Face's Trainer)")
      .key_int("per_device_eval_batch_size", 8, "samples per evaluation batch on each rank")
      .key_bool("eval_on_start", false,
                "evaluate once before the first step of this run (a sanity check)")
      .key_string("metric_for_best_model", "",
                  "the evaluation metric that ranks checkpoints (Note [Best model]): loss, "
                  "perplexity, accuracy, f1 (the eval_ prefix may be left out); \"\" = eval_loss "
                  "when load_best_model_at_end or early stopping needs one")
      .key_optional("greater_is_better", ValueType::Bool,
                    "whether a larger metric_for_best_model is better (default: false for a "
                    "loss or a perplexity, true otherwise)")
      .key_bool("load_best_model_at_end", false,
                "end the run by loading the best checkpoint (needs eval_strategy = \"steps\" and "
                "save_steps a multiple of the evaluation interval); save_total_limit keeps it")
      .key_int("early_stopping_patience", 0,
               "stop after this many evaluations in a row without an improvement of more than "
               "early_stopping_threshold (0 = never)")
      .key_float("early_stopping_threshold", 0.0,
                 "how much metric_for_best_model must improve to reset the patience count");
  schemas.push_back(train);
  Schema plugins("plugins");
  plugins.key_optional("path", ValueType::Any,
                       "extra plugin folders (string or array), relative to the job file");
  schemas.push_back(plugins);
  Schema distributed("distributed");
  distributed.key_string("backend", "auto", "auto | local | mpi | gloo | nccl")
      .key_float("timeout_seconds", 300, "a collective not done by then is an error")
      .key_bool("check_collectives", false,
                "before every collective, ranks compare what they call (op, elements, dtype, "
                "group, sequence number); the first difference is an error naming both");
  schemas.push_back(distributed);
  Schema data("data");
  data.key_string("source", "random_tokens", "the data source: random_tokens | text | tokens")
      .key_bool("shuffle", true, "shuffle the samples every epoch (seeded)")
      .key_bool("drop_last", true, "drop the last incomplete batch of an epoch")
      .key_float("validation_split", 0.0,
                 "a share of the samples (0 <= x < 1) held out as the evaluation set instead "
                 "of an [eval_data] table: a seeded ([train] seed) choice, never trained on");
  schemas.push_back(data);
  Schema eval_data("eval_data");
  eval_data.key_string("source", "",
                       "the evaluation set (Note [Evaluation]): any [data] source with its keys; "
                       "\"\" = [data]'s source. Read in order, whole, split over the ranks");
  schemas.push_back(eval_data);
  Schema optimizer("optimizer");
  optimizer.key_string("name", "adamw", "the update rule: adamw (core) or a plugin's")
      .key_string("state_dtype", "fp32",
                  "fp32 | bf16: the dtype of the rule's state; bf16 (adamw) keeps the moments "
                  "in bf16 with stochastic rounding, 4 B/param less (Note [Stochastic rounding "
                  "of the state])")
      .key_string("master_dtype", "fp32",
                  "fp32 | bf16: fp32 keeps an fp32 master beside each half weight; bf16 (with "
                  "[precision] mode = \"full_bf16\", the core's step driver) keeps none: the "
                  "bf16 weights are updated in fp32 and written back with stochastic rounding, "
                  "4 B/param less (Note [bf16 weights as their own masters])")
      .key_optional("param_groups", ValueType::Array,
                    "[{match = \"regex over parameter names\", lr_scale = 1.0, weight_decay = x}]; "
                    "the first match sets a parameter's lr multiplier and weight decay");
  schemas.push_back(optimizer);
  return schemas;
}

const ConfigSection& ResolvedJob::section(const std::string& name) const {
  auto it = sections.find(name);
  LOOM_INTERNAL_ASSERT(it != sections.end(), "no section [", name, "]");
  return it->second;
}

LoadedPlugin* ResolvedJob::table_plugin_in(Slot slot) const {
  for (auto* plugin : table_plugins)
    for (Slot claimed : plugin->plugin->slots())
      if (claimed == slot) return plugin;
  return nullptr;
}

ConfigSection validate(const std::string& table_name, const ConfigValue* table,
                       const Schema& schema, const std::string& file) {
  ConfigTable values;
  if (table) {
    LOOM_CHECK_AS(ConfigError, table->is_table(), table->where, ": '", table_name,
                  "' must be a table");
    std::vector<std::string> known;
    for (const auto& key : schema.keys()) known.push_back(key.name);
    for (const auto& [key, value] : std::get<ConfigTable>(table->value)) {
      const KeySpec* spec = schema.find(key);
      if (!spec) {
        throw ConfigError(detail::cat(value.where, ": unknown key '", key, "' in [", table_name,
                                      "]", hint(key, known),
                                      " (`loom plugins` lists every key)"));
      }
      LOOM_CHECK_AS(ConfigError, type_matches(spec->type, value), value.where, ": [",
                    table_name, "] ", key, " must be ", to_string(spec->type), ", not ",
                    value.to_text(), " (", spec->doc, ")");
      // inf and nan parse as TOML floats, and no key means them: a run with them would
      // "succeed" with garbage (an infinite learning rate) or never time out.
      if (const auto* d = std::get_if<double>(&value.value))
        LOOM_CHECK_AS(ConfigError, std::isfinite(*d), value.where, ": [", table_name, "] ", key,
                      " must be a finite number, not ", value.to_text(), " (", spec->doc, ")");
      values.emplace_back(key, value);
    }
  }
  for (const auto& spec : schema.keys()) {
    bool present = false;
    for (const auto& [key, value] : values) present |= key == spec.name;
    LOOM_CHECK_AS(ConfigError, present || !spec.required, file, ": [", table_name,
                  "] needs '", spec.name, "' (", to_string(spec.type), "): ", spec.doc);
  }
  return ConfigSection(table_name, std::move(values), schema, file);
}

ResolvedJob resolve(const Job& job, PluginHost& host) {
  ResolvedJob out;
  const std::string file = job.file.string();
  std::map<std::string, Schema> core;
  for (auto& schema : core_schemas()) core.emplace(schema.table(), schema);

  // [plugins] first: it extends the search path everything else is found on.
  out.sections["plugins"] = validate("plugins", job.table("plugins"), core["plugins"], file);
  const auto& plugins = out.sections["plugins"];
  const std::vector<std::string> folders = plugins.get_strings("path");
  // Note [Job plugin paths] (loom/trainer.h): a job file may not load code unless allowed.
  LOOM_CHECK_AS(ConfigError, folders.empty() || job_plugins_allowed(), plugins.where("path"),
                ": [plugins] path = ", plugins.get("path")->to_text(), " would load plugins from "
                "folders this job file names, and a plugin is code that runs as you; loom does "
                "that only when you allow it: run loom with --allow-job-plugins, or set "
                "LOOM_ALLOW_JOB_PLUGINS=1 (or put the folders on LOOM_PLUGIN_PATH instead)");
  std::vector<std::filesystem::path> extra;
  for (const auto& folder : folders) {
    std::filesystem::path p(folder);
    extra.push_back(p.is_absolute() ? p : job.dir / p);
    std::error_code ec;
    LOOM_CHECK_AS(ConfigError, std::filesystem::is_directory(extra.back(), ec),
                  plugins.where("path"), ": [plugins] path '", folder, "' is not a "
                  "folder ('", extra.back().string(), "'); name folders of plugin .so files, "
                  "relative to the job file");
  }
  host.prepend_search_path(extra);

  LOOM_CHECK_AS(ConfigError, job.table("train"), file,
                ": the job has no [train] table; it needs at least [train] model = \"gpt\"");
  out.sections["train"] = validate("train", job.table("train"), core["train"], file);
  out.sections["distributed"] =
      validate("distributed", job.table("distributed"), core["distributed"], file);

  const auto& train = out.sections["train"];
  out.model = choose(host, "model", train.get_string("model"), train.where("model"), "model");
  {
    std::vector<Schema> storage;
    const Schema& schema = schema_for(*out.model.provider, "model", out.model.name, storage);
    out.sections["model"] = validate("model", job.table("model"), schema, file);
  }
  // The selector tables: the chosen provider's keys plus the core's common keys.
  for (const std::string table : {"data", "optimizer"}) {
    const ConfigValue* values = job.table(table);
    const ConfigSection common_only =
        validate(table, nullptr, core[table], file);  // for the selector's default
    std::string choice = common_only.get_string(kSelectorKey(table));
    std::string where = file + " [" + table + "] (default)";
    if (values) {
      LOOM_CHECK_AS(ConfigError, values->is_table(), values->where, ": '", table,
                    "' must be a table");
      if (const ConfigValue* chosen = values->find(kSelectorKey(table))) {
        const auto* name = std::get_if<std::string>(&chosen->value);
        LOOM_CHECK_AS(ConfigError, name, chosen->where, ": [", table, "] ",
                      kSelectorKey(table), " must be a string");
        choice = *name;
        where = chosen->where;
      }
    }
    auto picked = choose(host, table, choice, where, table == "data" ? "data source" : "optimizer");
    std::vector<Schema> storage;
    const Schema& schema = schema_for(*picked.provider, table, picked.name, storage);
    out.sections[table] = validate(table, values, merged(core[table], schema), file);
    (table == "data" ? out.data : out.update_rule) = picked;
  }
  // [eval_data]: a second data source, of any provider, with that provider's keys.
  if (const ConfigValue* values = job.table("eval_data")) {
    LOOM_CHECK_AS(ConfigError, values->is_table(), values->where, ": 'eval_data' must be a table");
    std::string choice = out.data.name, where = file + " [eval_data] (default: [data]'s source)";
    if (const ConfigValue* chosen = values->find("source")) {
      const auto* name = std::get_if<std::string>(&chosen->value);
      LOOM_CHECK_AS(ConfigError, name, chosen->where, ": [eval_data] source must be a string");
      if (!name->empty()) {
        choice = *name;
        where = chosen->where;
      }
    }
    out.eval_data = choose(host, "data", choice, where, "data source");
    std::vector<Schema> storage;
    const Schema& schema = schema_for(*out.eval_data.provider, "data", out.eval_data.name, storage);
    out.sections["eval_data"] =
        validate("eval_data", values, merged(core["eval_data"], schema), file);
  }

  // Every other table switches on the plugin of that name.
  std::vector<std::string> reserved;
  for (const auto& [name, schema] : core) reserved.push_back(name);
  reserved.push_back("model");
  for (const auto& table : job.table_names()) {
    if (std::find(reserved.begin(), reserved.end(), table) != reserved.end()) continue;
    LoadedPlugin* plugin = host.find(table);
    if (!plugin) {
      auto names = host.discoverable();
      names.insert(names.end(), reserved.begin(), reserved.end());
      throw ConfigError(detail::cat(job.table(table)->where, ": [", table,
                                    "] names no known plugin or table", hint(table, names),
                                    " Plugins found: ", joined(host.discoverable()),
                                    ". Add its folder to [plugins] path or LOOM_PLUGIN_PATH."));
    }
    std::vector<Schema> schemas = plugin->plugin->schemas();
    auto own = std::find_if(schemas.begin(), schemas.end(), [&](const Schema& s) {
      return s.table() == table && s.provider().empty();
    });
    LOOM_CHECK_AS(ConfigError, own != schemas.end(), job.table(table)->where, ": plugin '",
                  table, "' has no table of its own to switch it on");
    out.sections[table] = validate(table, job.table(table), *own, file);
    out.table_plugins.push_back(plugin);
  }

  // Slots: each filled by at most one plugin.
  std::map<Slot, std::pair<LoadedPlugin*, std::string>> claims;
  auto claim = [&](Slot slot, LoadedPlugin* plugin, const std::string& why) {
    auto [it, fresh] = claims.emplace(slot, std::make_pair(plugin, why));
    if (!fresh && it->second.first != plugin)
      throw ConfigError(detail::cat(file, ": slot '", to_string(slot), "' is claimed twice: by ",
                                    it->second.second, " and by ", why,
                                    "; switch one of them off"));
  };
  claim(Slot::model, out.model.provider, "'" + out.model.provider->name + "' ([train] model)");
  claim(Slot::data, out.data.provider, "'" + out.data.provider->name + "' ([data] source)");
  claim(Slot::update_rule, out.update_rule.provider,
        "'" + out.update_rule.provider->name + "' ([optimizer] name)");
  for (auto* plugin : out.table_plugins)
    for (Slot slot : plugin->plugin->slots())
      claim(slot, plugin, "'" + plugin->name + "' ([" + plugin->name + "])");

  out.active = order_plugins(out, host, file);
  return out;
}

}  // namespace loom
