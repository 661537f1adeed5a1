// Update rules for tests, built as the engine builds them: the core's adamw, and the optim
// plugin's rules from the plugin library (LOOM_OPTIM_PLUGIN, its path, defined by the suite).
#pragma once

#include <dlfcn.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>

#include "loom/config.h"
#include "loom/plugin.h"
#include "loom/update_rule.h"

namespace loom::test {

using RuleValue = std::variant<int64_t, double, bool, std::string>;

// The optim plugin, loaded as the host would (its entry point), kept for the whole run.
inline Plugin& optim_plugin() {
  static Plugin* plugin = [] {
    void* handle = dlopen(LOOM_OPTIM_PLUGIN, RTLD_NOW);
    if (!handle) throw std::runtime_error(dlerror());
    auto entry =
        reinterpret_cast<const loom_plugin_info* (*)()>(dlsym(handle, "loom_plugin_entry"));
    return entry()->create();
  }();
  return *plugin;
}

inline ConfigValue value_of(const RuleValue& v) {
  ConfigValue out;
  std::visit([&](auto x) { out.value = x; }, v);
  out.where = "test";
  return out;
}

// A rule built from its provider's schema and `values` (the rest defaults).
inline std::unique_ptr<UpdateRule> make_rule(
    const std::string& name,
    const std::map<std::string, RuleValue>& values = {}) {
  Schema schema("optimizer", name);
  if (name == "adamw") {
    schema.key_float("beta1", 0.9, "")
        .key_float("beta2", 0.999, "")
        .key_float("eps", 1e-8, "")
        .key_float("weight_decay", 0.0, "");
  } else {
    for (const auto& s : optim_plugin().schemas())
      if (s.provider() == name) schema = s;
  }
  // The core's common [optimizer] key every rule's table carries (resolve.cpp).
  schema.key_string("state_dtype", "fp32", "");
  ConfigTable table;
  for (const auto& [key, v] : values) table.emplace_back(key, value_of(v));
  ConfigSection section("optimizer", table, schema, "job.toml");
  return name == "adamw" ? make_adamw(section) : optim_plugin().create_update_rule(name, section);
}

}  // namespace loom::test
