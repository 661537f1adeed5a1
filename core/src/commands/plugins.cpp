// `loom plugins` (every plugin on the search path, its slots and keys) and the commands plugins
// add (Plugin::commands): listed by `loom --help`, run by `loom NAME`.
#include <map>
#include <set>
#include <sstream>

#include "plugin_host.h"
#include "resolve.h"
#include "job.h"
#include "loom/error.h"
#include "loom/plugin.h"
#include "loom/trainer.h"

namespace loom {

namespace {

// Every command of the loadable plugins, by name; a clash is a PluginError naming both.
std::map<std::string, std::pair<Command, std::string>> plugin_commands(PluginHost& host) {
  host.load_all();  // a plugin that does not load has no commands (`loom plugins` says why)
  std::map<std::string, std::pair<Command, std::string>> out;
  for (const auto& record : host.plugins()) {
    const std::string where = record->builtin() ? "the core" : record->file.string();
    for (auto& command : record->plugin->commands()) {
      LOOM_CHECK_AS(PluginError, !is_own_command(command.name), "plugin '", where,
                    "' adds the command '", command.name, "', which is one of loom's own; "
                    "rename it");
      auto [it, fresh] = out.emplace(command.name, std::make_pair(command, where));
      LOOM_CHECK_AS(PluginError, fresh, "two plugins add the command '", command.name, "': ",
                    it->second.second, " and ", where, "; remove one from the plugin search path");
    }
  }
  return out;
}

}  // namespace

bool is_own_command(const std::string& name) {
  static const std::set<std::string> own = {"run", "check", "estimate", "plugins", "env",
                                            "consolidate", "export", "generate", "eval",
                                            "plot"};
  return own.count(name) > 0;
}

std::vector<std::string> plugin_command_usages(const std::vector<std::filesystem::path>& extra_path) {
  PluginHost host;
  host.prepend_search_path(extra_path);
  std::vector<std::string> out;
  for (const auto& [name, command] : plugin_commands(host))
    out.push_back(command.first.usage + "  (plugin " + command.second + ")");
  return out;
}

std::optional<int> run_plugin_command(const std::string& name, const std::vector<std::string>& args,
                                      const std::vector<std::filesystem::path>& extra_path) {
  PluginHost host;
  host.prepend_search_path(extra_path);
  auto commands = plugin_commands(host);
  auto it = commands.find(name);
  if (it == commands.end()) return std::nullopt;
  return it->second.first.run(args);  // the host, and so the plugin, outlive the call
}

std::string describe_plugins(const std::vector<std::filesystem::path>& extra_path) {
  PluginHost host;
  host.prepend_search_path(extra_path);
  auto failures = host.load_all();
  std::ostringstream out;
  out << "plugin search path:";
  for (const auto& folder : host.search_path()) out << " " << folder.string();
  out << "\n";
  auto print_schema = [&](const Schema& schema) {
    out << "    [" << schema.table() << "]";
    if (!schema.provider().empty())
      out << " " << (schema.table() == "model"      ? "when [train] model = \""
                     : schema.table() == "data"     ? "when source = \""
                                                    : "when name = \"")
          << schema.provider() << "\"";
    out << "\n";
    for (const auto& key : schema.keys()) {
      out << "      " << key.name << " (" << to_string(key.type);
      if (key.required) out << ", required";
      else if (key.default_value) out << ", default " << display_text(*key.default_value);
      out << "): " << key.doc << "\n";
    }
  };
  out << "\ncore tables\n";
  for (const auto& schema : core_schemas()) print_schema(schema);
  for (const auto& record : host.plugins()) {
    out << "\n" << record->name << " " << record->version << " — "
        << record->plugin->description() << "\n";
    out << "    file: " << (record->builtin() ? "(built into libloom_core)" : record->file_label())
        << "\n";
    auto slots = record->plugin->slots();
    for (const auto& schema : record->plugin->schemas())
      if (!schema.provider().empty())
        out << "    provides " << schema.table() << " '" << schema.provider() << "'\n";
    if (!slots.empty()) {
      out << "    fills slot(s):";
      for (Slot slot : slots) out << " " << to_string(slot);
      out << "\n";
    }
    for (const auto& schema : record->plugin->schemas()) print_schema(schema);
  }
  for (const auto& failure : failures) out << "\nFAILED TO LOAD: " << failure << "\n";
  return out.str();
}

}  // namespace loom
