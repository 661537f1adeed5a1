// Test plugin: skips every update (sets TrainState::skip_update in before_update), so a run's
// steps are its forward and backward alone: the baseline of the optimizer-in-backward
// benchmark (examples/bench/optimizer_in_backward/run.py). Not a technique anyone trains with.
#include "loom/engine.h"
#include "loom/plugin.h"

namespace {

class SkipUpdates final : public loom::Plugin {
 public:
  std::string name() const override { return "skip_updates"; }
  std::string description() const override {
    return "test: skips every update (steps of forward and backward alone)";
  }
  std::vector<loom::Schema> schemas() const override { return {loom::Schema("skip_updates")}; }
  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::before_update, [](loom::Engine& e) { e.state().skip_update = true; });
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(SkipUpdates, "skip_updates", "1.0.0")
