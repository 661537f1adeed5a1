// Plugin discovery and loading. Checks, in this order: the file exists; nobody but root, the
// user and loom's installer can change it or a folder above it (Note [Trusted plugin files]);
// its ABI record (Note [ABI record] in loom/plugin.h, read from the ELF file before the library
// is loaded, so none of the plugin's code has run) has the host's API version and build
// (LibTorch version, C++ ABI, device); it loads (dlopen with RTLD_NOW, so a missing symbol fails
// here with the loader's message); it exports loom_plugin_entry, whose version agrees. Only then
// is any C++ of the plugin called.
#include "plugin_host.h"

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>

#include "builtin.h"
#include "loom/log.h"
#include "loom/trainer.h"

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

// Note [Trusted plugin files]: loading a plugin runs its code as the user, so a plugin file
// that someone else can replace is someone else's code. As ld.so does for the libraries of a
// setuid program (and OpenSSH for authorized_keys), the host refuses a plugin when the file, or
// any folder on its path up to /, is
//  - writable by group or others (mode bits 020 or 002), or
//  - owned by anyone but root, the user (effective uid), or the owner of libloom_core's file
//    (whoever installed loom: the user already runs that account's code, and a shared install
//    by a software account is common).
// One exception, for /tmp and its like: a folder with the sticky bit (mode 1000), owned by a
// trusted account, may be writable by others when it lies above the plugin's own folder. In
// it others may add entries but may not rename or remove ours, so a safe folder below it stays
// safe (a test's mkdtemp folder in /tmp, an install under /tmp). The plugin's own folder gets
// no exception: a world-writable /tmp holding loom_x.so itself is refused, since anyone can
// put a loom_<name>.so there before the user does. A plugin found through symbolic links is
// checked along every path that reaches it: the folders the link was named in, the link's
// folder with its own links resolved, and the real file's folders.
struct PathCheck {
  uid_t user = geteuid();
  uid_t installer = 0;
  PathCheck() {
    struct stat core {};
    const auto core_file = boost::dll::this_line_location();
    installer = ::stat(core_file.c_str(), &core) == 0 ? core.st_uid : 0;
  }
  bool trusted_owner(uid_t owner) const {
    return owner == 0 || owner == user || owner == installer;
  }

  enum class Role { file, own_folder, folder_above };

  // Throws PluginError naming `entry` and its mode when it breaks the rule; `plugin` is the
  // path the plugin was named by.
  void check(const std::filesystem::path& entry, Role role,
             const std::filesystem::path& plugin) const {
    struct stat info {};
    if (::stat(entry.c_str(), &info) != 0) return;  // a missing file is reported by the caller
    const std::string what =
        role == Role::file         ? detail::cat("plugin file '", entry.string(), "'")
        : role == Role::own_folder ? detail::cat("folder '", entry.string(), "' (holding plugin '",
                                                 plugin.string(), "')")
                                   : detail::cat("folder '", entry.string(), "' (above plugin '",
                                                 plugin.string(), "')");
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    LOOM_CHECK_AS(PluginError, trusted_owner(info.st_uid), what, " is owned by uid ",
                  info.st_uid, " (mode ", mode, "), not by root, you (uid ", user,
                  ") or loom's installer (uid ", installer, "): that account could swap the "
                  "plugin's code, so loom does not load it; move the plugin to a folder of "
                  "yours, or chown it");
    const bool others_write = info.st_mode & (S_IWGRP | S_IWOTH);
    const bool sticky_above =
        role == Role::folder_above && S_ISDIR(info.st_mode) && (info.st_mode & S_ISVTX);
    LOOM_CHECK_AS(PluginError, !others_write || sticky_above, what, " is writable by ",
                  (info.st_mode & S_IWGRP) && (info.st_mode & S_IWOTH) ? "group and others"
                  : (info.st_mode & S_IWGRP)                           ? "its group"
                                                                       : "others",
                  " (mode ", mode, "): whoever may write there could swap the plugin's code, "
                  "so loom does not load it; fix it with chmod go-w '", entry.string(), "'");
  }

  // The file and every folder above it, up to /.
  void check_chain(const std::filesystem::path& file, const std::filesystem::path& plugin) const {
    check(file, Role::file, plugin);
    Role role = Role::own_folder;
    for (auto folder = file.parent_path(); !folder.empty(); folder = folder.parent_path()) {
      check(folder, role, plugin);
      role = Role::folder_above;
      if (folder == folder.root_path()) break;
    }
  }
};

// `found_as`: the path the plugin was named by (absolute); `real`: it with every link resolved.
void check_trusted(const std::filesystem::path& found_as, const std::filesystem::path& real) {
  static const PathCheck rule;
  rule.check_chain(found_as, found_as);
  std::error_code ec;
  const auto folder = std::filesystem::canonical(found_as.parent_path(), ec);
  if (!ec && folder != found_as.parent_path())
    rule.check_chain(folder / found_as.filename(), found_as);
  if (real != found_as) rule.check_chain(real, found_as);
}

std::atomic<bool> job_plugins_allowed_flag{false};

}  // namespace

void allow_job_plugins(bool allowed) { job_plugins_allowed_flag = allowed; }

bool job_plugins_allowed() {
  if (job_plugins_allowed_flag) return true;
  const char* env = std::getenv("LOOM_ALLOW_JOB_PLUGINS");
  return env && std::string(env) == "1";
}

std::string LoadedPlugin::file_label() const {
  if (found_as.empty() || found_as == file) return file.string();
  return found_as.string() + " -> " + file.string();
}

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
  const auto found_as = std::filesystem::absolute(file, ec).lexically_normal();
  check_trusted(found_as, absolute);  // Note [Trusted plugin files]

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
  record->found_as = found_as;
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
  log::debug("loaded plugin ", record->name, " ", record->version, " from ",
             record->file_label());
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
