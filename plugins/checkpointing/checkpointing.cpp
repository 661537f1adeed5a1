// The `checkpointing` plugin: activation (gradient) checkpointing of the units of every
// loom::nn::UnitList. A chosen unit, or with a selective policy only its attention core or its
// MLP (Note [Recompute policies]), runs forward without keeping its internal activations and is
// recomputed in backward by one autograd node; with a whole-unit policy the units not chosen
// may recompute one region instead (`others`).
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

// The backward of one checkpointed unit or region (Note [Recompute regions]): reruns its
// forward (same inputs, RNG and autocast state) with grad enabled and backpropagates through
// that. Its inputs in the graph are the inputs that require grad and every trainable parameter
// it uses, so the parameters get their gradients even when no input requires grad (frozen
// embeddings).
class Recompute final : public torch::autograd::Node {
 public:
  Recompute(loom::nn::RegionFn run, std::vector<at::Tensor> inputs, std::vector<bool> needs_grad,
            std::vector<at::Tensor> params, RngState rng, AutocastState autocast,
            std::string what)
      : run_(std::move(run)), inputs_(std::move(inputs)), needs_grad_(std::move(needs_grad)),
        params_(std::move(params)), rng_(std::move(rng)), autocast_(std::move(autocast)),
        what_(std::move(what)) {
    for (const auto& input : inputs_) versions_.push_back(input._version());
  }

  std::string name() const override { return "loom::Recompute"; }

  // grads[0] is the gradient of the output; returns one gradient per next edge: each input's
  // that needs one, then each parameter's.
  variable_list apply(variable_list&& grads) override {
    LOOM_CHECK(run_, what_,
               ": backward ran twice through one forward; checkpointing keeps no graph to "
               "retain (retain_graph is not supported with [checkpointing])");
    for (size_t i = 0; i < inputs_.size(); ++i)
      LOOM_CHECK(inputs_[i]._version() == versions_[i], what_,
                 ": its input was modified in place after the forward, so it cannot be "
                 "recomputed; do not change a checkpointed input in place");
    size_t n_out = params_.size();
    for (bool needs : needs_grad_) n_out += needs;
    if (!grads[0].defined()) return variable_list(n_out);

    // Recompute with the forward's RNG and autocast state; put back what backward had.
    const RngState backward_rng = RngState::capture(rng_.device_id);
    const AutocastState backward_autocast =
        AutocastState::capture(autocast_.devices.back().type);
    variable_list result;
    try {
      rng_.restore();
      at::AutoGradMode grad_on(true);
      std::vector<at::Tensor> inputs;
      variable_list wrt;
      for (size_t i = 0; i < inputs_.size(); ++i) {
        inputs.push_back(inputs_[i].detach());
        inputs.back().requires_grad_(needs_grad_[i]);
        if (needs_grad_[i]) wrt.push_back(inputs.back());
      }
      at::Tensor output;
      {
        // Only the forward repeats under the forward's autocast; its backward runs under the
        // backward's state, as the plain run's does (autocast would recast backward's ops).
        autocast_.apply();
        NoAutocastCache no_cache;
        output = run_(inputs);
      }
      backward_autocast.apply();
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
    inputs_.clear();
    params_.clear();
  }

 private:
  loom::nn::RegionFn run_;
  std::vector<at::Tensor> inputs_;
  std::vector<uint32_t> versions_;
  std::vector<bool> needs_grad_;
  std::vector<at::Tensor> params_;
  RngState rng_;
  AutocastState autocast_;
  std::string what_;  // "checkpointed unit 3", "the attention of checkpointed unit 3"
};

// Runs `run` on `inputs` without keeping its activations; the output's grad_fn recomputes it.
// `params`: the trainable parameters `run` uses. Runs it plainly when nothing needs a gradient.
at::Tensor run_checkpointed(const loom::nn::RegionFn& run, const std::vector<at::Tensor>& inputs,
                            std::vector<at::Tensor> params, std::string what) {
  std::vector<bool> needs_grad;
  bool any = !params.empty();
  for (const auto& input : inputs) {
    needs_grad.push_back(input.requires_grad());
    any = any || input.requires_grad();
  }
  if (!any) return run(inputs);
  const c10::Device device = inputs.front().device();
  RngState rng = RngState::capture(device);
  AutocastState autocast = AutocastState::capture(device.type());
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    NoAutocastCache no_cache;
    y = run(inputs);
  }
  // A view would share its base's autograd identity; give the node an output of its own.
  bool aliases_input = y.is_view();
  for (const auto& input : inputs) aliases_input = aliases_input || y.is_same(input);
  if (aliases_input) y = y.clone();
  // The node's next edges, in the order its apply() returns gradients.
  torch::autograd::edge_list edges;
  std::vector<at::Tensor> kept;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (needs_grad[i]) edges.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    kept.push_back(inputs[i].detach());
  }
  for (const auto& p : params) edges.push_back(torch::autograd::impl::gradient_edge(p));
  auto node = std::make_shared<Recompute>(run, std::move(kept), std::move(needs_grad),
                                          std::move(params), std::move(rng), std::move(autocast),
                                          std::move(what));
  node->set_next_edges(std::move(edges));
  torch::autograd::set_history(y, node);
  return y;
}

