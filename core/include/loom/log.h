// loom/log.h — rank-aware logging for the core and plugins.
// Deliberately free of fmt/spdlog types: spdlog (with Debian's fmt 9) lives in one translation
// unit of the core that never sees a LibTorch header, because LibTorch ships its own fmt 12
// headers and one binary must not mix the two. Callers build messages with stream syntax.
#pragma once

#include <string>
#include <string_view>

#include "loom/error.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3, off = 4 };

// Called once by the engine: messages are prefixed "[rank R]" when world > 1, and ranks other
// than 0 print only warnings and errors unless all_ranks is set.
void configure(int rank, int world_size, bool all_ranks, Level level);
void set_level(Level level);
Level level();
void write(Level level, std::string_view message);
// Prints `message` once per process for a given key (for one-time warnings).
void warn_once(std::string_view key, std::string_view message);
Level parse_level(std::string_view name);  // throws ConfigError on an unknown name

// The terminal's status line (the engine's progress bar), on stderr: log lines print above it,
// never into it, and it is drawn again below them.
void status(std::string_view line);  // draws or replaces it
void end_status();  // leaves the last one on screen and moves to a new line

template <class... Args>
void debug(const Args&... args) {
  if (level() <= Level::debug) write(Level::debug, detail::cat(args...));
}
template <class... Args>
void info(const Args&... args) {
  if (level() <= Level::info) write(Level::info, detail::cat(args...));
}
template <class... Args>
void warn(const Args&... args) {
  if (level() <= Level::warn) write(Level::warn, detail::cat(args...));
}
template <class... Args>
void error(const Args&... args) {
  write(Level::error, detail::cat(args...));
}

}  // namespace loom::log

#pragma GCC visibility pop
