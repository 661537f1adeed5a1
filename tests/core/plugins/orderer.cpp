// Test plugin, built several times with ORDER_NAME and comma-separated ORDER_AFTER and
// ORDER_BEFORE: its Plugin::order() (Note [Plugin order]). Each records its attach in the
// process-wide list below, so a test sees the order the host chose.
#include <cstdlib>
#include <sstream>

#include "loom/engine.h"
#include "loom/plugin.h"

namespace {
std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

class Orderer final : public loom::Plugin {
 public:
  std::string name() const override { return ORDER_NAME; }
  std::string description() const override { return "test: declares an order"; }
  std::vector<loom::Schema> schemas() const override { return {loom::Schema(ORDER_NAME)}; }
  Order order() const override { return {split(ORDER_AFTER), split(ORDER_BEFORE)}; }
  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::setup, [](loom::Engine&) {
      // The environment is the one place every test plugin of the process shares.
      const char* seen = std::getenv("LOOM_TEST_ORDER");
      const std::string now = std::string(seen ? seen : "") + ORDER_NAME + " ";
      setenv("LOOM_TEST_ORDER", now.c_str(), 1);
    });
  }
};
}  // namespace

LOOM_DEFINE_PLUGIN(Orderer, ORDER_NAME, "1.0.0")
