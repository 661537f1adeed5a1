// Test plugin: fills Slot::step_driver with a driver that wraps the core's default one and
// counts what the engine asks of it, so tests can check that a plugin's driver replaces the
// default and is driven the documented way. It reports the counts as per-step metrics. With
// keep_masters = true it builds its inner driver with fp32 masters whatever the job's
// master_dtype: a third-party driver that does not know the key, for the core's refusal.
#include <memory>

#include "loom/engine.h"
#include "loom/plugin.h"
#include "loom/step_driver.h"

namespace {

struct Counts {
  int64_t zero_grad = 0, norms = 0, updates = 0;
};

class CountingDriver final : public loom::StepDriver {
 public:
  CountingDriver(std::unique_ptr<loom::StepDriver> inner, std::shared_ptr<Counts> counts)
      : inner_(std::move(inner)), counts_(std::move(counts)) {}
  std::string name() const override { return "counting(" + inner_->name() + ")"; }
  void zero_grad() override {
    ++counts_->zero_grad;
    inner_->zero_grad();
  }
  at::Tensor grad_norm_squared() override {
    ++counts_->norms;
    return inner_->grad_norm_squared();
  }
  void scale_grads(double factor) override { inner_->scale_grads(factor); }
  std::vector<at::Tensor> grads() override { return inner_->grads(); }
  void update(int64_t step, double lr) override {
    ++counts_->updates;
    inner_->update(step, lr);
  }
  loom::StatePieces state_pieces() const override { return inner_->state_pieces(); }
  void load_state(loom::StateReader& reader) override {
    inner_->load_state(reader);
  }
  int64_t state_bytes() const override { return inner_->state_bytes(); }
  int64_t master_bytes() const override { return inner_->master_bytes(); }

 private:
  std::unique_ptr<loom::StepDriver> inner_;
  std::shared_ptr<Counts> counts_;
};

class CountingDriverPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "counting_driver"; }
  std::string description() const override { return "test: a step driver that counts calls"; }
  std::vector<loom::Slot> slots() const override { return {loom::Slot::step_driver}; }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("counting_driver");
    s.key_bool("keep_masters", false, "keep fp32 masters whatever [optimizer] master_dtype says");
    s.key_bool("says_no_masters", true, "what keeps_no_masters() answers (true even when "
                                        "keep_masters: the core's check once the driver is made)");
    return {s};
  }
  void configure(const loom::ConfigSection& t) override { keep_masters_ = t.get_bool("keep_masters"); }
  bool keeps_no_masters(const loom::ConfigSection& t) const override {
    return t.get_bool("says_no_masters");
  }
  std::unique_ptr<loom::StepDriver> create_step_driver(const loom::StepDriverOptions& options,
                                                       loom::Engine&) override {
    loom::StepDriverOptions inner = options;
    if (keep_masters_) inner.master_dtype = "fp32";
    return std::make_unique<CountingDriver>(loom::make_default_step_driver(inner), counts_);
  }
  void attach(loom::Engine& engine) override {
    // after_update: the engine writes a step's metrics right after it.
    engine.on(loom::Event::after_update, [this](loom::Engine& e) {
      auto& metrics = e.state().metrics;
      metrics.emplace_back("driver_zero_grad", static_cast<double>(counts_->zero_grad));
      metrics.emplace_back("driver_norms", static_cast<double>(counts_->norms));
      metrics.emplace_back("driver_updates", static_cast<double>(counts_->updates));
    });
  }

 private:
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
  bool keep_masters_ = false;
};

}  // namespace

LOOM_DEFINE_PLUGIN(CountingDriverPlugin, "counting_driver", "1.0.0")
