// The `checkpointing` plugin: activation (gradient) checkpointing of the units of every
// loom::nn::UnitList. A chosen unit runs forward without keeping its internal activations and is
// recomputed in backward by one autograd node. Not a selective (attention-only) recompute: the
// core's Attention has no interception point yet (see the policy keys).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "loom/engine.h"
#include "loom/log.h"
#include "loom/nn.h"
#include "loom/plugin.h"

namespace {

using torch::autograd::variable_list;

// The random-number state the unit's forward draws from (dropout), so the recompute draws the
// same masks. The CPU generator always; the unit's device generator too when it is not the CPU.
struct RngState {
  at::Tensor cpu, device;
  c10::Device device_id{c10::kCPU};

  static at::Generator generator(c10::Device device) {
    return at::globalContext().defaultGenerator(device);
  }
  static at::Tensor get(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  }
  static void set(at::Generator generator, const at::Tensor& state) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
  static RngState capture(c10::Device device) {
    RngState s;
    s.device_id = device;
    s.cpu = get(generator(c10::Device(c10::kCPU)));
    if (!device.is_cpu()) s.device = get(generator(device));
    return s;
  }
  void restore() const {
    set(generator(c10::Device(c10::kCPU)), cpu);
    if (device.defined()) set(generator(device_id), device);
  }
};

// Autocast as the forward saw it, for the CPU and the unit's device.
struct AutocastState {
  struct One {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<One> devices;
  bool cache_enabled = true;

  static AutocastState capture(c10::DeviceType device_type) {
    AutocastState s;
    for (c10::DeviceType type : {c10::DeviceType::CPU, device_type}) {
      if (!s.devices.empty() && type == c10::DeviceType::CPU) continue;
      s.devices.push_back({type, at::autocast::is_autocast_enabled(type),
                           at::autocast::get_autocast_dtype(type)});
    }
    s.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void apply() const {
    for (const auto& one : devices) {
      at::autocast::set_autocast_enabled(one.type, one.enabled);
      at::autocast::set_autocast_dtype(one.type, one.dtype);
    }
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

// Note [No autocast cache around a checkpointed unit]: autocast caches the low-precision copy
// of a weight, keyed by the weight, until the outermost autocast region ends. A copy cast under
// the no-grad forward has no history, and one cast in the recompute would outlive this backward
// (stale after the update). So both runs cast afresh; a cast gives the same values either way.
class NoAutocastCache {
 public:
  NoAutocastCache() : was_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(was_); }

 private:
  bool was_;
};

// The backward of one checkpointed unit: reruns the unit's forward (same input, RNG and
// autocast state) with grad enabled and backpropagates through that. Its inputs in the graph
// are the unit's input (when it requires grad) and every trainable parameter of the unit, so
// the parameters get their gradients even when the input is a constant (frozen embeddings).
class RecomputeUnit final : public torch::autograd::Node {
 public:
  RecomputeUnit(loom::nn::UnitFn run, at::Tensor input, bool input_needs_grad,
                std::vector<at::Tensor> params, RngState rng, AutocastState autocast,
                int64_t index)
      : run_(std::move(run)), input_(std::move(input)), input_version_(input_._version()),
        input_needs_grad_(input_needs_grad), params_(std::move(params)), rng_(std::move(rng)),
        autocast_(std::move(autocast)), index_(index) {}

  std::string name() const override { return "loom::RecomputeUnit"; }

  // grads[0] is the gradient of the unit's output; returns one gradient per next edge: the
  // input's (when it needs one), then each parameter's.
  variable_list apply(variable_list&& grads) override {
    LOOM_CHECK(run_, "checkpointed unit ", index_,
               ": backward ran twice through one forward; checkpointing keeps no graph to "
               "retain (retain_graph is not supported with [checkpointing])");
    LOOM_CHECK(input_._version() == input_version_, "checkpointed unit ", index_,
               ": its input was modified in place after the forward, so it cannot be "
               "recomputed; do not change a unit's input in place");
    const size_t n_out = (input_needs_grad_ ? 1 : 0) + params_.size();
    if (!grads[0].defined()) return variable_list(n_out);

    // Recompute with the forward's RNG and autocast state; put back what backward had.
    const RngState backward_rng = RngState::capture(rng_.device_id);
    const AutocastState backward_autocast =
        AutocastState::capture(autocast_.devices.back().type);
    variable_list result;
    try {
      rng_.restore();
      at::AutoGradMode grad_on(true);
      at::Tensor input = input_.detach();
      input.requires_grad_(input_needs_grad_);
      at::Tensor output;
      {
        // Only the forward repeats under the forward's autocast; its backward runs under the
        // backward's state, as the plain run's does (autocast would recast backward's ops).
        autocast_.apply();
        NoAutocastCache no_cache;
        output = run_(input);
      }
      backward_autocast.apply();
      variable_list wrt;
      if (input_needs_grad_) wrt.push_back(input);
      wrt.insert(wrt.end(), params_.begin(), params_.end());
      result = torch::autograd::grad({output}, wrt, {grads[0]}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
    } catch (...) {
      backward_rng.restore();
      backward_autocast.apply();
      throw;
    }
    backward_rng.restore();
    backward_autocast.apply();
    release_variables();
    return result;
  }

  void release_variables() override {
    run_ = nullptr;
    input_.reset();
    params_.clear();
  }

 private:
  loom::nn::UnitFn run_;
  at::Tensor input_;
  uint32_t input_version_;
  bool input_needs_grad_;
  std::vector<at::Tensor> params_;
  RngState rng_;
  AutocastState autocast_;
  int64_t index_;
};

class Checkpointer final : public loom::nn::UnitInterceptor {
 public:
  explicit Checkpointer(std::function<bool(int64_t)> chosen) : chosen_(std::move(chosen)) {}
  std::string name() const override { return "checkpointing"; }

  // x is the unit's input (B,T,C); returns its output, whose grad_fn is a RecomputeUnit.
  at::Tensor intercept(int64_t index, loom::nn::Unit& unit, const at::Tensor& x,
                       const loom::nn::UnitFn& next) override {
    if (!chosen_(index) || !at::GradMode::is_enabled()) return next(x);
    std::vector<at::Tensor> params;
    for (const auto& p : unit.parameters(/*recurse=*/true))
      if (p.requires_grad()) params.push_back(p);
    const bool input_needs_grad = x.requires_grad();
    if (params.empty() && !input_needs_grad) return next(x);

    RngState rng = RngState::capture(x.device());
    AutocastState autocast = AutocastState::capture(x.device().type());
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      NoAutocastCache no_cache;
      y = next(x);
    }
    // A view would share its base's autograd identity; give the node an output of its own.
    if (y.is_view() || y.is_same(x)) y = y.clone();
    // The node's next edges, in the order its apply() returns gradients.
    torch::autograd::edge_list edges;
    if (input_needs_grad) edges.push_back(torch::autograd::impl::gradient_edge(x));
    for (const auto& p : params) edges.push_back(torch::autograd::impl::gradient_edge(p));
    auto node = std::make_shared<RecomputeUnit>(next, x.detach(), input_needs_grad,
                                                std::move(params), std::move(rng),
                                                std::move(autocast), index);
    node->set_next_edges(std::move(edges));
    torch::autograd::set_history(y, node);
    return y;
  }

 private:
  std::function<bool(int64_t)> chosen_;
};

class CheckpointingPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "checkpointing"; }
  std::string description() const override {
    return "activation checkpointing: recompute the units of loom::nn::UnitList in backward "
           "instead of keeping their activations";
  }
  std::vector<loom::Schema> schemas() const override {
    return {loom::Schema("checkpointing")
                .key_int("every", 1,
                         "checkpoint every k-th unit (units 0, k, 2k, ...); 1 = every unit")
                .key_optional("units", loom::ValueType::Array,
                              "explicit unit indices to checkpoint (instead of every)")
                .key_bool("enabled", true, "false keeps the table but checkpoints nothing")};
  }

