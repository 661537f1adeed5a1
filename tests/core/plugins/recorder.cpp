// Test plugin: appends every event it sees (and each grad_ready's parameter) to a file, so
// tests can check the engine's event order. Also saves and restores a counter through
// checkpoints, to test the save/load path plugins use.
#include <fstream>

#include "loom/engine.h"
#include "loom/plugin.h"

namespace {

class Recorder final : public loom::Plugin {
 public:
  std::string name() const override { return "recorder"; }
  std::string description() const override { return "test: records events to a file"; }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("recorder");
    s.key_required("file", loom::ValueType::String, "where the events go");
    return {s};
  }
  void configure(const loom::ConfigSection& table) override { file_ = table.get_string("file"); }
  void attach(loom::Engine& engine) override {
    using loom::Event;
    for (Event e : {Event::setup, Event::model_built, Event::params_ready, Event::batch,
                    Event::before_forward, Event::after_forward, Event::before_backward,
                    Event::after_backward, Event::before_update, Event::after_update,
                    Event::step_end, Event::save, Event::load, Event::teardown}) {
      engine.on(e, [this, e](loom::Engine& en) {
        if (e == Event::save) {
          en.checkpoint().values["recorder.saves"] = std::to_string(++saves_);
        } else if (e == Event::load) {
          saves_ = std::stoi(en.checkpoint().values.at("recorder.saves"));
        }
        write(loom::to_string(e));
      });
    }
    engine.on_grad_ready([this](loom::Engine&, const loom::Param& p) {
      write("grad_ready " + p.name);
    });
  }

 private:
  void write(const std::string& line) { std::ofstream(file_, std::ios::app) << line << "\n"; }
  std::string file_;
  int saves_ = 0;
};

}  // namespace

LOOM_DEFINE_PLUGIN(Recorder, "recorder", "1.0.0")
