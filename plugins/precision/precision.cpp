// The `precision` plugin: fills the precision slot — fp32, tf32, autocast mixed precision (bf16,
// fp16) over fp32 weights, pure half-precision weights (full_bf16, full_fp16) over the step
// driver's fp32 masters, and fp16's dynamic loss scaler. Not an optimizer: the rule sees fp32.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/cpu/Utils.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <string>

#include "cpu_support.h"
#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/step_driver.h"
#include "loom/log.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"

namespace {

enum class Mode { fp32, tf32, bf16, fp16, full_bf16, full_fp16 };

const std::vector<std::pair<std::string, Mode>>& modes() {
  static const std::vector<std::pair<std::string, Mode>> all = {
      {"fp32", Mode::fp32},         {"tf32", Mode::tf32},          {"bf16", Mode::bf16},
      {"fp16", Mode::fp16},         {"full_bf16", Mode::full_bf16}, {"full_fp16", Mode::full_fp16}};
  return all;
}

bool uses_autocast(Mode m) { return m == Mode::bf16 || m == Mode::fp16; }
bool half_weights(Mode m) { return m == Mode::full_bf16 || m == Mode::full_fp16; }
bool loss_scaling(Mode m) { return m == Mode::fp16 || m == Mode::full_fp16; }
at::ScalarType compute_dtype(Mode m) {
  if (m == Mode::bf16 || m == Mode::full_bf16) return at::kBFloat16;
  if (m == Mode::fp16 || m == Mode::full_fp16) return at::kHalf;
  return at::kFloat;
}

// Note [Dynamic loss scaling]: fp16 has 5 exponent bits, so gradients below 2^-24 vanish in
// backward. The loss is multiplied by a large scale S (the engine does it: loss * loss_scale),
// which shifts every gradient up by S; before clipping and the update they are divided by S
// again. If any gradient came out inf/NaN, S was too large: the update is skipped (parameters
// and optimizer state untouched) and S shrinks by backoff_factor. After growth_interval clean
// steps in a row S grows by growth_factor, so it tracks the largest safe value. These are
// torch.amp.GradScaler's semantics and defaults. DeepSpeed's scaler adds two knobs, here as
// [precision] keys (a ds_config.json's fp16 section maps onto them): `hysteresis` overflows
// are tolerated (skipped, S kept) before S backs off, the count restored when S grows (or
// after every clean step with consecutive_hysteresis), and S never falls below min_scale.
struct LossScaler {
  double scale = 65536.0, growth_factor = 2.0, backoff_factor = 0.5, min_scale = 0.0;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;  // clean steps since the last change of scale
  int64_t hysteresis = 1;      // 1: back off at every overflow (GradScaler)
  bool consecutive_hysteresis = false;
  int64_t hysteresis_left = 1;

  void update(bool found_inf) {
    if (found_inf) {
      if (hysteresis_left > 1) --hysteresis_left;
      else scale = std::max(scale * backoff_factor, min_scale);
      growth_tracker = 0;
      return;
    }
    if (consecutive_hysteresis) hysteresis_left = hysteresis;
    if (++growth_tracker == growth_interval) {
      scale *= growth_factor;
      growth_tracker = 0;
      hysteresis_left = hysteresis;
    }
  }
};

// Note [Falling back from fp16]: fp16's range ends at 65504. A model whose activations or
// gradients outgrow it (large weights, a long sequence's attention logits, a loss spike)
// overflows at every loss scale, and the scaler only skips those steps until its floor, where
// the run ends in a named divergence error (on_overflow = "error", the default: what GradScaler
// and DeepSpeed do). With on_overflow = "fallback", an overflow at the floor, a scale below
// kMinScale, or fallback_after overflowing steps in a row instead switch the run, once and for
// good, to bf16 autocast (fp32's range) where the device computes bf16 natively, else fp32
// (fallback_mode names one), and training goes on.
// - The state it goes on from is the last good one without a copy: an overflowing step's
//   update is skipped before the step driver touches anything (Note [Dynamic loss scaling]),
//   so at the switch the weights, fp32 masters and optimizer moments are bitwise those after
//   the last clean update. A snapshot would cost another 12 B per parameter for a rare event,
//   and reloading the last checkpoint would throw away the clean steps since. What is not
//   undone: the overflowing steps' batches were drawn and their steps counted (the schedule
//   moved on), as they are for any skipped step in GradScaler and DeepSpeed.
// - fp16 autocast and bf16 autocast both keep fp32 weights, gradients and optimizer state, so
//   only the forward's autocast dtype changes; fp32 drops autocast. full_fp16 stores the
//   weights in fp16 with the step driver's masters beside them, a layout that cannot change
//   mid-run: configure() refuses on_overflow = "fallback" there.
// - Frozen Linear weights held in fp16 (Note [Frozen weights in half]) are cast to the new
//   dtype: the run trained against their fp16 values, which fp32 holds exactly.
// - Every rank sees the same overflow (its flag is all-reduced) and the ranks agree on the
//   target (one all-reduce at the switch), so they switch together.
// - The switch is one warning line, a `precision_fallback_to_<mode>` field (1) on that step's
//   metrics.jsonl line, and in checkpoints `precision.mode` (the new mode) with
//   `precision.fallback_from` and `precision.fallback_step`: a resume of a job that still says
//   mode = "fp16" continues in the mode the run fell back to, whatever its on_overflow.

// Below this the scale cannot make any finite gradient overflow: every step overflowing down
// to here means the gradients are inf/NaN at any scale (a diverged model or a NaN input).
constexpr double kMinScale = 1.0 / (1 << 24);

class Precision final : public loom::Plugin {
 public:
  std::string name() const override { return "precision"; }
  std::string description() const override {
    return "mixed precision: fp32, tf32, autocast bf16/fp16 over fp32 weights, pure half "
           "weights (full_bf16/full_fp16), fp16 dynamic loss scaling";
  }
  std::vector<loom::Slot> slots() const override { return {loom::Slot::precision}; }
  // First but for MoE (which must build the experts it casts): autocast is entered before
  // other plugins' before_forward handlers, and the gradients are unscaled before anything else
  // looks at them in before_update (Note [Plugin order]).
  Order order() const override { return {.after = {"moe"}, .before = {"*"}}; }

