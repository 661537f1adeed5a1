// Test plugin that claims to be built against another LibTorch and C++ ABI (old_torch), or,
// with OTHER_SDK defined, against this LibTorch but other SDK headers (Note [SDK digest]): the
// host must refuse it by its ABI record, naming both builds, before loading it (its static
// initialiser would end the test process).
#include <cstdio>
#include <cstdlib>

#include "loom/plugin.h"

#ifdef OTHER_SDK
#define PLUGIN_NAME "other_sdk"
#define OLD_BUILD                                                                          \
  "torch=" LOOM_STR(TORCH_VERSION_MAJOR) "." LOOM_STR(TORCH_VERSION_MINOR) "." LOOM_STR(  \
      TORCH_VERSION_PATCH) " cxx11abi=" LOOM_STR(_GLIBCXX_USE_CXX11_ABI) " device="         \
      LOOM_BUILD_CUDA " sdk=0123456789abcdef compiler=gcc-" __VERSION__
#else
#define PLUGIN_NAME "old_torch"
#define OLD_BUILD "torch=1.13.1 cxx11abi=0 device=cpu compiler=gcc-9.4.0"
#endif
LOOM_DEFINE_ABI_RECORD(LOOM_PLUGIN_API_VERSION, OLD_BUILD)

namespace {
const int kLoud = [] {
  std::fputs(PLUGIN_NAME ": the host loaded a plugin of another build\n", stderr);
  std::abort();
  return 0;
}();

class Old final : public loom::Plugin {
 public:
  std::string name() const override { return PLUGIN_NAME; }
  std::string description() const override { return "test: wrong build"; }
};
}  // namespace

extern "C" LOOM_PLUGIN_EXPORT const loom_plugin_info* loom_plugin_entry() {
  static const loom_plugin_info info{
      LOOM_PLUGIN_API_VERSION, PLUGIN_NAME, "1.0.0", OLD_BUILD,
      []() -> loom::Plugin* { return new Old(); }, [](loom::Plugin* p) { delete p; }};
  return &info;
}
