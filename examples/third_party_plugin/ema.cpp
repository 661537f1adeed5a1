// A third-party technique, and the template to copy: an exponential moving average of the
// weights (Polyak averaging). After every update, ema = decay * ema + (1 - decay) * weight, in
// fp32; the first update copies the weights, as torch.optim.swa_utils.AveragedModel does. The
// average is checkpointed with the run (so a resume continues it) and written at the end as
// OUTPUT_DIR/ema.safetensors, by the model's parameter names (Python's safetensors reads it).
// One table, four events, one checkpoint file: the plugin surface a technique needs.
// Only the headers it uses: <ATen/ATen.h> (every operator's declaration) would make this
// file's compile 2.5x as long (14 s of CPU instead of 5.6 s on the 2-core test machine).
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

#include <map>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/log.h"
#include "loom/plugin.h"
#include "loom/safetensors.h"

namespace {

class Ema final : public loom::Plugin {
 public:
  std::string name() const override { return "ema"; }
  std::string description() const override {
    return "exponential moving average of the weights (ema.safetensors)";
  }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema table("ema");
    table.key_float("decay", 0.999, "ema = decay * ema + (1 - decay) * weight, after each update");
    return {table};
  }
  void configure(const loom::ConfigSection& table) override {
    decay_ = table.get_float("decay");
    LOOM_CHECK_AS(ConfigError, decay_ >= 0 && decay_ < 1, table.where("decay"),
                  ": [ema] decay must be in [0, 1), got ", decay_);
  }
  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::after_update, [this](loom::Engine& e) {
      at::NoGradGuard no_grad;
      for (const auto& p : e.params()) {
        at::Tensor weight = p.tensor.detach().to(at::kFloat);
        auto it = average_.find(p.name);
        if (it == average_.end()) average_.emplace(p.name, weight.clone());
        else it->second.mul_(decay_).add_(weight, 1.0 - decay_);
      }
    });
    engine.on(loom::Event::save, [this](loom::Engine& e) {
      auto& file = e.checkpoint().files["ema"];
      for (const auto& [name, tensor] : average_) file.emplace_back(name, tensor.cpu());
    });
    engine.on(loom::Event::load, [this](loom::Engine& e) {
      average_.clear();
      auto it = e.checkpoint().files.find("ema");
      if (it == e.checkpoint().files.end()) return;  // saved without [ema]: start afresh
      for (const auto& [name, tensor] : it->second)
        average_.emplace(name, tensor.to(e.device()));
    });
    engine.on(loom::Event::teardown, [this](loom::Engine& e) {
      // Only a run that reached its end writes the average (teardown follows errors too).
      if (e.state().step < e.state().max_steps || average_.empty() || e.comm().rank() != 0) return;
      const std::string out = e.resolve_path(e.section("train").get_string("output_dir"));
      loom::NamedTensors tensors;
      for (const auto& [name, tensor] : average_) tensors.emplace_back(name, tensor.cpu());
      loom::safetensors::save(out + "/ema.safetensors", tensors);
      loom::log::info("[ema] wrote ", out, "/ema.safetensors (decay ", decay_, ")");
    });
  }

 private:
  double decay_ = 0.999;
  std::map<std::string, at::Tensor> average_;
};

}  // namespace

LOOM_DEFINE_PLUGIN(Ema, "ema", "1.0.0")