  std::vector<loom::Schema> schemas() const override {
    return {loom::Schema("precision")
                .key_string("mode", "fp32",
                            "fp32 | tf32 (CUDA matmuls in TF32) | bf16 | fp16 (autocast over fp32 "
                            "weights) | full_bf16 | full_fp16 (weights stored in half, fp32 "
                            "masters in the optimizer) | auto (bf16 where a probe finds it "
                            "faster than fp32 on this machine, else fp32)")
                .key_float("init_scale", 65536.0, "fp16: the first loss scale")
                .key_float("growth_factor", 2.0, "fp16: scale multiplier after growth_interval "
                                                 "steps without overflow")
                .key_float("backoff_factor", 0.5, "fp16: scale multiplier on an overflow")
                .key_int("growth_interval", 2000, "fp16: clean steps before the scale grows")
                .key_int("hysteresis", 1, "fp16: overflows skipped at one scale before it backs "
                                          "off (DeepSpeed's; 1 = GradScaler's)")
                .key_bool("consecutive_hysteresis", false,
                          "fp16: restore the hysteresis after every clean step, not only when "
                          "the scale grows (DeepSpeed's)")
                .key_float("min_scale", 0.0, "fp16: the scale never backs off below this "
                                             "(DeepSpeed's min_loss_scale; 0 = no floor)")
                .key_string("on_overflow", "error",
                            "fp16: what an overflow at min_scale (or below 2^-24) does: error "
                            "(a named divergence error) | fallback (switch the rest of the run "
                            "to fallback_mode; also after fallback_after overflows in a row; "
                            "Note [Falling back from fp16])")
                .key_int("fallback_after", 20, "fp16, on_overflow = \"fallback\": overflowing "
                                               "steps in a row that switch the run")
                .key_string("fallback_mode", "auto",
                            "fp16, on_overflow = \"fallback\": the mode switched to: auto (bf16 "
                            "where the device computes bf16 natively, else fp32) | bf16 | fp32")
                .key_string("cast_cache", "step",
                            "bf16/fp16 autocast: how long the half copies of the weights live "
                            "(Note [Cast once per update]): step (cast once per update, reused "
                            "by every micro-batch) | forward (PyTorch's: cast again each "
                            "micro-batch)")
                .key_string("frozen_weights", "half",
                            "bf16/fp16 autocast: how frozen Linear weights (LoRA's base) are "
                            "held (Note [Frozen weights in half]): half (in the autocast dtype: "
                            "no cast per forward, half the bytes, the same results) | fp32")};
  }

  // See Note [Memory declarations] (loom/memory_declarations.h): the bytes per weight, gradient
  // and master every plugin after this one reads. fp32 (and tf32) and autocast keep fp32 weights and gradients, no masters;
  // full_bf16/full_fp16 half weights and gradients and fp32 masters. Under autocast frozen
  // Linear weights are half (Note [Frozen weights in half]), and where the probes did not
  // measure the activations the half copies of the other weights are counted (2 B each), as
  // they live from forward to backward. "auto" is estimated as fp32, its start.
  void declare_memory(const loom::ConfigSection& table, const loom::memory::MemoryContext& c,
                      loom::memory::MemoryTerms& r) const override {
    const std::string mode = table.get_string("mode");
    const bool half = mode == "full_bf16" || mode == "full_fp16";
    const bool autocast = mode == "bf16" || mode == "fp16";
    r.labels["precision"] = half ? "full_bf16" : autocast ? "bf16" : "fp32";
    const double w = half ? 2 : 4;
    r.weight_bytes = r.grad_bytes = w;
    // Note [bf16 weights as their own masters] (core/src/step_driver.cpp): none kept.
    r.master_bytes = half && !(c.bf16_masters && mode == "full_bf16") ? 4 : 0;
    const double frozen_half =
        autocast && table.get_string("frozen_weights") == "half" ? c.frozen_linear_params : 0;
    r.half_frozen_params = frozen_half;
    r.weights = c.params * w - frozen_half * (w - 2);
    r.grads = c.trainable * r.grad_bytes;
    r.masters = c.trainable * r.master_bytes;
    if (autocast && !c.activations_measured) r.buffers += 2 * (c.params - frozen_half);
  }
  std::vector<loom::memory::MemoryVariant> memory_variants() const override {
    std::vector<loom::memory::MemoryVariant> out;
    for (const char* mode : {"fp32", "bf16", "full_bf16"}) {
      loom::ConfigValue value;
      value.value = std::string(mode);
      out.push_back({.labels = {{"precision", mode}}, .overrides = {{"mode", value}}});
    }
    return out;
  }

