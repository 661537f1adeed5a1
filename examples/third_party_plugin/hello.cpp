// A third-party plugin: logs a greeting every N steps and counts them into metrics.jsonl, and
// adds the command `loom hello [NAME]`. It shows the smallest plugin surface: a table, a
// handler, a metric, a command.
#include "loom/engine.h"
#include "loom/log.h"
#include "loom/plugin.h"

#include <iostream>

namespace {

class Hello final : public loom::Plugin {
 public:
  std::string name() const override { return "hello"; }
  std::string description() const override { return "says hello every N steps"; }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema table("hello");
    table.key_int("every", 10, "steps between greetings");
    return {table};
  }
  std::vector<loom::Command> commands() const override {
    return {{"hello", "hello [NAME]   greets NAME (a plugin's command)",
             [](const std::vector<std::string>& args) {
               if (args.size() > 1)
                 throw loom::ConfigError("loom hello takes one name at most, got " +
                                         std::to_string(args.size()));
               std::cout << "hello, " << (args.empty() ? "world" : args[0])
                         << ", from a plugin command\n";
               return 0;
             }}};
  }
  void configure(const loom::ConfigSection& table) override {
    every_ = table.get_int("every");
    LOOM_CHECK_AS(ConfigError, every_ > 0, table.where("every"),
                  ": [hello] every must be positive, got ", every_);
  }
  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::after_update, [this](loom::Engine& e) {
      if (e.state().step % every_ != 0) return;
      ++greetings_;
      loom::log::info("hello from a third-party plugin at step ", e.state().step);
      e.state().metrics.emplace_back("hello_greetings", static_cast<double>(greetings_));
    });
  }

 private:
  int64_t every_ = 10, greetings_ = 0;
};

}  // namespace

LOOM_DEFINE_PLUGIN(Hello, "hello", "1.0.0")
