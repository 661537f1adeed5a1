// Plugin discovery and loading. Checks, in this order: the file exists; its ABI record (Note
// [ABI record] in loom/plugin.h, read from the ELF file before the library is loaded, so none
// of the plugin's code has run) has the host's API version and build (LibTorch version, C++
// ABI, device); it loads (dlopen with RTLD_NOW, so a missing symbol fails here with the
// loader's message); it exports loom_plugin_entry, whose version agrees. Only then is any C++
// of the plugin called.
#include "plugin_host.h"

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include <elf.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>

#include "builtin.h"
#include "loom/log.h"

namespace loom {
namespace {

// Note [Plugins stay loaded]: a plugin's code can live on in objects it made — a std::function
// handler, an autograd node, a tensor deleter, a vtable, an exception in flight. Unloading a
// library while any of those exist crashes far away from the cause, so loaded libraries are
// kept in this process-wide list and never unloaded.
std::vector<boost::dll::shared_library>& libraries() {
  static auto* kept = new std::vector<boost::dll::shared_library>();
  return *kept;
}
std::mutex libraries_mutex;

const char* kPrefix = "loom_";
const char* kSuffix = ".so";

std::string build_without_compiler(const std::string& build) {
  return build.substr(0, build.find(" compiler="));
}

// The ABI record of an ELF file (Note [ABI record]): the ".loom_abi" section's bytes, read from
// the file without loading it. nullopt when the file is ELF but has no record; a file that is
// no 64-bit little-endian ELF is left to the loader, whose message says what it is.
enum class AbiRead { record, no_record, not_elf };
AbiRead read_abi_record(const std::filesystem::path& file, loom_plugin_abi& record) {
  std::ifstream in(file, std::ios::binary);
  Elf64_Ehdr header{};
  if (!in.read(reinterpret_cast<char*>(&header), sizeof header) ||
      std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 || header.e_ident[EI_CLASS] != ELFCLASS64 ||
      header.e_ident[EI_DATA] != ELFDATA2LSB || header.e_shentsize != sizeof(Elf64_Shdr) ||
      header.e_shstrndx >= header.e_shnum)
    return AbiRead::not_elf;
  std::vector<Elf64_Shdr> sections(header.e_shnum);
  in.seekg(static_cast<std::streamoff>(header.e_shoff));
  if (!in.read(reinterpret_cast<char*>(sections.data()),
               static_cast<std::streamsize>(sections.size() * sizeof(Elf64_Shdr))))
    return AbiRead::not_elf;
  const Elf64_Shdr& names = sections[header.e_shstrndx];
  std::string table(names.sh_size, '\0');
  in.seekg(static_cast<std::streamoff>(names.sh_offset));
  if (!in.read(table.data(), static_cast<std::streamsize>(table.size()))) return AbiRead::not_elf;
  for (const Elf64_Shdr& section : sections) {
    if (section.sh_name >= table.size() ||
        std::strcmp(table.c_str() + section.sh_name, LOOM_ABI_SECTION) != 0)
      continue;
    if (section.sh_type == SHT_NOBITS || section.sh_size < sizeof record) return AbiRead::no_record;
    in.seekg(static_cast<std::streamoff>(section.sh_offset));
    if (!in.read(reinterpret_cast<char*>(&record), sizeof record)) return AbiRead::no_record;
    if (std::memcmp(record.magic, "LOOMABI", 8) != 0) return AbiRead::no_record;
    record.build[sizeof record.build - 1] = '\0';
    return AbiRead::record;
  }
  return AbiRead::no_record;
}

}  // namespace

PluginHost::PluginHost() : search_path_(default_search_path()) {
  for (auto& builtin : make_builtin_plugins()) {
    auto record = std::make_unique<LoadedPlugin>();
    record->name = builtin->name();
    record->version = "builtin";
    record->build = LOOM_BUILD_STRING;
    record->plugin = builtin.release();
    record->destroy = [](Plugin* p) { delete p; };
    plugins_.push_back(std::move(record));
  }
}

PluginHost::~PluginHost() {
  // Plugin objects die before the host; their libraries stay (Note [Plugins stay loaded]).
  for (auto it = plugins_.rbegin(); it != plugins_.rend(); ++it)
    if ((*it)->plugin) (*it)->destroy((*it)->plugin);
}

std::vector<std::filesystem::path> PluginHost::default_search_path() {
  std::vector<std::filesystem::path> path;
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::string list = env;
    size_t start = 0;
    while (start <= list.size()) {
      size_t end = list.find(':', start);
      if (end == std::string::npos) end = list.size();
      if (end > start) path.emplace_back(list.substr(start, end - start));
      start = end + 1;
    }
  }
  // The folder of libloom_core itself: <libdir>/loom/plugins.
  auto core_file = boost::dll::this_line_location();
  path.push_back(core_file.parent_path() / "loom" / "plugins");
  return path;
}

void PluginHost::prepend_search_path(const std::vector<std::filesystem::path>& folders) {
  search_path_.insert(search_path_.begin(), folders.begin(), folders.end());
}