  void configure(const loom::ConfigSection& table) override {
    const std::string name = table.get_string("mode");
    auto_ = name == "auto";  // fp32 until attach() has timed both (Note [Auto precision])
    std::optional<Mode> mode;
    if (auto_) mode = Mode::fp32;
    std::vector<std::string> names;
    for (const auto& [candidate, value] : modes()) {
      names.push_back(candidate);
      if (candidate == name) mode = value;
    }
    if (!mode) {
      const auto hint = loom::closest_match(name, names);
      throw loom::ConfigError(loom::detail::cat(
          table.where("mode"), ": [precision] mode '", name, "' is unknown",
          hint ? "; did you mean '" + *hint + "'?" : std::string(),
          " (use fp32, tf32, bf16, fp16, full_bf16, full_fp16 or auto)"));
    }
    mode_ = *mode;
    mode_name_ = name;
    dtype_ = compute_dtype(mode_);

    for (const char* key : {"init_scale", "growth_factor", "backoff_factor", "growth_interval",
                            "hysteresis", "consecutive_hysteresis", "min_scale", "on_overflow",
                            "fallback_after", "fallback_mode"})
      LOOM_CHECK_AS(ConfigError, !table.has(key) || loss_scaling(mode_), table.where(key),
                    ": [precision] ", key, " sets the fp16 loss scaler, but mode is '", name,
                    "' (only fp16 and full_fp16 scale the loss); remove it or use an fp16 mode");
    scaler_.scale = table.get_float("init_scale");
    scaler_.growth_factor = table.get_float("growth_factor");
    scaler_.backoff_factor = table.get_float("backoff_factor");
    scaler_.growth_interval = table.get_int("growth_interval");
    LOOM_CHECK_AS(ConfigError, std::isfinite(scaler_.scale) && scaler_.scale > 0,
                  table.where("init_scale"), ": [precision] init_scale must be a positive "
                  "number, got ", scaler_.scale, " (GradScaler's default is 65536)");
    LOOM_CHECK_AS(ConfigError, scaler_.growth_factor > 1.0, table.where("growth_factor"),
                  ": [precision] growth_factor must be > 1, got ", scaler_.growth_factor);
    LOOM_CHECK_AS(ConfigError, scaler_.backoff_factor > 0 && scaler_.backoff_factor < 1,
                  table.where("backoff_factor"),
                  ": [precision] backoff_factor must be in (0, 1), got ", scaler_.backoff_factor);
    LOOM_CHECK_AS(ConfigError, scaler_.growth_interval >= 1, table.where("growth_interval"),
                  ": [precision] growth_interval must be >= 1, got ", scaler_.growth_interval);
    scaler_.hysteresis = scaler_.hysteresis_left = table.get_int("hysteresis");
    LOOM_CHECK_AS(ConfigError, scaler_.hysteresis >= 1, table.where("hysteresis"),
                  ": [precision] hysteresis must be >= 1, got ", scaler_.hysteresis);
    scaler_.consecutive_hysteresis = table.get_bool("consecutive_hysteresis");
    scaler_.min_scale = table.get_float("min_scale");
    LOOM_CHECK_AS(ConfigError, scaler_.min_scale >= 0 && scaler_.min_scale <= scaler_.scale,
                  table.where("min_scale"), ": [precision] min_scale must be in [0, init_scale "
                  "(", scaler_.scale, ")], got ", scaler_.min_scale);
    where_mode_ = table.where("mode");
    configure_fallback(table);
    const std::string cache = table.get_string("cast_cache");
    LOOM_CHECK_AS(ConfigError, cache == "step" || cache == "forward", table.where("cast_cache"),
                  ": [precision] cast_cache must be \"step\" or \"forward\", got \"", cache, "\"");
    cache_for_step_ = cache == "step";
    const std::string frozen = table.get_string("frozen_weights");
    LOOM_CHECK_AS(ConfigError, frozen == "half" || frozen == "fp32", table.where("frozen_weights"),
                  ": [precision] frozen_weights must be \"half\" or \"fp32\", got \"", frozen,
                  "\"");
    frozen_half_ = frozen == "half";
  }

  // Note [Optimizer in backward] (core/src/optimizer_in_backward.h): the dynamic loss scaler
  // must check every gradient for an overflow before any update, which rules out updating each
  // parameter during backward.
  void validate(const std::string&, const loom::ConfigSection&,
                const JobTables& job) const override {
    LOOM_CHECK_AS(ConfigError, !loss_scaling(mode_) || !job("train")->get_bool("optimizer_in_backward"),
                  where_mode_, ": [precision] mode = \"", mode_name_, "\" scales the loss, and "
                  "its overflow check needs every gradient before any update, but [train] "
                  "optimizer_in_backward = true updates each parameter during backward; use "
                  "mode = \"bf16\" or \"full_bf16\" (no loss scaling), or turn "
                  "optimizer_in_backward off");
  }

  void attach(loom::Engine& engine) override {
    device_ = engine.device();
    if (auto_) resolve_auto(engine.comm());
    check_device();
    set_tf32_flags();

    if (half_weights(mode_))
      engine.on(loom::Event::model_built, [this](loom::Engine& e) { cast_model(e); });
    engine.on(loom::Event::params_ready, [this](loom::Engine& e) {
      if (uses_autocast(mode_)) check_fp32_weights(e);
      // auto decides for good only once a checkpoint has been read (load may change the mode).
      if (!auto_) hold_frozen_in_half(e);
      // Stage 3 frees each unit's weights after use: kept half copies would undo that.
      if (!e.step_driver().sharded_weights().empty()) cache_for_step_ = false;
      if (loss_scaling(mode_)) e.state().loss_scale = scaler_.scale;
      loom::log::info(anatomy(e.model_state()));
    });
    // auto may still change its mind on resume (load), so it always listens.
    if (uses_autocast(mode_) || auto_) {
      engine.on(loom::Event::before_forward, [this](loom::Engine& e) {
        if (!uses_autocast(mode_)) return;
        hold_frozen_in_half(e);  // once; here for auto, which chose at params_ready or load
        enter_autocast(dtype_);
      });
      // Note [Cast once per update]: the weights do not change between the micro-batches of
      // one step, so the half copies autocast made for the first micro-batch's forward are
      // kept (its cache) for the others; the last micro-batch's forward drops them, so the
      // update and the step's end hold none, as without accumulation.
      engine.on(loom::Event::after_forward, [this](loom::Engine& e) {
        leave_autocast(/*keep_cache=*/cache_for_step_ && !e.state().sync_grads &&
                       at::GradMode::is_enabled());
      });
      // Whatever a step's micro-batches did, no kept copy outlives its update (stale weights).
      engine.on(loom::Event::before_update, [](loom::Engine&) {
        if (at::autocast::is_autocast_cache_enabled()) at::autocast::clear_cache();
      });
    }
    if (loss_scaling(mode_))
      engine.on(loom::Event::before_update, [this](loom::Engine& e) {
        if (loss_scaling(mode_)) unscale_and_check(e);  // not after a fallback
      });
    engine.on(loom::Event::save, [this](loom::Engine& e) {
      auto& values = e.checkpoint().values;
      values["precision.mode"] = mode_name_;
      if (!fallen_from_.empty()) {  // Note [Falling back from fp16]
        values["precision.fallback_from"] = fallen_from_;
        values["precision.fallback_step"] = std::to_string(fallback_step_);
      }
      if (loss_scaling(mode_)) {
        values["precision.growth_tracker"] = std::to_string(scaler_.growth_tracker);
        if (fallback_on_ && overflow_streak_ > 0)
          values["precision.overflow_streak"] = std::to_string(overflow_streak_);
        if (scaler_.hysteresis > 1)
          values["precision.hysteresis_left"] = std::to_string(scaler_.hysteresis_left);
      }
    });
    engine.on(loom::Event::load, [this](loom::Engine& e) { load(e); });
    engine.on(loom::Event::teardown, [this](loom::Engine&) {
      leave_autocast();  // a forward that threw may have left it on
      at::autocast::clear_cache();
      restore_tf32_flags();
    });
  }