  void configure(const loom::ConfigSection& table) override {
    enabled_ = table.get_bool("enabled");
    every_ = table.get_int("every");
    LOOM_CHECK_AS(ConfigError, every_ > 0, table.where("every"),
                  ": [checkpointing] every must be >= 1 (1 = every unit, 2 = every 2nd), got ",
                  every_);
    units_.reset();
    if (const loom::ConfigValue* list = table.get("units")) {
      LOOM_CHECK_AS(ConfigError, !table.has("every"), table.where("units"),
                    ": [checkpointing] set either units or every, not both");
      std::set<int64_t> chosen;
      for (const auto& item : std::get<loom::ConfigArray>(list->value)) {
        const auto* index = std::get_if<int64_t>(&item.value);
        LOOM_CHECK_AS(ConfigError, index && *index >= 0, table.where("units"),
                      ": [checkpointing] units must list unit indices (integers >= 0), got ",
                      item.to_text());
        LOOM_CHECK_AS(ConfigError, chosen.insert(*index).second, table.where("units"),
                      ": [checkpointing] units lists unit ", *index, " twice");
      }
      LOOM_CHECK_AS(ConfigError, !chosen.empty(), table.where("units"),
                    ": [checkpointing] units is empty; list unit indices, or drop the key to "
                    "checkpoint every unit");
      units_ = std::move(chosen);
    }
    where_units_ = table.where("units");
  }

  void attach(loom::Engine& engine) override {
    if (!enabled_) return;
    engine.add_unit_interceptor(std::make_shared<Checkpointer>([this](int64_t index) {
      return units_ ? units_->count(index) > 0 : index % every_ == 0;
    }));
    engine.on(loom::Event::model_built, [this](loom::Engine& e) { check_model(e); });
  }

 private:
  void check_model(loom::Engine& engine) {
    const std::string model = engine.section("train").get_string("model");
    const auto lists = engine.unit_lists();
    LOOM_CHECK_AS(ConfigError, !lists.empty(), "[checkpointing]: model '", model,
                  "' has no loom::nn::UnitList, so there is nothing to checkpoint; remove "
                  "[checkpointing], or build the model's repeated layers as a "
                  "loom::nn::UnitList");
    size_t fewest = lists.front()->size();
    for (auto* list : lists) fewest = std::min(fewest, list->size());
    if (units_) {
      const int64_t last = *units_->rbegin();
      LOOM_CHECK_AS(ConfigError, last < static_cast<int64_t>(fewest), where_units_,
                    ": [checkpointing] units names unit ", last, " but model '", model,
                    "' has ", fewest, " units (0..", static_cast<int64_t>(fewest) - 1,
                    "); list existing indices");
    }
    int64_t chosen = 0;
    for (size_t i = 0; i < fewest; ++i)
      chosen += units_ ? units_->count(static_cast<int64_t>(i)) : (i % every_ == 0);
    loom::log::info("checkpointing: ", chosen, " of ", fewest, " units of each of ", lists.size(),
                    " unit list(s) recomputed in backward");
  }

  bool enabled_ = true;
  int64_t every_ = 1;
  std::optional<std::set<int64_t>> units_;
  std::string where_units_;
};

}  // namespace

LOOM_DEFINE_PLUGIN(CheckpointingPlugin, "checkpointing", "1.0.0")