std::vector<at::Tensor> trainable(const torch::nn::Module& module) {
  std::vector<at::Tensor> params;
  for (const auto& p : module.parameters(/*recurse=*/true))
    if (p.requires_grad()) params.push_back(p);
  return params;
}

// Note [Recompute policies]: what a chosen unit recomputes in backward.
//   full, every_n: the whole unit (every_n names the case of every N-th unit, N = `every`).
//   attention: its attention core (Note [Recompute regions]): the (B,H,T,T) scores,
//     probabilities and dropout masks of the math kernel are its largest activations.
//   mlp: its MLP: the (B,T,4C) hidden activations before and after the nonlinearity.
// A selective policy keeps the rest of the unit's activations, so it saves less than full
// but recomputes less: no projections (attention) or no attention (mlp).
// The units are chosen by `every` (0, k, 2k, ...), `units` (listed) or `first` (0..N-1, as
// Megatron's recompute_num_layers with its block method); one of the three at most.
// `others` (attention or mlp) is what the units a whole-unit policy does not choose recompute:
// per unit, full buys the most memory for its time and attention the most for its time (on
// GPT-2 124M's shape, seq 256: full ~82 MiB a unit for ~2.1 % of a step, attention ~38 MiB for
// ~0.25 %), so full on some units plus attention on the rest reaches cuts (-60 %) that neither
// reaches alone at the same time (docs/BENCHMARKS.md "Recompute policies"). With a selective
// policy the other units recompute nothing: `others` is refused there, as it is where the
// chosen units are every unit (it would do nothing).
enum class Policy { full, every_n, attention, mlp };
constexpr const char* kPolicies = "full, attention, mlp, every_n";
// What one unit recomputes: all of it, one region of it, or nothing.
enum class Part { nothing, unit, attention, mlp };
constexpr const char* kOthers = "none, attention, mlp";

class Checkpointer final : public loom::nn::UnitInterceptor {
 public:
  explicit Checkpointer(std::function<Part(int64_t)> part_of) : part_of_(std::move(part_of)) {}
  std::string name() const override { return "checkpointing"; }

  // x is the unit's input (B,T,C); returns its output, whose grad_fn is a Recompute.
  at::Tensor intercept(int64_t index, loom::nn::Unit& unit, const at::Tensor& x,
                       const loom::nn::UnitFn& next) override {
    if (part_of_(index) != Part::unit || !at::GradMode::is_enabled()) return next(x);
    return run_checkpointed([next](const std::vector<at::Tensor>& in) { return next(in[0]); },
                            {x}, trainable(unit),
                            "checkpointed unit " + std::to_string(index));
  }

  at::Tensor intercept_region(int64_t index, const loom::nn::RegionCall& call,
                              const loom::nn::RegionFn& next) override {
    const Part part = part_of_(index);
    const bool wanted = (part == Part::attention && call.region == loom::nn::Region::attention) ||
                        (part == Part::mlp && call.region == loom::nn::Region::mlp);
    if (!wanted || !at::GradMode::is_enabled() || call.inputs.empty())
      return next(call.inputs);
    ++regions_seen_;
    return run_checkpointed(next, call.inputs,
                            call.owner ? trainable(*call.owner) : std::vector<at::Tensor>{},
                            std::string("the ") + loom::nn::to_string(call.region) +
                                " of checkpointed unit " + std::to_string(index));
  }