 private:
  // ---- setup ----
  // Note [Falling back from fp16].
  void configure_fallback(const loom::ConfigSection& table) {
    const std::string policy = table.get_string("on_overflow");
    LOOM_CHECK_AS(ConfigError, policy == "error" || policy == "fallback",
                  table.where("on_overflow"), ": [precision] on_overflow '", policy,
                  "' is unknown (use \"error\" or \"fallback\")");
    fallback_on_ = policy == "fallback";
    for (const char* key : {"fallback_after", "fallback_mode"})
      LOOM_CHECK_AS(ConfigError, !table.has(key) || fallback_on_, table.where(key),
                    ": [precision] ", key, " applies only with on_overflow = \"fallback\", but "
                    "on_overflow is \"", policy, "\"; remove it or set on_overflow = "
                    "\"fallback\"");
    LOOM_CHECK_AS(ConfigError, !fallback_on_ || mode_ != Mode::full_fp16,
                  table.where("on_overflow"), ": [precision] on_overflow = \"fallback\" needs "
                  "mode = \"fp16\" (autocast over fp32 weights): full_fp16 stores the weights in "
                  "fp16 beside the optimizer's fp32 masters, which cannot change dtype mid-run; "
                  "use mode = \"fp16\", or full_bf16 (no overflow to fall back from)");
    fallback_after_ = table.get_int("fallback_after");
    LOOM_CHECK_AS(ConfigError, fallback_after_ > 0, table.where("fallback_after"),
                  ": [precision] fallback_after must be > 0 (overflowing steps in a row), got ",
                  fallback_after_);
    fallback_choice_ = table.get_string("fallback_mode");
    LOOM_CHECK_AS(ConfigError,
                  fallback_choice_ == "auto" || fallback_choice_ == "bf16" ||
                      fallback_choice_ == "fp32",
                  table.where("fallback_mode"), ": [precision] fallback_mode '", fallback_choice_,
                  "' is unknown (use \"auto\", \"bf16\" or \"fp32\")");
  }

  // The mode fallback_mode = "auto" switches to on this device, and why.
  std::pair<Mode, std::string> fallback_target() const {
    if (fallback_choice_ == "bf16") return {Mode::bf16, "[precision] fallback_mode = \"bf16\""};
    if (fallback_choice_ == "fp32") return {Mode::fp32, "[precision] fallback_mode = \"fp32\""};
    if (device_.is_cuda()) {
      // LibTorch answers this from the device's compute capability (8.0 and up: Ampere).
      if (at::detail::getCUDAHooks().supportsBFloat16ConvolutionWithCuDNNv8())
        return {Mode::bf16, device_.str() + " computes bf16 natively"};
      return {Mode::fp32, device_.str() + " predates bf16 (compute capability below 8.0)"};
    }
    if (device_.is_cpu()) {
      const std::string gap =
          loom::precision::cpu_half_gap(at::kBFloat16, at::cpu::get_cpu_capabilities());
      if (gap.empty()) return {Mode::bf16, "this CPU computes bf16 natively"};
      return {Mode::fp32, gap};
    }
    return {Mode::fp32, "no bf16 probe for " + device_.str()};
  }

  void set_mode(Mode mode, const std::string& name) {
    mode_ = mode;
    mode_name_ = name;
    dtype_ = compute_dtype(mode);
  }

  // Note [Auto precision] in cpu_support.h. Every rank must choose alike: the ranks' timings are
  // summed before the choice.
  void resolve_auto(loom::Comm& comm) {
    set_mode(Mode::fp32, "fp32");
    if (device_.is_cuda()) {
      set_mode(Mode::bf16, "bf16");
      loom::log::info("[precision] mode = \"auto\" chose bf16 autocast on ", device_.str(),
                      " (GPUs before Ampere emulate bf16 slowly: set mode = \"fp16\" there)");
      return;
    }
    const std::string gap = device_.is_cpu()
                                ? loom::precision::cpu_half_gap(at::kBFloat16,
                                                                at::cpu::get_cpu_capabilities())
                                : "no bf16 probe for " + device_.str();
    if (!gap.empty()) {
      loom::log::info("[precision] mode = \"auto\" chose fp32: ", gap);
      return;
    }
    at::Tensor seconds = probe_block();
    if (comm.world_size() > 1) {
      at::Tensor shared = seconds.to(comm.device());
      comm.all_reduce(shared, loom::ReduceOp::sum)->wait();
      seconds = shared.cpu();
    }
    const double fp32 = seconds[0].item<double>(), bf16 = seconds[1].item<double>();
    const bool use_bf16 = loom::precision::auto_prefers_bf16(fp32, bf16);
    if (use_bf16) set_mode(Mode::bf16, "bf16");
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2f", bf16 / fp32);
    loom::log::info("[precision] mode = \"auto\" chose ", use_bf16 ? "bf16 autocast" : "fp32",
                    ": a transformer MLP block took ", ratio,
                    "x its fp32 time in bf16 on this CPU (bf16 is chosen below ",
                    loom::precision::kAutoBf16Margin, "x)");
  }

