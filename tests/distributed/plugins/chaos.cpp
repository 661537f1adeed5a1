// Test plugin: kills its own process (SIGKILL, no goodbye) on one rank at one step, on the
// first attempt only — a machine failure, for the dead-peer and restart tests; with
// mode = "skip_unit", makes that rank skip one unit's forward at that step — a diverged rank;
// with mode = "sigterm", sends SIGTERM to its own process during that step's backward — a
// pre-emption at a known step (Note [Graceful stop]); with mode = "skip_collective", every rank
// all-gathers 3 int64 values at each step's end except that rank at that step — a collective
// skipped on one rank (Note [Hang reports]).
#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cstdlib>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/nn.h"
#include "loom/plugin.h"

namespace {
// Runs unit `unit` as the identity on one rank at one step (its forward skipped).
class SkipUnit final : public loom::nn::UnitInterceptor {
 public:
  SkipUnit(loom::Engine& engine, int64_t rank, int64_t step, int64_t unit)
      : engine_(engine), rank_(rank), step_(step), unit_(unit) {}
  std::string name() const override { return "chaos-skip"; }
  at::Tensor intercept(int64_t index, loom::nn::Unit&, const at::Tensor& x,
                       const loom::nn::UnitFn& next) override {
    if (index == unit_ && engine_.comm().rank() == rank_ && engine_.state().step + 1 == step_)
      return x;
    return next(x);
  }

 private:
  loom::Engine& engine_;
  int64_t rank_, step_, unit_;
};

class Chaos final : public loom::Plugin {
 public:
  std::string name() const override { return "chaos"; }
  std::string description() const override { return "test: kills a rank mid-run"; }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("chaos");
    s.key_int("rank", 1, "the rank that dies").key_int("step", 3, "during this step's backward")
        .key_string("mode", "kill",
                    "kill: SIGKILL the rank; skip_unit: it skips a unit's forward; sigterm: "
                    "SIGTERM to the rank; skip_collective: it skips the step-end all_gather "
                    "the other ranks make")
        .key_int("unit", 1, "skip_unit: the unit's index");
    return {s};
  }
  void configure(const loom::ConfigSection& t) override {
    rank_ = t.get_int("rank");
    step_ = t.get_int("step");
    mode_ = t.get_string("mode");
    unit_ = t.get_int("unit");
  }
  void attach(loom::Engine& engine) override {
    if (mode_ == "skip_unit") {
      engine.add_unit_interceptor(std::make_shared<SkipUnit>(engine, rank_, step_, unit_));
      return;
    }
    if (mode_ == "skip_collective") {
      engine.on(loom::Event::step_end, [this](loom::Engine& e) {
        // state().step counts finished steps: at step_end of step S it is S.
        if (e.comm().rank() == rank_ && e.state().step == step_) return;
        at::Tensor mine = at::full({3}, e.state().step, at::kLong).to(e.comm().device());
        at::Tensor all = at::empty({3 * e.comm().world_size()}, mine.options());
        e.comm().all_gather(all, mine)->wait();
      });
      return;
    }
    engine.on(loom::Event::before_backward, [this](loom::Engine& e) {
      const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
      const bool first_attempt = !restart || std::atoi(restart) == 0;
      if (first_attempt && e.comm().rank() == rank_ && e.state().step + 1 == step_)
        ::kill(::getpid(), mode_ == "sigterm" ? SIGTERM : SIGKILL);
    });
  }

 private:
  int64_t rank_ = 1, step_ = 3, unit_ = 1;
  std::string mode_ = "kill";
};
}  // namespace

LOOM_DEFINE_PLUGIN(Chaos, "chaos", "1.0.0")
