// resolve.h (core-internal) — turns a parsed Job into validated sections and the set of active
// plugins: which plugin provides the model, the data and the update rule, which plugins are
// switched on by their own tables, and that no slot is claimed twice.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "job.h"
#include "loom/plugin.h"
#include "plugin_host.h"

namespace loom {

// Tables the core owns; every other table names a plugin.
std::vector<Schema> core_schemas();

struct ResolvedJob {
  struct Choice {
    LoadedPlugin* provider = nullptr;
    std::string name;
  };
  std::map<std::string, ConfigSection> sections;  // every table, validated, incl. defaults
  Choice model, data, update_rule;
  // [eval_data]'s source (Note [Evaluation]): provider null when the job has no such table.
  Choice eval_data;
  std::vector<LoadedPlugin*> table_plugins;  // switched on by their own table
  std::vector<LoadedPlugin*> active;         // all of the above, no repeats, in the order
                                             // their constraints give (Note [Plugin order])

  const ConfigSection& section(const std::string& name) const;
  // The table plugin that fills `slot` (grad_sync, step_driver, ...), or null; resolve() refused
  // two.
  LoadedPlugin* table_plugin_in(Slot slot) const;
};

ResolvedJob resolve(const Job& job, PluginHost& host);

// The active plugins of a resolved job in the order their Plugin::order() constraints give
// (Note [Plugin order]); a cycle is a PluginError naming every plugin in it.
std::vector<LoadedPlugin*> order_plugins(const ResolvedJob& job, PluginHost& host,
                                         const std::string& file);

// Validates one table against a schema (unknown key -> "did you mean", wrong type, missing
// required key), all with file:line.
ConfigSection validate(const std::string& table_name, const ConfigValue* table,
                       const Schema& schema, const std::string& file);

}  // namespace loom