LoadedPlugin& PluginHost::load(const std::filesystem::path& file) {
  std::error_code ec;
  auto absolute = std::filesystem::weakly_canonical(file, ec);
  if (ec) absolute = file;
  for (auto& record : plugins_)
    if (record->file == absolute) return *record;
  LOOM_CHECK_AS(PluginError, std::filesystem::exists(absolute), "plugin file '", file.string(),
                "' does not exist; check the name and the plugin search path");

  // Before the library is loaded: the ABI record (Note [ABI record]).
  loom_plugin_abi abi{};
  const AbiRead read = read_abi_record(absolute, abi);
  LOOM_CHECK_AS(PluginError, read != AbiRead::no_record, "'", absolute.string(),
                "' has no loom ABI record (the section " LOOM_ABI_SECTION
                " that LOOM_DEFINE_PLUGIN writes): it is not a loom plugin, or one built "
                "against a loom older than plugin API 7; rebuild it against this loom's SDK. "
                "Nothing of it was run");
  if (read == AbiRead::record) {
    LOOM_CHECK_AS(PluginError, abi.api_version == LOOM_PLUGIN_API_VERSION, "plugin '",
                  absolute.string(), "' was built for loom plugin API version ", abi.api_version,
                  ", but this loom has API version ", LOOM_PLUGIN_API_VERSION,
                  "; rebuild the plugin against this loom's SDK (nothing of it was run)");
    LOOM_CHECK_AS(PluginError,
                  build_without_compiler(abi.build) == build_without_compiler(LOOM_BUILD_STRING),
                  "plugin '", absolute.string(), "' was built for '", abi.build,
                  "', but this loom is '", LOOM_BUILD_STRING,
                  "'; rebuild the plugin with the same LibTorch and C++ ABI (nothing of it was "
                  "run)");
  }

  boost::dll::shared_library library;
  try {
    library.load(absolute, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& error) {
    throw PluginError(detail::cat("cannot load plugin '", absolute.string(), "': ", error.what(),
                                  "; rebuild it against this loom (loom_add_plugin in CMake)"));
  }
  LOOM_CHECK_AS(PluginError, library.has("loom_plugin_entry"), "'", absolute.string(),
                "' is not a loom plugin: it exports no loom_plugin_entry (a plugin defines "
                "one with LOOM_DEFINE_PLUGIN)");
  auto entry = library.get<const loom_plugin_info*()>("loom_plugin_entry");
  const loom_plugin_info* info = entry();
  LOOM_CHECK_AS(PluginError, info, "'", absolute.string(),
                "': loom_plugin_entry returned no plugin info");
  // Only api_version may be read before it is checked: it is the one field every version has.
  LOOM_CHECK_AS(PluginError, info->api_version == LOOM_PLUGIN_API_VERSION, "plugin '",
                absolute.string(), "' was built for loom plugin API version ", info->api_version,
                ", but this loom has API version ", LOOM_PLUGIN_API_VERSION,
                "; rebuild the plugin against this loom's SDK");
  const std::string build = info->build ? info->build : "";
  LOOM_CHECK_AS(PluginError,
                build_without_compiler(build) == build_without_compiler(LOOM_BUILD_STRING),
                "plugin '", absolute.string(), "' was built for '", build,
                "', but this loom is '", LOOM_BUILD_STRING,
                "'; rebuild the plugin with the same LibTorch and C++ ABI");

  auto record = std::make_unique<LoadedPlugin>();
  record->name = info->name ? info->name : "";
  record->version = info->version ? info->version : "";
  record->build = build;
  record->file = absolute;
  record->destroy = info->destroy;
  LOOM_CHECK_AS(PluginError, !record->name.empty() && info->create && info->destroy, "'",
                absolute.string(), "': its plugin info lacks a name or a factory");
  for (auto& other : plugins_)
    LOOM_CHECK_AS(PluginError, other->name != record->name, "two plugins are named '",
                  record->name, "': ", other->builtin() ? "the core" : other->file.string(),
                  " and ", absolute.string(), "; remove one from the plugin search path");
  record->plugin = info->create();
  LOOM_CHECK_AS(PluginError, record->plugin, "'", absolute.string(), "': its factory failed");
  {
    std::lock_guard<std::mutex> lock(libraries_mutex);
    libraries().push_back(std::move(library));
  }
  log::debug("loaded plugin ", record->name, " ", record->version, " from ", absolute.string());
  plugins_.push_back(std::move(record));
  return *plugins_.back();
}

LoadedPlugin* PluginHost::find(const std::string& name) {
  for (auto& record : plugins_)
    if (record->name == name) return record.get();
  for (const auto& folder : search_path_) {
    auto candidate = folder / (kPrefix + name + kSuffix);
    if (std::filesystem::exists(candidate)) {
      LoadedPlugin& loaded = load(candidate);
      LOOM_CHECK_AS(PluginError, loaded.name == name, "'", candidate.string(),
                    "' calls itself '", loaded.name, "', not '", name,
                    "'; a plugin file must be named loom_<its name>.so");
      return &loaded;
    }
  }
  return nullptr;
}

std::vector<std::string> PluginHost::discoverable() const {
  std::vector<std::string> names;
  for (const auto& record : plugins_) names.push_back(record->name);
  for (const auto& folder : search_path_) {
    std::error_code ec;
    if (!std::filesystem::is_directory(folder, ec)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
      const std::string file = entry.path().filename().string();
      if (file.rfind(kPrefix, 0) == 0 && file.size() > 8 &&
          file.compare(file.size() - 3, 3, kSuffix) == 0)
        names.push_back(file.substr(5, file.size() - 8));
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

std::vector<std::string> PluginHost::load_all() {
  std::vector<std::string> failures;
  for (const auto& name : discoverable()) {
    try {
      find(name);
    } catch (const Error& error) {
      failures.push_back(error.what());
    }
  }
  return failures;
}

}  // namespace loom
