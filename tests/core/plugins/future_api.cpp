// Test plugin built for a future plugin API version: the host must refuse it by its ABI record
// (Note [ABI record]) before loading it: were the library loaded, its static initialiser would
// end the test process at once. Its entry point, too, is deliberately bogus.
#include <cstdio>
#include <cstdlib>

#include "loom/plugin.h"

LOOM_DEFINE_ABI_RECORD(999u, LOOM_BUILD_STRING)

namespace {
const int kLoud = [] {
  std::fputs("future_api: the host loaded a plugin of another API version\n", stderr);
  std::abort();
  return 0;
}();
}  // namespace

extern "C" {
struct future_plugin_info {
  uint32_t api_version;
  const char* bogus;
};
__attribute__((visibility("default"))) const future_plugin_info* loom_plugin_entry() {
  static const future_plugin_info info{999u, nullptr};
  return &info;
}
}
