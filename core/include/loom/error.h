// loom/error.h — the exception types every loom component throws, and the two check macros.
// Not a logging facility: an error here is always thrown, never printed and swallowed.
//
// Two kinds of check (as c10 does): LOOM_CHECK for bad user input — the message names the value
// and says what to do — and LOOM_INTERNAL_ASSERT for broken invariants ("this is a bug").
// The types are defined (key functions) in libloom_core, so they keep one identity across
// plugin boundaries and can be caught by type in the host.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what);
  ~Error() override;
};
// A job file or --set value is wrong.
class ConfigError : public Error {
 public:
  using Error::Error;
  ~ConfigError() override;
};
// A plugin file cannot be loaded, is not a plugin, or was built for another ABI.
class PluginError : public Error {
 public:
  using Error::Error;
  ~PluginError() override;
};
// A checkpoint or safetensors file is missing, truncated, corrupt or does not fit the job.
class CheckpointError : public Error {
 public:
  using Error::Error;
  ~CheckpointError() override;
};
// A data file is missing or unreadable, or a sample cannot be made.
class DataError : public Error {
 public:
  using Error::Error;
  ~DataError() override;
};
// A broken invariant: a bug in loom or in a plugin.
class InternalError : public Error {
 public:
  using Error::Error;
  ~InternalError() override;
};

namespace detail {
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace loom

// LOOM_CHECK(cond, "what was wrong: ", value, "; what to do") throws loom::Error.
#define LOOM_CHECK(cond, ...) \
  do {                        \
    if (!(cond)) throw ::loom::Error(::loom::detail::cat(__VA_ARGS__)); \
  } while (0)
// The same with a specific error type: LOOM_CHECK_AS(ConfigError, cond, ...).
#define LOOM_CHECK_AS(type, cond, ...) \
  do {                                 \
    if (!(cond)) throw ::loom::type(::loom::detail::cat(__VA_ARGS__)); \
  } while (0)
#define LOOM_INTERNAL_ASSERT(cond, ...)                                                   \
  do {                                                                                    \
    if (!(cond))                                                                          \
      throw ::loom::InternalError(::loom::detail::cat(                                    \
          "internal error (a bug in loom, please report it) at ", __FILE__, ":", __LINE__, \
          ": ", #cond, " " __VA_OPT__(, ) __VA_ARGS__));                                  \
  } while (0)

#pragma GCC visibility pop
