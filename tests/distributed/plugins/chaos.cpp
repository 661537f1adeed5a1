// Test plugin: kills its own process (SIGKILL, no goodbye) on one rank at one step, on the
// first attempt only — a machine failure, for the dead-peer and restart tests.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/plugin.h"

namespace {
class Chaos final : public loom::Plugin {
 public:
  std::string name() const override { return "chaos"; }
  std::string description() const override { return "test: kills a rank mid-run"; }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("chaos");
    s.key_int("rank", 1, "the rank that dies").key_int("step", 3, "during this step's backward");
    return {s};
  }
  void configure(const loom::ConfigSection& t) override {
    rank_ = t.get_int("rank");
    step_ = t.get_int("step");
  }
  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::before_backward, [this](loom::Engine& e) {
      const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
      const bool first_attempt = !restart || std::atoi(restart) == 0;
      if (first_attempt && e.comm().rank() == rank_ && e.state().step + 1 == step_)
        ::kill(::getpid(), SIGKILL);
    });
  }

 private:
  int64_t rank_ = 1, step_ = 3;
};
}  // namespace

LOOM_DEFINE_PLUGIN(Chaos, "chaos", "1.0.0")
