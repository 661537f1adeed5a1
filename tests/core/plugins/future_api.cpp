// Test plugin built for a future plugin API version: the host must refuse it by its version
// field alone, without touching the rest of the (here deliberately bogus) info struct.
#include <cstdint>

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