  int64_t regions_seen() const { return regions_seen_; }

 private:
  std::function<Part(int64_t)> part_of_;
  int64_t regions_seen_ = 0;
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
                .key_string("policy", "full",
                            "what a chosen unit recomputes in backward: full (the whole "
                            "unit), attention (its attention core: scores, softmax, attention "
                            "dropout), mlp (its MLP), every_n (the whole of every N-th unit; "
                            "needs every = N >= 2)")
                .key_int("every", 1,
                         "checkpoint every k-th unit (units 0, k, 2k, ...); 1 = every unit")
                .key_optional("units", loom::ValueType::Array,
                              "explicit unit indices to checkpoint (instead of every)")
                .key_int("first", 0,
                         "checkpoint units 0..N-1 (instead of every or units); 0 = not used")
                .key_string("others", "none",
                            "with policy full or every_n: what the units not chosen "
                            "recompute: none, attention (their attention core) or mlp")
                .key_bool("enabled", true, "false keeps the table but checkpoints nothing")};
  }

  void configure(const loom::ConfigSection& table) override {
    enabled_ = table.get_bool("enabled");
    const std::string policy = table.get_string("policy");
    if (policy == "full") policy_ = Policy::full;
    else if (policy == "attention") policy_ = Policy::attention;
    else if (policy == "mlp") policy_ = Policy::mlp;
    else if (policy == "every_n") policy_ = Policy::every_n;
    else
      throw loom::ConfigError(loom::detail::cat(
          table.where("policy"), ": [checkpointing] policy '", policy, "' is unknown; the "
          "policies are ", kPolicies));
    policy_name_ = policy;
    every_ = table.get_int("every");
    LOOM_CHECK_AS(ConfigError, every_ > 0, table.where("every"),
                  ": [checkpointing] every must be >= 1 (1 = every unit, 2 = every 2nd), got ",
                  every_);
    first_ = table.get_int("first");
    LOOM_CHECK_AS(ConfigError, !table.has("first") || first_ >= 1, table.where("first"),
                  ": [checkpointing] first must be >= 1 (the units 0..first-1 are "
                  "checkpointed), got ", first_);
    LOOM_CHECK_AS(ConfigError, !(table.has("first") && table.has("every")), table.where("first"),
                  ": [checkpointing] set either first or every, not both");
    LOOM_CHECK_AS(ConfigError, !(table.has("first") && table.has("units")), table.where("first"),
                  ": [checkpointing] set either first or units, not both");
    if (policy_ == Policy::every_n) {
      LOOM_CHECK_AS(ConfigError, !table.has("units") && !table.has("first"),
                    table.where(table.has("units") ? "units" : "first"),
                    ": [checkpointing] policy = \"every_n\" picks units by every; drop ",
                    table.has("units") ? "units" : "first",
                    ", or use policy = \"full\" to recompute the ",
                    table.has("units") ? "listed units" : "first units");
      LOOM_CHECK_AS(ConfigError, table.has("every") && every_ >= 2, table.where("policy"),
                    ": [checkpointing] policy = \"every_n\" needs every = N >= 2 (every N-th "
                    "unit recomputed)",
                    table.has("every") ? loom::detail::cat(", got every = ", every_)
                                       : std::string("; every is not set"),
                    "; for every unit use policy = \"full\"");
    }
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
    // Note [Recompute policies]: others, for the units a whole-unit policy leaves.
    others_name_ = table.get_string("others");
    if (others_name_ == "none") others_ = Part::nothing;
    else if (others_name_ == "attention") others_ = Part::attention;
    else if (others_name_ == "mlp") others_ = Part::mlp;
    else
      throw loom::ConfigError(loom::detail::cat(
          table.where("others"), ": [checkpointing] others '", others_name_,
          "' is unknown; the choices are ", kOthers));
    if (others_ != Part::nothing) {
      LOOM_CHECK_AS(ConfigError, policy_ == Policy::full || policy_ == Policy::every_n,
                    table.where("others"), ": [checkpointing] others = \"", others_name_,
                    "\" is for the whole-unit policies (full, every_n): it says what the units "
                    "they do not choose recompute; with policy = \"", policy_name_,
                    "\" the units not chosen recompute nothing. Use policy = \"full\", or drop "
                    "others");
      LOOM_CHECK_AS(ConfigError, table.has("units") || table.has("first") || every_ >= 2,
                    table.where("others"), ": [checkpointing] others = \"", others_name_,
                    "\" applies to the units policy = \"full\" does not choose, but every = 1 "
                    "chooses every unit; choose fewer with first = N, units = [...] or every = N");
    }
    where_units_ = table.where(table.has("first") ? "first" : "units");
    where_policy_ = table.where("policy");
    where_others_ = table.where("others");
  }

  void attach(loom::Engine& engine) override {
    if (!enabled_) return;
    checkpointer_ =
        std::make_shared<Checkpointer>([this](int64_t index) { return part_of(index); });
    engine.add_unit_interceptor(checkpointer_);
    engine.on(loom::Event::model_built, [this](loom::Engine& e) { check_model(e); });
    if (policy_ == Policy::attention || policy_ == Policy::mlp || others_ != Part::nothing)
      engine.on(loom::Event::before_backward, [this](loom::Engine& e) { check_regions(e); });
  }

 private:
  bool chosen(int64_t index) const {
    if (units_) return units_->count(index) > 0;
    if (first_ > 0) return index < first_;
    return index % every_ == 0;
  }

  Part part_of(int64_t index) const {
    if (!chosen(index)) return others_;
    switch (policy_) {
      case Policy::attention: return Part::attention;
      case Policy::mlp: return Part::mlp;
      case Policy::full:
      case Policy::every_n: return Part::unit;
    }
    LOOM_INTERNAL_ASSERT(false, "checkpointing: unhandled policy");
    return Part::nothing;
  }

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
    if (first_ > 0)
      LOOM_CHECK_AS(ConfigError, first_ <= static_cast<int64_t>(fewest), where_units_,
                    ": [checkpointing] first = ", first_, " but model '", model, "' has ",
                    fewest, " units; first must be at most ", fewest);
    int64_t chosen_units = 0;
    for (size_t i = 0; i < fewest; ++i) chosen_units += chosen(static_cast<int64_t>(i));
    const int64_t rest = static_cast<int64_t>(fewest) - chosen_units;
    LOOM_CHECK_AS(ConfigError, others_ == Part::nothing || rest > 0, where_others_,
                  ": [checkpointing] others = \"", others_name_, "\" applies to the units "
                  "that policy = \"", policy_name_, "\" does not choose, but ",
                  units_ ? "units" : "first", " chooses all ", fewest, " units of model '",
                  model, "'; choose fewer, or drop others");
    loom::log::info("checkpointing: ", policy_name_, " of ", chosen_units, " of ", fewest,
                    " units of each of ", lists.size(), " unit list(s) recomputed in backward",
                    others_ == Part::nothing
                        ? std::string()
                        : loom::detail::cat(", and the ", others_name_, " of the other ", rest));
  }

  // After the first training forward: a selective policy (or others) found the regions it
  // recomputes. A model whose units mark none (Note [Recompute regions]) would silently save
  // nothing.
  void check_regions(loom::Engine& engine) {
    if (regions_checked_) return;
    regions_checked_ = true;
    const bool selective = policy_ == Policy::attention || policy_ == Policy::mlp;
    const std::string& region = selective ? policy_name_ : others_name_;
    LOOM_CHECK_AS(ConfigError, checkpointer_->regions_seen() > 0,
                  selective ? where_policy_ : where_others_, ": [checkpointing] ",
                  selective ? "policy" : "others", " = \"", region, "\" found no ", region,
                  " region in the ", selective ? "chosen units" : "units not chosen",
                  " of model '", engine.section("train").get_string("model"),
                  "' (its units do not mark one: Note [Recompute regions] in loom/nn.h); use ",
                  selective ? "policy = \"full\" to recompute whole units"
                            : "others = \"none\"");
  }

  bool enabled_ = true;
  Policy policy_ = Policy::full;
  std::string policy_name_ = "full", where_policy_;
  Part others_ = Part::nothing;
  std::string others_name_ = "none", where_others_;
  std::shared_ptr<Checkpointer> checkpointer_;
  bool regions_checked_ = false;
  int64_t every_ = 1, first_ = 0;
  std::optional<std::set<int64_t>> units_;
  std::string where_units_;
};

}  // namespace

LOOM_DEFINE_PLUGIN(CheckpointingPlugin, "checkpointing", "1.0.0")
