// The one translation unit that uses spdlog (and through it Debian's fmt 9). It must never
// include a LibTorch header: LibTorch ships fmt 12 headers, and mixing the two in one TU would
// compile against one and link the other. CMake builds it without LibTorch's include path.
#include "loom/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>

namespace loom::log {
namespace {
std::atomic<Level> g_level{Level::info};
std::atomic<bool> g_quiet_rank{false};  // a rank != 0 that prints warnings and errors only

std::shared_ptr<spdlog::logger>& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto made = std::make_shared<spdlog::logger>("loom", sink);
    made->set_pattern("[%H:%M:%S] %^%l%$ %v");
    made->set_level(spdlog::level::trace);
    return made;
  }();
  return instance;
}

spdlog::level::level_enum to_spd(Level level) {
  switch (level) {
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::info;
}
}  // namespace

void configure(int rank, int world_size, bool all_ranks, Level level) {
  g_level = level;
  g_quiet_rank = rank != 0 && !all_ranks;
  if (world_size > 1)
    logger()->set_pattern("[%H:%M:%S] [rank " + std::to_string(rank) + "] %^%l%$ %v");
  else
    logger()->set_pattern("[%H:%M:%S] %^%l%$ %v");
}

void set_level(Level level) { g_level = level; }

Level level() {
  Level current = g_level.load();
  if (g_quiet_rank && current < Level::warn) return Level::warn;
  return current;
}

// Note [Status line]: the progress bar is the terminal's last line, redrawn in place with
// "\r". A log line written while it shows would start in the middle of it ("... samples/s[18:11:19]
// info saved ..."), so every write clears the bar's line first and draws the bar again after.
std::mutex g_status_mutex;
std::string g_status;  // the bar on screen, or "" for none

void write(Level lvl, std::string_view message) {
  if (lvl < level()) return;
  std::lock_guard<std::mutex> lock(g_status_mutex);
  if (!g_status.empty()) std::fputs("\r\033[K", stderr);
  logger()->log(to_spd(lvl), "{}", message);
  logger()->flush();
  if (!g_status.empty()) {
    std::fputs(g_status.c_str(), stderr);
    std::fflush(stderr);
  }
}

void status(std::string_view line) {
  std::lock_guard<std::mutex> lock(g_status_mutex);
  g_status = line;
  std::fprintf(stderr, "\r\033[K%s", g_status.c_str());
  std::fflush(stderr);
}

void end_status() {
  std::lock_guard<std::mutex> lock(g_status_mutex);
  if (g_status.empty()) return;
  std::fputs("\n", stderr);
  std::fflush(stderr);
  g_status.clear();
}

void warn_once(std::string_view key, std::string_view message) {
  static std::mutex mutex;
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!seen.emplace(key).second) return;
  }
  write(Level::warn, message);
}

Level parse_level(std::string_view name) {
  if (name == "debug") return Level::debug;
  if (name == "info") return Level::info;
  if (name == "warn" || name == "warning") return Level::warn;
  if (name == "error") return Level::error;
  if (name == "off") return Level::off;
  throw ConfigError(detail::cat("unknown log level '", name,
                                "'; use one of debug, info, warn, error, off"));
}

}  // namespace loom::log