  // Medians of five forward + backward passes of one MLP block (LayerNorm, 768 -> 3072 GELU ->
  // 768, 256 rows) in fp32 and under bf16 autocast, interleaved, after one warm-up each: a
  // (2) fp64 tensor of seconds. Its own generator: the run's random stream is untouched.
  at::Tensor probe_block() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    const at::Tensor x = at::randn({256, 768}, gen);
    const at::Tensor w1 = (at::randn({3072, 768}, gen) * 0.02).requires_grad_();
    const at::Tensor w2 = (at::randn({768, 3072}, gen) * 0.02).requires_grad_();
    const at::Tensor ln_w = at::ones({768}).requires_grad_(), ln_b = at::zeros({768});
    auto pass = [&](bool bf16) {
      const auto start = std::chrono::steady_clock::now();
      if (bf16) enter_autocast(at::kBFloat16);
      at::Tensor h = at::layer_norm(x, {768}, ln_w, ln_b);
      // loom::nn::linear: the path this CPU's half products take (Note [Half matmuls
      // through fp32]), so the probe times what the run would.
      at::Tensor y = loom::nn::linear(at::gelu(loom::nn::linear(h, w1), "tanh"), w2);
      leave_autocast();
      y.to(at::kFloat).square().sum().backward();
      for (const at::Tensor* t : {&w1, &w2, &ln_w}) t->mutable_grad() = at::Tensor();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    std::vector<double> times[2];
    {
      at::AutoGradMode grad(true);
      for (int round = 0; round < 6; ++round)
        for (int bf16 : {round % 2, 1 - round % 2}) {
          const double t = pass(bf16 == 1);
          if (round > 0) times[bf16].push_back(t);
        }
    }
    at::Tensor out = at::empty({2}, at::kDouble);
    for (int i : {0, 1}) {
      std::sort(times[i].begin(), times[i].end());
      out[i] = times[i][times[i].size() / 2];
    }
    return out;
  }

  // Called once per run (from attach), so each warning appears once, at the start.
  void check_device() {
    if (mode_ == Mode::tf32 && !device_.is_cuda())
      loom::log::warn("[precision] mode = \"tf32\" has no effect on ", device_.str(),
                      ": TF32 is a CUDA (Ampere+) matmul mode; training runs in fp32");
    if (dtype_ == at::kFloat) return;
    LOOM_CHECK_AS(ConfigError,
                  !uses_autocast(mode_) || at::autocast::is_autocast_available(device_.type()),
                  where_mode_, ": [precision] mode = \"", mode_name_,
                  "\" needs autocast, which LibTorch does not offer on ", device_.str(),
                  "; use fp32 or a full_* mode");
    if (device_.is_cpu()) {
      const std::string gap =
          loom::precision::cpu_half_gap(dtype_, at::cpu::get_cpu_capabilities());
      if (!gap.empty()) {
        // Note [Half matmuls through fp32] (loom/nn.h): the products go through fp32 sgemm.
        if (loom::nn::half_matmul_path(dtype_) == loom::nn::HalfMatmul::through_fp32)
          loom::log::warn("[precision] mode = \"", mode_name_, "\": ", gap, "; loom's matmuls "
                          "run through fp32 sgemm and LibTorch emulates ", c10::toString(dtype_),
                          "'s other ops through fp32: about fp32's speed, not faster");
        else
          loom::log::warn("[precision] mode = \"", mode_name_, "\": ", gap,
                          "; LibTorch emulates ", c10::toString(dtype_),
                          " through fp32, correct but usually slower than mode = \"fp32\"");
      }
    }
    if (mode_ == Mode::full_fp16)
      loom::log::warn("[precision] mode = \"full_fp16\" keeps gradients in fp16: once unscaled, "
                      "gradient entries below 2^-14 lose precision and below 2^-24 become 0; "
                      "mode = \"fp16\" (fp32 weights and gradients) has no such loss");
  }

  void set_tf32_flags() {
    if (!device_.is_cuda()) return;
    auto& context = at::globalContext();
    using B = at::Float32Backend;
    using O = at::Float32Op;
    saved_matmul_ = context.float32Precision(B::CUDA, O::MATMUL);
    saved_conv_ = context.float32Precision(B::CUDA, O::CONV);
    // fp32 means IEEE fp32 (cuDNN convolutions default to TF32 otherwise); the half modes leave
    // what little still runs in fp32 exact as well.
    const auto precision =
        mode_ == Mode::tf32 ? at::Float32Precision::TF32 : at::Float32Precision::IEEE;
    context.setFloat32Precision(B::CUDA, O::MATMUL, precision);
    context.setFloat32Precision(B::CUDA, O::CONV, precision);
    flags_set_ = true;
  }

