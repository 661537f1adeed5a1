// Test plugin that claims to be built against another LibTorch and C++ ABI: the host must
// refuse it by its ABI record, naming both builds, before loading it (its static initialiser
// would end the test process).
#include <cstdio>
#include <cstdlib>

#include "loom/plugin.h"

#define OLD_BUILD "torch=1.13.1 cxx11abi=0 device=cpu compiler=gcc-9.4.0"
LOOM_DEFINE_ABI_RECORD(LOOM_PLUGIN_API_VERSION, OLD_BUILD)

namespace {
const int kLoud = [] {
  std::fputs("old_torch: the host loaded a plugin of another build\n", stderr);
  std::abort();
  return 0;
}();

class Old final : public loom::Plugin {
 public:
  std::string name() const override { return "old_torch"; }
  std::string description() const override { return "test: wrong build"; }
};
}  // namespace

extern "C" LOOM_PLUGIN_EXPORT const loom_plugin_info* loom_plugin_entry() {
  static const loom_plugin_info info{
      LOOM_PLUGIN_API_VERSION, "old_torch", "1.0.0", OLD_BUILD,
      []() -> loom::Plugin* { return new Old(); }, [](loom::Plugin* p) { delete p; }};
  return &info;
}
