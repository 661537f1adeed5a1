// plugin_host.h (core-internal) — finds, loads and checks plugin libraries (Boost.DLL), and
// keeps the built-in plugins of the core beside them.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/plugin.h"

namespace loom {

struct LoadedPlugin {
  std::string name, version, build;
  std::filesystem::path file;      // the real file, symlinks resolved; empty for built-ins
  std::filesystem::path found_as;  // the path it was found or named by (absolute)
  Plugin* plugin = nullptr;    // owned by the host; destroyed by the library's own deleter
  void (*destroy)(Plugin*) = nullptr;
  bool builtin() const { return file.empty(); }
  // What the run header and `loom check` name: the file, or "link -> target" when it was found
  // through a symbolic link.
  std::string file_label() const;
};

class PluginHost {
 public:
  PluginHost();
  ~PluginHost();
  PluginHost(const PluginHost&) = delete;
  PluginHost& operator=(const PluginHost&) = delete;

  // The folders searched, in order: the job's [plugins] path, LOOM_PLUGIN_PATH, then
  // <folder of libloom_core>/loom/plugins (the build tree and the install prefix alike).
  static std::vector<std::filesystem::path> default_search_path();
  void prepend_search_path(const std::vector<std::filesystem::path>& folders);
  const std::vector<std::filesystem::path>& search_path() const { return search_path_; }

  // Loads one plugin file. Throws PluginError naming the file for a missing file, a file or
  // folder others may write to (Note [Trusted plugin files]), a library that does not load
  // (with the loader's message: missing symbols...), a library without loom_plugin_entry, an
  // API version or build mismatch.
  LoadedPlugin& load(const std::filesystem::path& file);
  // The plugin called `name`: already loaded or built in, else the file loom_<name>.so on the
  // search path (first folder wins). nullptr if there is none.
  LoadedPlugin* find(const std::string& name);
  // Names of plugin files on the search path (loom_<name>.so), whether loaded or not.
  std::vector<std::string> discoverable() const;
  // Loads every plugin on the search path; failures are returned, not thrown.
  std::vector<std::string> load_all();
  const std::vector<std::unique_ptr<LoadedPlugin>>& plugins() const { return plugins_; }

 private:
  std::vector<std::filesystem::path> search_path_;
  std::vector<std::unique_ptr<LoadedPlugin>> plugins_;
};

}  // namespace loom