  void restore_tf32_flags() {
    if (!flags_set_) return;
    auto& context = at::globalContext();
    context.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL, saved_matmul_);
    context.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::CONV, saved_conv_);
    flags_set_ = false;
  }

  // full_*: every floating parameter and buffer is stored in the compute dtype. The step driver
  // then keeps an fp32 master per parameter and writes the updated weights back in half.
  void cast_model(loom::Engine& engine) {
    at::NoGradGuard no_grad;
    auto& model = engine.model();
    for (auto& param : model.parameters(/*recurse=*/true)) {
      if (!param.is_floating_point()) continue;
      if (loom::nn::storage_released(param)) {
        // A unit weight cut as it was built (Note [Sharded initialization]): no values here to
        // cast (the ZeRO driver casts its chunk), only its dtype changes.
        param.set_data(at::empty(param.sizes(), param.options().dtype(dtype_)));
        loom::nn::release_storage(param);
      } else {
        param.set_data(param.detach().to(dtype_));
      }
    }
    for (auto& buffer : model.buffers(/*recurse=*/true))
      if (buffer.is_floating_point()) buffer.set_data(buffer.detach().to(dtype_));
  }

  // Note [Frozen weights in half] (loom/nn.h). LoRA freezes the base model, and autocast does
  // not cache casts of tensors that need no gradient: every forward (and every recompute of a
  // checkpointed unit) cast each frozen fp32 weight to half again, and autograd kept those
  // copies for backward, so a frozen weight cost 4 + 2 B at the peak. Held in the autocast dtype
  // it costs 2 B and no cast, and the matmuls see the same bits (autocast's cast is this one).
  // Only tensors the model holds as Linear weights and biases alone: an Embedding's weight
  // (even tied to a head) stays fp32, as its lookup is not autocast. Decided once per run.
  void hold_frozen_in_half(loom::Engine& engine) {
    if (frozen_decided_) return;
    frozen_decided_ = true;
    if (!uses_autocast(mode_) || !frozen_half_) return;
    at::NoGradGuard no_grad;
    int64_t tensors = 0, elements = 0;
    for (at::Tensor& t : loom::nn::frozen_linear_tensors(engine.model())) {
      if (t.scalar_type() != at::kFloat) continue;
      t.set_data(t.detach().to(dtype_));
      frozen_tensors_.push_back(t);
      ++tensors;
      elements += t.numel();
    }
    if (tensors == 0) return;
    loom::log::info("precision: ", tensors, " frozen Linear tensors (", elements,
                    " parameters) held in ", c10::toString(dtype_), ", ",
                    loom::memory::format_bytes(elements * 2),
                    " less and no casts per forward ([precision] frozen_weights = \"half\")");
  }

  // Autocast keeps fp32 weights and casts them per op; a weight already stored in another dtype
  // would bypass the fp32 master update the mode promises.
  void check_fp32_weights(loom::Engine& engine) {
    for (const auto& param : engine.params())
      LOOM_CHECK_AS(ConfigError, param.tensor.scalar_type() == at::kFloat, where_mode_,
                    ": [precision] mode = \"", mode_name_,
                    "\" runs autocast over fp32 weights, but the model's parameter '", param.name,
                    "' is stored as ", c10::toString(param.tensor.scalar_type()),
                    "; build the model in fp32, or use mode = \"full_",
                    dtype_ == at::kHalf ? "fp16" : "bf16", "\"");
  }

  // What the weights, grads and optimizer state cost per trainable parameter in this mode: the
  // anatomy the seed documents reason with (mixed precision: 4 + 2 B weights, 4 B grads).
  std::string anatomy(const loom::memory::ModelState& s) const {
    const double n = static_cast<double>(std::max<int64_t>(1, s.trainable_count));
    const double weights = s.param_bytes / n, masters = s.master_bytes / n,
                 grads = s.grad_bytes / n, optimizer = s.optimizer_bytes / n;
    const std::string half = c10::toString(dtype_);
    std::ostringstream out;
    out.precision(3);
    out << "precision " << mode_name_ << ": per trainable parameter ";
    if (uses_autocast(mode_)) {
      // The half copies exist from forward to backward (autocast's cache, then autograd's
      // saved tensors); they are gone at update time.
      out << weights << " B fp32 weights + 2 B " << half << " copies made by autocast for "
          << "forward/backward + " << grads << " B fp32 grads + " << optimizer
          << " B optimizer state = " << weights + 2 + grads + optimizer
          << " B; activations saved for backward mostly in " << half;
    } else if (half_weights(mode_)) {
      out << weights << " B " << half << " weights + ";
      if (masters > 0)
        out << masters << " B fp32 masters + ";
      else  // Note [bf16 weights as their own masters] (core/src/step_driver.cpp)
        out << "no masters (the weights updated with stochastic rounding) + ";
      out << grads << " B " << half << " grads + " << optimizer << " B optimizer state = "
          << weights + masters + grads + optimizer << " B; no autocast: every op runs in "
          << half;
    } else {
      out << weights << " B fp32 weights + " << grads << " B fp32 grads + " << optimizer
          << " B optimizer state = " << weights + grads + optimizer << " B";
    }
    if (loss_scaling(mode_)) out << "; " << scaler_settings();
    return out.str();
  }

  // Every key of the fp16 scaler and of on_overflow as this run uses them, defaults included,
  // for the run's header: a job that leaves hysteresis, min_scale or on_overflow out behaves by
  // their defaults, and the header is where a reader of the log learns which those are.
  std::string scaler_settings() const {
    std::ostringstream out;
    out << "dynamic loss scale " << scaler_.scale << " (x" << scaler_.growth_factor << " every "
        << scaler_.growth_interval << " clean steps, x" << scaler_.backoff_factor
        << " on overflow; hysteresis " << scaler_.hysteresis;
    if (scaler_.hysteresis > 1)
      out << " overflows at one scale before it backs off, restored "
          << (scaler_.consecutive_hysteresis ? "after every clean step" : "when the scale grows");
    out << "; min_scale ";
    if (scaler_.min_scale > 0) out << scaler_.min_scale;
    else out << "0 (none: the floor is 2^-24)";
    out << "); on_overflow ";
    if (!fallback_on_) {
      out << "error: an overflow at the floor ends the run";
    } else {
      const auto [target, reason] = fallback_target();
      out << "fallback: an overflow at the floor or " << fallback_after_
          << " overflowing steps in a row switch the run to "
          << (target == Mode::bf16 ? "bf16 autocast" : "fp32") << " (fallback_mode "
          << fallback_choice_ << (fallback_choice_ == "auto" ? ": " + reason : std::string())
          << ")";
    }
    return out.str();
  }

  // ---- forward ----
  void enter_autocast(at::ScalarType dtype) {
    leave_autocast();
    const auto type = device_.type();
    saved_enabled_ = at::autocast::is_autocast_enabled(type);
    saved_dtype_ = at::autocast::get_autocast_dtype(type);
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::set_autocast_dtype(type, dtype);
    at::autocast::increment_nesting();
    autocast_on_ = true;
  }

  void leave_autocast(bool keep_cache = false) {
    if (!autocast_on_) return;
    const auto type = device_.type();
    at::autocast::set_autocast_enabled(type, saved_enabled_);
    at::autocast::set_autocast_dtype(type, saved_dtype_);
    // The cache holds the half copies of the weights for this forward; autograd keeps the ones
    // backward needs, so dropping the cache here frees them as soon as backward is done
    // (unless the next micro-batch of this step will use them: Note [Cast once per update]).
    if (at::autocast::decrement_nesting() == 0 && !keep_cache) at::autocast::clear_cache();
    autocast_on_ = false;
  }

  // ---- update ----
  // Note [Dynamic loss scaling]. Runs before the core clips: clipping must see true gradients.
  void unscale_and_check(loom::Engine& engine) {
    auto& state = engine.state();
    const double scale = state.loss_scale;
    // One fused pass per (device, dtype) group divides by the scale and flags inf/NaN.
    std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
    // The driver's gradients: the parameters' .grad, or ZeRO's shards.
    for (const at::Tensor& grad : engine.step_driver().grads())
      if (grad.defined()) groups[{grad.device().str(), grad.scalar_type()}].push_back(grad);
    at::Tensor found_inf = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
    const double inverse = state.grads_scaled ? 1.0 / scale : 1.0;
    at::Tensor inv_scale = at::full({1}, inverse, at::TensorOptions().dtype(at::kFloat).device(device_));
    {
      at::NoGradGuard no_grad;
      for (auto& [key, grads] : groups) {
        at::Tensor found = found_inf.to(grads.front().device());
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found,
                                                       inv_scale.to(grads.front().device()));
        found_inf = at::maximum(found_inf, found.to(device_));
      }
    }
    // Every rank must skip together, or their replicas drift apart.
    if (engine.comm().world_size() > 1) {
      found_inf = found_inf.to(engine.comm().device());  // mpi/gloo: CPU; nccl: this GPU
      engine.comm().all_reduce(found_inf, loom::ReduceOp::max)->wait();
    }
    const bool overflow = found_inf.item<float>() != 0.0f;
    state.grads_scaled = false;
    scaler_.scale = scale;
    const bool backs_off = scaler_.hysteresis_left <= 1;  // this overflow would shrink the scale
    scaler_.update(overflow);
    overflow_streak_ = overflow ? overflow_streak_ + 1 : 0;
    if (overflow) {
      state.skip_update = true;
      loom::log::info("step ", state.step + 1, ": inf/NaN gradient at loss scale ", scale,
                      "; update skipped, scale now ", scaler_.scale);
      if (fallback_on_) {
        std::string why;
        if (scaler_.scale < kMinScale)
          why = loom::detail::cat("fp16 overflowed at every loss scale down to ", scale);
        else if (backs_off && scale <= scaler_.min_scale)
          why = loom::detail::cat("fp16 overflowed at the loss scale's floor ", scaler_.min_scale,
                                  " ([precision] min_scale)");
        else if (overflow_streak_ >= fallback_after_)
          why = loom::detail::cat("fp16 overflowed on ", overflow_streak_, " steps in a row "
                                  "([precision] fallback_after = ", fallback_after_, ")");
        if (!why.empty()) return fall_back(engine, why);
      }
      LOOM_CHECK(scaler_.scale >= kMinScale, "step ", state.step + 1,
                 ": the gradients are inf/NaN at every loss scale down to ", scale,
                 " (loss ", state.loss, "): training diverged or the data holds a NaN; lower "
                 "[train] learning_rate, check the data, or use [precision] mode = \"bf16\"");
      // At the floor the scale cannot back off: the overflow would repeat every step, skipped
      // in silence for ever.
      LOOM_CHECK(!(backs_off && scale <= scaler_.min_scale), "step ",
                 state.step + 1, ": the gradients are inf/NaN at the loss scale's floor ",
                 scaler_.min_scale, " ([precision] min_scale; loss ", state.loss, "): training "
                 "diverged or the data holds a NaN; lower [train] learning_rate, check the data, "
                 "or use [precision] mode = \"bf16\"");
    }
    state.loss_scale = scaler_.scale;
  }

  // Note [Falling back from fp16]. Called in before_update of the overflowing step, whose
  // update is skipped.
  void fall_back(loom::Engine& engine, const std::string& why) {
    auto& state = engine.state();
    auto [target, reason] = fallback_target();
    if (engine.comm().world_size() > 1) {  // one rank without bf16 makes them all fp32
      const auto options = at::TensorOptions().dtype(at::kFloat).device(engine.comm().device());
      at::Tensor fp32 = at::full({1}, target == Mode::fp32 ? 1.0f : 0.0f, options);
      engine.comm().all_reduce(fp32, loom::ReduceOp::max)->wait();
      if (fp32.item<float>() != 0.0f && target != Mode::fp32) {
        target = Mode::fp32;
        reason = "another rank's device does not compute bf16 natively";
      }
    }
    const std::string from = mode_name_;
    const std::string to = target == Mode::bf16 ? "bf16" : "fp32";
    set_mode(target, to);
    fallen_from_ = from;
    fallback_step_ = state.step + 1;
    convert_frozen_half();
    state.loss_scale = 1.0;
    state.metrics.emplace_back("precision_fallback_to_" + to, 1.0);
    const int64_t last_clean = state.step + 1 - overflow_streak_;
    loom::log::warn("[precision] step ", state.step + 1, ": ", why, " (loss ", state.loss,
                    "); switching from ", from, " to ",
                    target == Mode::bf16 ? "bf16 autocast" : "fp32", " for the rest of the run (",
                    reason, "; [precision] on_overflow = \"fallback\"), from the weights and "
                    "optimizer state of ", last_clean == 0 ? std::string("the start")
                                                          : "step " + std::to_string(last_clean),
                    ", the last clean update");
  }

  // Frozen Linear tensors held in half (Note [Frozen weights in half]) follow a change of mode.
  void convert_frozen_half() {
    if (frozen_tensors_.empty()) return;
    at::NoGradGuard no_grad;
    const at::ScalarType to = uses_autocast(mode_) ? dtype_ : at::kFloat;
    for (at::Tensor& t : frozen_tensors_)
      if (t.scalar_type() != to) t.set_data(t.detach().to(to));
  }

  // ---- checkpoints ----
  void load(loom::Engine& engine) {
    auto& state = engine.state();
    const auto& values = engine.checkpoint().values;
    auto mode = values.find("precision.mode");
    const std::string saved_mode = mode == values.end() ? "fp32" : mode->second;
    if (auto_ && saved_mode != mode_name_ && (saved_mode == "fp32" || saved_mode == "bf16")) {
      // A resumed run continues as it started, whatever today's probe says: both keep fp32
      // weights, so only the forward's autocast changes.
      loom::log::info("[precision] mode = \"auto\": continuing in the checkpoint's ", saved_mode);
      set_mode(saved_mode == "bf16" ? Mode::bf16 : Mode::fp32, saved_mode);
    }
    auto from = values.find("precision.fallback_from");
    if (from != values.end() && from->second == mode_name_ &&
        (saved_mode == "bf16" || saved_mode == "fp32")) {
      // Note [Falling back from fp16]: the run switched for good; the job still names the mode
      // it switched from.
      const std::string step = read_value(values, "precision.fallback_step");
      loom::log::info("[precision] the checkpoint's run fell back from ", from->second, " to ",
                      saved_mode, " at step ", step, " ([precision] on_overflow = \"fallback\"); "
                      "continuing in ", saved_mode);
      set_mode(saved_mode == "bf16" ? Mode::bf16 : Mode::fp32, saved_mode);
      fallen_from_ = from->second;
      fallback_step_ = parse_int(step, "precision.fallback_step");
      convert_frozen_half();
    }
    if (saved_mode != mode_name_)
      loom::log::warn("[precision] the checkpoint was trained with mode ", saved_mode,
                      ", this run uses ", mode_name_, "; continuing in ", mode_name_);
    if (!loss_scaling(mode_)) {
      state.loss_scale = 1.0;
      return;
    }
    auto streak = values.find("precision.overflow_streak");
    overflow_streak_ =
        streak == values.end() ? 0 : parse_int(streak->second, "precision.overflow_streak");
    auto left = values.find("precision.hysteresis_left");
    scaler_.hysteresis_left = scaler_.hysteresis;
    if (left != values.end()) {
      try {
        scaler_.hysteresis_left = std::stoll(left->second);
      } catch (const std::exception&) {
        throw loom::CheckpointError(loom::detail::cat(
            "checkpoint value precision.hysteresis_left is '", left->second,
            "', not an integer; the manifest is damaged"));
      }
    }
    auto tracker = values.find("precision.growth_tracker");
    if (tracker == values.end()) {
      // No scaler was running: start it as a fresh run would.
      state.loss_scale = scaler_.scale;
      scaler_.growth_tracker = 0;
      return;
    }
    try {
      scaler_.growth_tracker = std::stoll(tracker->second);
    } catch (const std::exception&) {
      throw loom::CheckpointError(loom::detail::cat(
          "checkpoint value precision.growth_tracker is '", tracker->second,
          "', not an integer; the manifest is damaged"));
    }
    LOOM_CHECK_AS(CheckpointError, std::isfinite(state.loss_scale) && state.loss_scale > 0,
                  "checkpoint loss scale is ", state.loss_scale, "; the manifest is damaged");
    scaler_.scale = state.loss_scale;
  }

  static std::string read_value(const std::map<std::string, std::string>& values,
                                const std::string& key) {
    auto it = values.find(key);
    LOOM_CHECK_AS(CheckpointError, it != values.end(), "checkpoint value ", key,
                  " is missing; the manifest is damaged");
    return it->second;
  }
  static int64_t parse_int(const std::string& text, const std::string& key) {
    try {
      size_t used = 0;
      const int64_t value = std::stoll(text, &used);
      if (used == text.size() && value >= 0) return value;
    } catch (const std::exception&) {
    }
    throw loom::CheckpointError(loom::detail::cat("checkpoint value ", key, " is '", text,
                                                  "', not a count; the manifest is damaged"));
  }

  Mode mode_ = Mode::fp32;
  std::string mode_name_ = "fp32", where_mode_;
  // Note [Falling back from fp16]
  bool fallback_on_ = false;
  int64_t fallback_after_ = 20;
  std::string fallback_choice_ = "auto";
  int64_t overflow_streak_ = 0;    // overflowing steps in a row, up to the last one
  std::string fallen_from_;        // after a fallback: the mode the run started in
  int64_t fallback_step_ = 0;      // the step that switched
  std::vector<at::Tensor> frozen_tensors_;  // held in half by hold_frozen_in_half
  at::ScalarType dtype_ = at::kFloat;
  c10::Device device_{c10::kCPU};
  LossScaler scaler_;
  bool auto_ = false;
  bool autocast_on_ = false, saved_enabled_ = false, flags_set_ = false;
  bool cache_for_step_ = true;  // Note [Cast once per update]
  bool frozen_half_ = true, frozen_decided_ = false;  // Note [Frozen weights in half]
  at::ScalarType saved_dtype_ = at::kFloat;
  at::Float32Precision saved_matmul_ = at::Float32Precision::NONE,
                       saved_conv_ = at::Float32Precision::NONE;
};

}  // namespace

LOOM_DEFINE_PLUGIN(Precision, "precision", "1.0.0")
