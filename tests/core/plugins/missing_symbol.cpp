// Test plugin that needs a symbol no library provides: loading it must fail with the loader's
// message, not crash later.
#include "loom/plugin.h"

extern "C" int loom_function_that_does_not_exist(int);

namespace {
class Broken final : public loom::Plugin {
 public:
  std::string name() const override { return "missing_symbol"; }
  std::string description() const override {
    return std::to_string(loom_function_that_does_not_exist(1));
  }
};
}  // namespace

LOOM_DEFINE_PLUGIN(Broken, "missing_symbol", "1.0.0")
