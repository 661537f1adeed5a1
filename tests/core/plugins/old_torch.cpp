// Test plugin that claims to be built against another LibTorch and C++ ABI: the host must
// refuse it after the API version check, naming both builds.
#include "loom/plugin.h"

namespace {
class Old final : public loom::Plugin {
 public:
  std::string name() const override { return "old_torch"; }
  std::string description() const override { return "test: wrong build"; }
};
}  // namespace

extern "C" LOOM_PLUGIN_EXPORT const loom_plugin_info* loom_plugin_entry() {
  static const loom_plugin_info info{
      LOOM_PLUGIN_API_VERSION, "old_torch", "1.0.0",
      "torch=1.13.1 cxx11abi=0 device=cpu compiler=gcc-9.4.0",
      []() -> loom::Plugin* { return new Old(); }, [](loom::Plugin* p) { delete p; }};
  return &info;
}
