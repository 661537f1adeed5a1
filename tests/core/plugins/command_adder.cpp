// Test plugin, built three times into folders of their own (command clashes must not reach
// the other tests' plugin folder): greet_a and greet_b both add the command "greet", own_run
// adds "estimate", one of loom's own.
#include "loom/plugin.h"

namespace {
class CommandAdder final : public loom::Plugin {
 public:
  std::string name() const override { return ADDER_NAME; }
  std::string description() const override { return "test: adds the command " COMMAND_NAME; }
  std::vector<loom::Schema> schemas() const override { return {loom::Schema(ADDER_NAME)}; }
  std::vector<loom::Command> commands() const override {
    return {{COMMAND_NAME, COMMAND_NAME "   a test plugin's command",
             [](const std::vector<std::string>&) { return 0; }}};
  }
};
}  // namespace

LOOM_DEFINE_PLUGIN(CommandAdder, ADDER_NAME, "1.0.0")
