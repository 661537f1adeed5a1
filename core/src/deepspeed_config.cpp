// Note [DeepSpeed config files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A DeepSpeed user brings their ds_config.json as it is: `[train] deepspeed = "ds_config.json"`
// (the Trainer's key, relative to the job file) or `loom run --deepspeed FILE`. When the job is
// parsed, every key of the file becomes the loom key it means, one info line each, and the
// [train] deepspeed key goes: the resolved job, its config hash and the job kept in checkpoints
// hold loom's names only, so a DeepSpeed-config job IS the loom-keyed job it maps to (same
// hash, same run, bit for bit).
//
// The rules are those of transformers' DeepSpeed integration (HfTrainerDeepSpeedConfig):
// - "auto" takes the job's value: the job's own key, else loom's default, which for every key
//   that "auto" may stand for equals the Trainer's default (learning_rate 5e-5, betas
//   0.9/0.999, eps 1e-8, max_grad_norm 1, micro-batch 8, accumulation 1, warm-up 0).
// - A value the file gives and the job also sets must agree (HF's "mismatch" error), naming
//   both places; equal values are fine.
// - A key the file leaves out has DeepSpeed's default (e.g. WarmupLR's warmup_max_lr 0.001,
//   fp16's loss_scale_window 1000 and hysteresis 2), as DeepSpeed itself would run it.
// - train_batch_size = micro-batch × accumulation × world size, checked, or the missing one of
//   the three derived from it as DeepSpeed does.
// - The bucket sizes and stage-3 thresholds' "auto" are HF's functions of the model's hidden
//   size (hidden², 0.9·hidden², 10·hidden), read from [model] or the from_pretrained folder's
//   config.json; where neither says, loom's defaults stand (said in the notes).
// Keys that change nothing in loom (a profiler, a tuning knob of DeepSpeed's own kernels) are
// warnings naming them; keys whose behaviour loom lacks (ZeRO++ quantization, hpZ, a static
// loss scale, Adam with L2 regularisation, pipeline or tensor parallelism ...) are refused by
// name, never approximated. An unknown key under zero_optimization is refused as DeepSpeed
// refuses it; an unknown top-level key is a warning.
//
// DeepSpeed's "bf16" keeps the weights in bf16 with fp32 masters in the optimizer: loom's
// [precision] mode = "full_bf16" (not the Trainer's bf16, which is autocast); its
// bf16_master_weights_and_grads and bf16_optimizer_states are [optimizer] master_dtype and
// state_dtype = "bf16"; "fp16" likewise
// is "full_fp16" with DeepSpeed's dynamic loss scaler (hysteresis and a floor included). Its
// schedulers are loom schedules of their own (ds_warmup_lr, ds_warmup_decay_lr,
// ds_warmup_cosine_lr: schedule.cpp) that give DeepSpeed's rate at every update.
#include "deepspeed_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "job.h"
#include "loom/error.h"

namespace loom {
namespace {

using json = nlohmann::json;

std::string json_text(const json& v) {
  return v.dump();
}

const char* json_kind(const json& v) {
  if (v.is_boolean()) return "true or false";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

bool is_auto(const json& v) {
  return v.is_string() && v.get<std::string>() == "auto";
}

// The same ConfigValue type loom's own job would give the key, so the config hash of a
// DeepSpeed-config job equals the loom-keyed job's (5e8 and 500000000 must both be a float
// where loom's key is one).
enum class Kind { Int, Float, Bool, String };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int:
      return "an integer";
    case Kind::Float:
      return "a number";
    case Kind::Bool:
      return "true or false";
    default:
      return "a string";
  }
}

double number_of(const ConfigValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v.value)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(&v.value)) return *d;
  return std::nan("");
}

bool same_value(const ConfigValue& a, const ConfigValue& b) {
  const bool a_number = a.type() == ValueType::Int || a.type() == ValueType::Float;
  const bool b_number = b.type() == ValueType::Int || b.type() == ValueType::Float;
  if (a_number && b_number) return number_of(a) == number_of(b);
  return a.to_text() == b.to_text();
}

class Mapper {
 public:
  Mapper(ConfigValue& root, std::string file, int world_size, std::filesystem::path job_dir)
      : root_(root), file_(std::move(file)), world_(world_size), job_dir_(std::move(job_dir)) {}

  void map(const json& ds) {
    LOOM_CHECK_AS(ConfigError, ds.is_object(), file_,
                  ": a DeepSpeed config is a JSON object "
                  "({ \"zero_optimization\": {...}, ... }), not ",
                  json_kind(ds));
    static const std::set<std::string> handled = {"train_batch_size",
                                                  "train_micro_batch_size_per_gpu",
                                                  "gradient_accumulation_steps",
                                                  "gradient_clipping",
                                                  "zero_optimization",
                                                  "bf16",
                                                  "bfloat16",
                                                  "fp16",
                                                  "torch_autocast",
                                                  "optimizer",
                                                  "scheduler",
                                                  "aio",
                                                  "tensorboard"};
    // Keys that change nothing here, and why: a warning each.
    static const std::map<std::string, std::string> no_effect = {
        {"steps_per_print", "loom logs every [train] logging_steps"},
        {"wall_clock_breakdown", "loom's metrics.jsonl times every step"},
        {"memory_breakdown", "loom's metrics.jsonl records memory every step"},
        {"dump_state", "no DeepSpeed engine to dump"},
        {"flops_profiler", "no FLOPs profiler in loom"},
        {"comms_logger", "no communication logger in loom"},
        {"zero_allow_untested_optimizer", "every loom update rule shards"},
        {"zero_force_ds_cpu_optimizer", "loom's update rules run where the state lives"},
        {"checkpoint",
         "loom's checkpoints are its own (tag validation, universal loading and "
         "node-local storage do not apply)"},
        {"data_types", "loom accumulates gradients in fp32"},
        {"communication_data_type", "loom reduces gradients in fp32"},
        {"seq_parallel_communication_data_type", "loom has no sequence parallelism to tune"},
        {"nebula", "loom writes its own checkpoints"},
        {"disable_allgather", "loom's ZeRO driver chooses its collectives"},
        {"prescale_gradients", "loom divides the gradients once, after the reduction"},
        {"gradient_predivide_factor", "loom divides the gradients once, after the reduction"},
        {"sparse_gradients", "loom's embeddings have dense gradients"},
        {"activation_checkpointing",
         "it configures deepspeed.checkpointing, which loom's "
         "models do not call; use [train] gradient_checkpointing "
         "or a [checkpointing] table"},
        {"amp", "NVIDIA Apex is not used"}};
    // Behaviour loom lacks: refused when switched on.
    static const std::map<std::string, std::string> lacking = {
        {"wandb", "loom reports to TensorBoard ([train] report_to) and metrics.jsonl"},
        {"csv_monitor", "loom writes metrics.jsonl"},
        {"sparse_attention", "loom has no sparse attention"},
        {"elasticity", "loom's world size is the launcher's"},
        {"curriculum_learning", "loom has no curriculum learning"},
        {"data_efficiency", "loom has no data-efficiency library"},
        {"compression_training", "loom has no compression training"},
        {"hybrid_engine", "loom has no hybrid engine"},
        {"quantize_training", "loom has no quantized training"},
        {"weight_quantization", "loom has no weight quantization"},
        {"pipeline", "loom has no pipeline parallelism"},
        {"tensor_parallel", "loom has no tensor parallelism"},
        {"sequence_parallel_size", "loom has no sequence parallelism"},
        {"eigenvalue", "loom has no eigenvalue monitor"},
        {"progressive_layer_drop", "loom has no progressive layer drop"}};
    for (const auto& [key, value] : ds.items()) {
      if (handled.count(key)) continue;
      if (auto it = no_effect.find(key); it != no_effect.end()) {
        if (key == "amp" && switched_on(value))
          refuse(key, "Apex AMP: use \"bf16\" or \"fp16\" (loom's full_bf16/full_fp16)");
        if ((key == "prescale_gradients" || key == "sparse_gradients") && value.is_boolean() &&
            value.get<bool>())
          refuse(key, it->second);
        if (key == "gradient_predivide_factor" && value.is_number() && value.get<double>() != 1.0)
          refuse(key, it->second);
        if (key == "activation_checkpointing" && value.is_object())
          for (const char* k : {"partition_activations", "cpu_checkpointing"})
            if (value.contains(k) && value[k].is_boolean() && value[k].get<bool>())
              refuse(std::string("activation_checkpointing.") + k,
                     "loom's activation checkpointing recomputes and keeps nothing on the CPU; "
                     "use [train] gradient_checkpointing");
        if ((key == "communication_data_type" || key == "data_types") && value.is_string() &&
            value.get<std::string>() != "fp32")
          refuse(key, "loom reduces and accumulates gradients in fp32");
        warn(key, it->second);
        continue;
      }
      if (auto it = lacking.find(key); it != lacking.end()) {
        const bool on =
            switched_on(value) || (value.is_number() && value.get<double>() > 1) ||
            (value.is_object() && value.contains("autotp_size") &&
             value["autotp_size"].is_number() && value["autotp_size"].get<double>() > 1);
        if (on) refuse(key, it->second);
        warn(key, "not enabled; nothing to do");
        continue;
      }
      warn(key, "not a DeepSpeed key loom knows; ignored");
    }

    map_batch(ds);
    if (ds.contains("gradient_clipping"))
      assign("gradient_clipping", ds["gradient_clipping"], "train", "max_grad_norm", Kind::Float);
    map_precision(ds);
    if (ds.contains("optimizer")) map_optimizer(ds["optimizer"]);
    if (ds.contains("scheduler")) map_scheduler(ds["scheduler"]);
    if (ds.contains("zero_optimization")) map_zero(ds["zero_optimization"], ds);
    if (ds.contains("tensorboard")) map_tensorboard(ds["tensorboard"]);
  }

  DeepSpeedMapping result() && { return {std::move(notes_), std::move(warnings_)}; }

 private:
  // ---- the job's side ----
  ConfigValue* table(const std::string& name) { return root_.find(name); }
  ConfigValue& table_made(const std::string& name) { return table_of(root_, name, file_); }
  const ConfigValue* job_value(const std::string& name, const std::string& key) {
    const ConfigValue* t = table(name);
    return t && t->is_table() ? t->find(key) : nullptr;
  }
  std::optional<ConfigValue> take(const std::string& name, const std::string& key) {
    return take_key(root_, name, key);
  }

  // ---- the file's side ----
  std::string where(const std::string& ds_key) const { return file_ + ": " + ds_key; }
  [[noreturn]] void refuse(const std::string& ds_key, const std::string& why) const {
    throw ConfigError(detail::cat(where(ds_key), ": loom cannot do this (", why,
                                  "); remove the key or switch it off"));
  }
  void warn(const std::string& ds_key, const std::string& why) {
    warnings_.push_back(detail::cat(where(ds_key), " changes nothing in loom: ", why));
  }
  void note(const std::string& text) { notes_.push_back(file_ + ": " + text); }
  static bool switched_on(const json& v) {
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_object() && v.contains("enabled"))
      return v["enabled"].is_boolean() && v["enabled"].get<bool>();
    return false;
  }

  ConfigValue converted(const std::string& ds_key, const json& v, Kind kind) const {
    ConfigValue out;
    out.where = where(ds_key);
    const bool integral =
        v.is_number_integer() || v.is_number_unsigned() ||
        (v.is_number_float() && std::isfinite(v.get<double>()) &&
         v.get<double>() == std::floor(v.get<double>()) && std::fabs(v.get<double>()) < 9.0e15);
    switch (kind) {
      case Kind::Int:
        LOOM_CHECK_AS(ConfigError, v.is_number() && integral, out.where,
                      " takes an integer, "
                      "not ",
                      json_kind(v), " (", json_text(v), ")");
        out.value = v.is_number_float() ? static_cast<int64_t>(v.get<double>()) : v.get<int64_t>();
        break;
      case Kind::Float:
        LOOM_CHECK_AS(ConfigError, v.is_number() && std::isfinite(v.get<double>()), out.where,
                      " takes a number, not ", json_kind(v), " (", json_text(v), ")");
        out.value = v.get<double>();
        break;
      case Kind::Bool:
        LOOM_CHECK_AS(ConfigError, v.is_boolean(), out.where, " takes true or false, not ",
                      json_kind(v), " (", json_text(v), ")");
        out.value = v.get<bool>();
        break;
      case Kind::String:
        LOOM_CHECK_AS(ConfigError, v.is_string(), out.where, " takes a string, not ", json_kind(v),
                      " (", json_text(v), ")");
        out.value = v.get<std::string>();
        break;
    }
    return out;
  }

  // [name] key = the file's value (HF's fill_match): "auto" leaves the job's; a value the job
  // also sets (in loom's key or, for [train] keys, the Trainer's alias) must agree.
  void assign(const std::string& ds_key, const json& v, const std::string& name,
              const std::string& key, Kind kind, const std::string& alias = "") {
    if (is_auto(v)) {
      note(detail::cat(ds_key, " = \"auto\": the job's [", name, "] ", key));
      return;
    }
    put(ds_key, converted(ds_key, v, kind), name, key, alias);
  }
  // `written`: the file's value as written, where loom's differs (AdamW -> "adamw").
  void put(const std::string& ds_key, ConfigValue value, const std::string& name,
           const std::string& key, const std::string& alias = "", const std::string& written = "") {
    const ConfigValue* existing = job_value(name, key);
    std::string existing_name = detail::cat("[", name, "] ", key);
    if (!existing && !alias.empty()) {
      existing = job_value("train", alias);
      existing_name = "[train] " + alias;
    }
    if (existing) {
      LOOM_CHECK_AS(ConfigError, same_value(*existing, value), value.where, " = ", display_text(value),
                    " and ", existing->where, ": ", existing_name, " = ", display_text(*existing),
                    " are one setting with two values; keep one (or write \"auto\" in the "
                    "DeepSpeed file to take the job's)");
      note(detail::cat(ds_key, " = ", display_text(value), " agrees with the job's ", existing_name));
      return;
    }
    note(detail::cat(ds_key, " = ", written.empty() ? display_text(value) : written, " -> [", name, "] ",
                     key, " = ", display_text(value)));
    std::get<ConfigTable>(table_made(name).value).emplace_back(key, std::move(value));
  }
  // A value loom must have whatever the job says (DeepSpeed's default where the file is silent).
  void put_default(const std::string& ds_key, ConfigValue value, const std::string& name,
                   const std::string& key, const std::string& alias = "") {
    value.where = where(ds_key) + " (DeepSpeed's default)";
    put(ds_key, std::move(value), name, key, alias);
  }

  std::optional<int64_t> explicit_int(const std::string& ds_key, const json& ds) const {
    if (!ds.contains(ds_key) || is_auto(ds[ds_key])) return std::nullopt;
    const ConfigValue v = converted(ds_key, ds[ds_key], Kind::Int);
    const int64_t n = std::get<int64_t>(v.value);
    LOOM_CHECK_AS(ConfigError, n >= 1, v.where, " must be >= 1, got ", n);
    return n;
  }
  std::optional<int64_t> job_int(const std::string& key) const {
    const ConfigValue* t = root_.find("train");
    const ConfigValue* v = t && t->is_table() ? t->find(key) : nullptr;
    if (!v || v->type() != ValueType::Int) return std::nullopt;
    return std::get<int64_t>(v->value);
  }

  // ---- batch ----
  void map_batch(const json& ds) {
    for (const char* key : {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
      if (ds.contains(key))
        assign(key, ds[key], "train",
               std::string(key) == "gradient_accumulation_steps" ? "gradient_accumulation_steps"
                                                                 : "per_device_train_batch_size",
               Kind::Int);
    const auto total = explicit_int("train_batch_size", ds);
    if (!total) {
      if (ds.contains("train_batch_size"))
        note("train_batch_size = \"auto\": micro-batch x accumulation x world size");
      return;
    }
    std::optional<int64_t> micro = job_int("per_device_train_batch_size");
    std::optional<int64_t> accumulation = job_int("gradient_accumulation_steps");
    const std::string sizes = detail::cat("world size ", world_);
    if (micro && accumulation) {
      LOOM_CHECK_AS(ConfigError, *total == *micro * *accumulation * world_,
                    where("train_batch_size"), " = ", *total,
                    " but train_micro_batch_size_per_gpu (", *micro,
                    ") x gradient_accumulation_steps (", *accumulation, ") x ", sizes, " = ",
                    *micro * *accumulation * world_,
                    "; make the three agree (or write "
                    "train_batch_size = \"auto\")");
      note(detail::cat("train_batch_size = ", *total, " = ", *micro, " x ", *accumulation, " x ",
                       world_, " ranks"));
      return;
    }
    // DeepSpeed derives the one left out; both left out: no accumulation.
    const int64_t known = micro ? *micro : accumulation ? *accumulation : 1;
    LOOM_CHECK_AS(ConfigError, *total % (known * world_) == 0, where("train_batch_size"), " = ",
                  *total, " is not a multiple of ",
                  micro ? "train_micro_batch_size_per_gpu (" + std::to_string(*micro) + ") x "
                  : accumulation
                      ? "gradient_accumulation_steps (" + std::to_string(*accumulation) + ") x "
                      : std::string(),
                  sizes,
                  "; give train_micro_batch_size_per_gpu and gradient_accumulation_steps "
                  "so that their product times the world size is train_batch_size");
    const int64_t derived = *total / (known * world_);
    ConfigValue value{derived, where("train_batch_size")};
    if (!micro && !accumulation) {
      put("train_batch_size", ConfigValue{int64_t{1}, where("train_batch_size")}, "train",
          "gradient_accumulation_steps");
      put("train_batch_size", value, "train", "per_device_train_batch_size");
    } else {
      put("train_batch_size", value, "train",
          micro ? "gradient_accumulation_steps" : "per_device_train_batch_size");
    }
  }

  // ---- precision ----
  // The Trainer's flag ([train] bf16 / fp16), taken: under DeepSpeed it means DeepSpeed's mode.
  std::optional<bool> trainer_flag(const std::string& key) {
    auto v = take("train", key);
    if (!v) return std::nullopt;
    LOOM_CHECK_AS(ConfigError, v->type() == ValueType::Bool, v->where, ": [train] ", key,
                  " (a TrainingArguments flag) takes true or false, not ", v->to_text());
    return std::get<bool>(v->value);
  }
  // `section`.enabled, with "auto" (or no "enabled") taking the Trainer's flag.
  bool enabled(const std::string& section, const json& ds, std::optional<bool> flag) {
    const json& s = ds[section];
    LOOM_CHECK_AS(ConfigError, s.is_object(), where(section),
                  " must be an object such as "
                  "{ \"enabled\": true }, not ",
                  json_kind(s));
    if (!s.contains("enabled") || is_auto(s["enabled"])) return flag.value_or(false);
    const bool on = std::get<bool>(converted(section + ".enabled", s["enabled"], Kind::Bool).value);
    LOOM_CHECK_AS(ConfigError, !flag || *flag == on, where(section + ".enabled"), " = ",
                  on ? "true" : "false", " but the job's [train] ",
                  section == "fp16" ? "fp16" : "bf16", " = ",
                  flag.value_or(false) ? "true" : "false", "; keep one (or write \"auto\")");
    return on;
  }
  void map_precision(const json& ds) {
    const std::optional<bool> bf16_flag =
        ds.contains("bf16") || ds.contains("bfloat16") ? trainer_flag("bf16") : std::nullopt;
    const std::optional<bool> fp16_flag = ds.contains("fp16") ? trainer_flag("fp16") : std::nullopt;
    const std::string bf16_key = ds.contains("bf16") ? "bf16" : "bfloat16";
    const bool bf16 =
        (ds.contains("bf16") || ds.contains("bfloat16")) && enabled(bf16_key, ds, bf16_flag);
    const bool fp16 = ds.contains("fp16") && enabled("fp16", ds, fp16_flag);
    LOOM_CHECK_AS(ConfigError, !(bf16 && fp16), file_,
                  ": bf16 and fp16 are both enabled; "
                  "DeepSpeed trains in one of them");
    if (ds.contains(bf16_key) && ds[bf16_key].is_object()) {
      for (const auto& [key, value] : ds[bf16_key].items()) {
        if (key == "enabled") continue;
        // DeepSpeed's low-precision options (its PR 7700): no fp32 masters (loom's bf16 weights
        // are their own: Note [bf16 weights as their own masters]; DeepSpeed keeps a bf16 copy
        // beside them) and bf16 moments (Note [Stochastic rounding of the state]).
        static const std::map<std::string, std::string> low_precision = {
            {"bf16_master_weights_and_grads", "master_dtype"},
            {"bf16_optimizer_states", "state_dtype"}};
        if (const auto found = low_precision.find(key); found != low_precision.end()) {
          const bool on =
              std::get<bool>(converted(bf16_key + "." + key, value, Kind::Bool).value);
          LOOM_CHECK_AS(ConfigError, !on || bf16, where(bf16_key + "." + key),
                        " = true keeps bf16 state for bf16 weights, but ", bf16_key,
                        " is not enabled; enable it, or remove the key");
          put(bf16_key + "." + key, ConfigValue{std::string(on ? "bf16" : "fp32"),
                                                where(bf16_key + "." + key)},
              "optimizer", found->second, "", on ? "true" : "false");
          continue;
        }
        warn(bf16_key + "." + key, "loom's full_bf16 has no such switch");
      }
    }
    if (bf16) {
      put_mode(bf16_key + ".enabled", "full_bf16",
               "DeepSpeed's bf16 keeps the weights in bf16, fp32 masters in the optimizer");
    }
    if (fp16) {
      put_mode("fp16.enabled", "full_fp16",
               "DeepSpeed's fp16 keeps the weights in fp16, fp32 masters in the optimizer");
      map_loss_scaler(ds["fp16"]);
    } else if (ds.contains("fp16") && ds["fp16"].is_object()) {
      for (const auto& [key, value] : ds["fp16"].items())
        if (key != "enabled") warn("fp16." + key, "fp16 is not enabled");
    }
    if (ds.contains("torch_autocast") && switched_on(ds["torch_autocast"])) {
      const json& t = ds["torch_autocast"];
      LOOM_CHECK_AS(ConfigError, !bf16 && !fp16, where("torch_autocast"),
                    ": autocast beside "
                    "DeepSpeed's ",
                    bf16 ? "bf16" : "fp16", " weights; use one of them");
      std::string dtype = "bfloat16";
      if (t.contains("dtype"))
        dtype = std::get<std::string>(
            converted("torch_autocast.dtype", t["dtype"], Kind::String).value);
      std::string mode;
      if (dtype == "bfloat16" || dtype == "torch.bfloat16" || dtype == "bf16")
        mode = "bf16";
      else if (dtype == "float16" || dtype == "torch.float16" || dtype == "fp16")
        mode = "fp16";
      else
        throw ConfigError(detail::cat(where("torch_autocast.dtype"), " = \"", dtype,
                                      "\": autocast runs in bfloat16 or float16"));
      put_mode("torch_autocast", mode, "autocast over fp32 weights");
      for (const auto& [key, value] : t.items())
        if (key != "enabled" && key != "dtype")
          warn("torch_autocast." + key, "loom autocasts every matmul");
    }
  }
  void put_mode(const std::string& ds_key, const std::string& mode, const std::string& why) {
    put(ds_key, ConfigValue{mode, where(ds_key)}, "precision", "mode", "", "true (" + why + ")");
  }
  // DeepSpeed's dynamic loss scaler with its defaults, onto loom's (Note [Dynamic loss scaling]).
  void map_loss_scaler(const json& fp16) {
    static const std::set<std::string> known = {"enabled",
                                                "auto_cast",
                                                "loss_scale",
                                                "initial_scale_power",
                                                "loss_scale_window",
                                                "hysteresis",
                                                "consecutive_hysteresis",
                                                "min_loss_scale",
                                                "fp16_master_weights_and_grads"};
    for (const auto& [key, value] : fp16.items())
      if (!known.count(key)) refuse("fp16." + key, "not a key of DeepSpeed's fp16 section");
    auto get = [&](const std::string& key, const json& fallback) {
      return fp16.contains(key) && !is_auto(fp16[key]) ? fp16[key] : fallback;
    };
    if (fp16.contains("fp16_master_weights_and_grads") &&
        switched_on(fp16["fp16_master_weights_and_grads"]))
      refuse("fp16.fp16_master_weights_and_grads", "loom keeps fp32 masters for fp16 weights");
    if (fp16.contains("auto_cast"))
      warn("fp16.auto_cast",
           "loom's models take token ids, and full_fp16 computes in fp16 already");
    const ConfigValue static_scale =
        converted("fp16.loss_scale", get("loss_scale", 0), Kind::Float);
    if (number_of(static_scale) != 0)
      refuse("fp16.loss_scale",
             "a static loss scale; loom's fp16 scales dynamically: set "
             "loss_scale to 0");
    const ConfigValue power =
        converted("fp16.initial_scale_power", get("initial_scale_power", 16), Kind::Int);
    const int64_t p = std::get<int64_t>(power.value);
    LOOM_CHECK_AS(ConfigError, p >= 0 && p <= 64, power.where, " must be 0 to 64, got ", p);
    const auto from = [&](const std::string& key, ConfigValue v) {
      if (!fp16.contains(key) || is_auto(fp16[key]))
        v.where = where("fp16." + key) + " (DeepSpeed's default)";
      return v;
    };
    put("fp16.initial_scale_power",
        from("initial_scale_power", ConfigValue{std::ldexp(1.0, static_cast<int>(p)), power.where}),
        "precision", "init_scale");
    put("fp16.loss_scale_window",
        from("loss_scale_window",
             converted("fp16.loss_scale_window", get("loss_scale_window", 1000), Kind::Int)),
        "precision", "growth_interval");
    put("fp16.hysteresis",
        from("hysteresis", converted("fp16.hysteresis", get("hysteresis", 2), Kind::Int)),
        "precision", "hysteresis");
    put("fp16.consecutive_hysteresis",
        from("consecutive_hysteresis", converted("fp16.consecutive_hysteresis",
                                                 get("consecutive_hysteresis", false), Kind::Bool)),
        "precision", "consecutive_hysteresis");
    put("fp16.min_loss_scale",
        from("min_loss_scale",
             converted("fp16.min_loss_scale", get("min_loss_scale", 1), Kind::Float)),
        "precision", "min_scale");
  }

  // ---- optimizer ----
  void map_optimizer(const json& o) {
    LOOM_CHECK_AS(ConfigError, o.is_object() && o.contains("type"), where("optimizer"),
                  " must be an object with a \"type\" (\"AdamW\", \"Adam\", \"Lion\", \"SGD\")");
    const std::string type =
        std::get<std::string>(converted("optimizer.type", o["type"], Kind::String).value);
    std::string lower = type;
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    const json params = o.contains("params") ? o["params"] : json::object();
    LOOM_CHECK_AS(ConfigError, params.is_object(), where("optimizer.params"), " must be an object");
    for (const auto& [key, value] : o.items())
      if (key != "type" && key != "params")
        warn("optimizer." + key, "not a key of DeepSpeed's optimizer section");

    std::string name;
    std::map<std::string, std::function<void(const json&)>> keys;
    const auto param = [&](const std::string& key) { return "optimizer.params." + key; };
    const auto betas = [&](const json& v) {
      if (is_auto(v)) {
        note(param("betas") + " = \"auto\": the job's beta1, beta2");
        return;
      }
      LOOM_CHECK_AS(ConfigError, v.is_array() && v.size() == 2, where(param("betas")),
                    " takes two numbers [beta1, beta2], not ", json_text(v));
      assign(param("betas") + "[0]", v[0], "optimizer", "beta1", Kind::Float, "adam_beta1");
      assign(param("betas") + "[1]", v[1], "optimizer", "beta2", Kind::Float, "adam_beta2");
    };
    // DeepSpeed's defaults where the file is silent (torch's Adam: lr 1e-3).
    std::map<std::string, json> defaults;
    if (lower == "adam" || lower == "adamw" || lower == "fusedadam" || lower == "cpuadam") {
      name = "adamw";
      // DeepSpeed's Adam is decoupled (AdamW) unless adam_w_mode = false.
      if (params.contains("adam_w_mode") && params["adam_w_mode"].is_boolean() &&
          !params["adam_w_mode"].get<bool>())
        refuse(param("adam_w_mode"),
               "Adam with L2 regularisation; loom's adamw decays the "
               "weights decoupled (adam_w_mode = true)");
      if (params.contains("amsgrad") && switched_on(params["amsgrad"]))
        refuse(param("amsgrad"), "AMSGrad");
      if (params.contains("bias_correction") && params["bias_correction"].is_boolean() &&
          !params["bias_correction"].get<bool>())
        refuse(param("bias_correction"), "Adam without bias correction");
      keys["betas"] = betas;
      keys["eps"] = [&](const json& v) {
        assign(param("eps"), v, "optimizer", "eps", Kind::Float, "adam_epsilon");
      };
      keys["weight_decay"] = [&](const json& v) {
        assign(param("weight_decay"), v, "optimizer", "weight_decay", Kind::Float, "weight_decay");
      };
      for (const char* k : {"adam_w_mode", "amsgrad", "bias_correction"})
        keys[k] = [](const json&) {};
      keys["torch_adam"] = [&](const json&) {
        warn(param("torch_adam"), "loom's adamw is its own fused kernel");
      };
      keys["fused"] = [&](const json&) {
        warn(param("fused"), "loom's adamw is its own fused kernel");
      };
      defaults = {
          {"lr", 1e-3}, {"betas", json::array({0.9, 0.999})}, {"eps", 1e-8}, {"weight_decay", 0.0}};
    } else if (lower == "lion") {
      name = "lion";
      keys["betas"] = betas;
      keys["weight_decay"] = [&](const json& v) {
        assign(param("weight_decay"), v, "optimizer", "weight_decay", Kind::Float, "weight_decay");
      };
      defaults = {{"lr", 1e-4}, {"betas", json::array({0.9, 0.99})}, {"weight_decay", 0.0}};
    } else if (lower == "sgd") {
      name = "sgd";
      for (const char* k : {"momentum", "dampening", "weight_decay"})
        keys[k] = [&, k](const json& v) { assign(param(k), v, "optimizer", k, Kind::Float); };
      keys["nesterov"] = [&](const json& v) {
        assign(param("nesterov"), v, "optimizer", "nesterov", Kind::Bool);
      };
    } else {
      throw ConfigError(detail::cat(where("optimizer.type"), " = \"", type,
                                    "\": loom has no such "
                                    "update rule; from a DeepSpeed file it takes Adam, AdamW, Lion "
                                    "and SGD (other rules: [optimizer] name = \"adafactor\", "
                                    "\"adam8bit\" in the job)"));
    }
    put("optimizer.type", ConfigValue{name, where("optimizer.type")}, "optimizer", "name", "",
        "\"" + type + "\"");
    keys["lr"] = [&](const json& v) {
      assign(param("lr"), v, "train", "learning_rate", Kind::Float);
    };
    for (const auto& [key, value] : params.items()) {
      auto it = keys.find(key);
      if (it == keys.end())
        refuse(param(key), detail::cat("a parameter of ", type, " that loom's ", name, " lacks"));
      it->second(value);
    }
    for (const auto& [key, value] : defaults)
      if (!params.contains(key)) {
        if (key == "betas") {
          put_default(param("betas"), ConfigValue{value[0].get<double>(), ""}, "optimizer", "beta1",
                      "adam_beta1");
          put_default(param("betas"), ConfigValue{value[1].get<double>(), ""}, "optimizer", "beta2",
                      "adam_beta2");
        } else {
          const bool lr = key == "lr";
          put_default(param(key), ConfigValue{value.get<double>(), ""}, lr ? "train" : "optimizer",
                      lr ? "learning_rate" : key,
                      lr             ? ""
                      : key == "eps" ? "adam_epsilon"
                                     : key);
        }
      }
  }

  // ---- scheduler ----
  void map_scheduler(const json& s) {
    LOOM_CHECK_AS(ConfigError, s.is_object() && s.contains("type"), where("scheduler"),
                  " must be an object with a \"type\" (WarmupLR, WarmupDecayLR, WarmupCosineLR)");
    const std::string type =
        std::get<std::string>(converted("scheduler.type", s["type"], Kind::String).value);
    const json params = s.contains("params") ? s["params"] : json::object();
    LOOM_CHECK_AS(ConfigError, params.is_object(), where("scheduler.params"), " must be an object");
    static const std::map<std::string, std::string> kinds = {
        {"WarmupLR", "ds_warmup_lr"},
        {"WarmupDecayLR", "ds_warmup_decay_lr"},
        {"WarmupCosineLR", "ds_warmup_cosine_lr"}};
    auto kind = kinds.find(type);
    if (kind == kinds.end())
      throw ConfigError(detail::cat(where("scheduler.type"), " = \"", type,
                                    "\": loom runs "
                                    "DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR (or "
                                    "the Trainer's schedules by [train] lr_scheduler_type)"));
    const bool cosine = type == "WarmupCosineLR", decays = type != "WarmupLR";
    put("scheduler.type", ConfigValue{kind->second, where("scheduler.type")}, "train",
        "lr_scheduler_type", "", "\"" + type + "\"");
    const auto param = [&](const std::string& key) { return "scheduler.params." + key; };
    std::set<std::string> known = {"warmup_num_steps", "warmup_type", "last_batch_iteration"};
    if (cosine)
      known.insert({"total_num_steps", "warmup_min_ratio", "cos_min_ratio"});
    else
      known.insert({"warmup_min_lr", "warmup_max_lr"});
    if (decays) known.insert("total_num_steps");
    for (const auto& [key, value] : params.items())
      if (!known.count(key))
        refuse(param(key), detail::cat("not a parameter of DeepSpeed's ", type));
    if (params.contains("last_batch_iteration") && !is_auto(params["last_batch_iteration"]) &&
        number_of(converted(param("last_batch_iteration"), params["last_batch_iteration"],
                            Kind::Int)) != -1)
      refuse(param("last_batch_iteration"),
             "a schedule started elsewhere; loom resumes its own "
             "from its checkpoints");

    // warmup_num_steps: the job's warm-up for "auto", else DeepSpeed's (1000 when silent).
    const json warmup =
        params.contains("warmup_num_steps") ? params["warmup_num_steps"] : json(1000);
    if (!is_auto(warmup)) {
      LOOM_CHECK_AS(ConfigError, !job_value("train", "warmup_ratio"),
                    job_value("train", "warmup_ratio") ? job_value("train", "warmup_ratio")->where
                                                       : std::string(),
                    ": [train] warmup_ratio "
                    "beside ",
                    where(param("warmup_num_steps")),
                    "; write warmup_num_steps = \"auto\" to "
                    "warm up for the job's ratio");
      ConfigValue v = converted(param("warmup_num_steps"), warmup, Kind::Int);
      if (!params.contains("warmup_num_steps")) v.where += " (DeepSpeed's default)";
      put(param("warmup_num_steps"), v, "train", "warmup_steps");
    } else {
      note(param("warmup_num_steps") + " = \"auto\": the job's warm-up");
    }
    ConfigTable kwargs;
    const auto kwarg = [&](const std::string& key, const json& fallback, Kind k) {
      const json v = params.contains(key) && !is_auto(params[key]) ? params[key] : fallback;
      ConfigValue c = converted(param(key), v, k);
      note(detail::cat(param(key), " = ", display_text(c), " -> [train] lr_scheduler_kwargs.", key));
      kwargs.emplace_back(key, std::move(c));
    };
    kwarg("warmup_type", "log", Kind::String);
    if (cosine) {
      kwarg("warmup_min_ratio", 0.0, Kind::Float);
      kwarg("cos_min_ratio", 1e-4, Kind::Float);
    } else {
      // HF fills warmup_min_lr's "auto" with 0; warmup_max_lr is the learning rate.
      kwarg("warmup_min_lr", 0.0, Kind::Float);
      const json max = params.contains("warmup_max_lr") ? params["warmup_max_lr"] : json(1e-3);
      if (is_auto(max)) {
        note(param("warmup_max_lr") + " = \"auto\": the job's learning_rate");
      } else {
        ConfigValue v = converted(param("warmup_max_lr"), max, Kind::Float);
        if (!params.contains("warmup_max_lr")) v.where += " (DeepSpeed's default)";
        put(param("warmup_max_lr"), v, "train", "learning_rate");
      }
    }
    if (decays) {
      if (!params.contains("total_num_steps") || is_auto(params["total_num_steps"])) {
        note(param("total_num_steps") + " = \"auto\": the job's steps");
      } else {
        LOOM_CHECK_AS(ConfigError,
                      !job_value("train", "num_train_epochs") || job_value("train", "max_steps"),
                      where(param("total_num_steps")),
                      " beside [train] num_train_epochs: the "
                      "steps are counted from the data; write total_num_steps = \"auto\"");
        put(param("total_num_steps"),
            converted(param("total_num_steps"), params["total_num_steps"], Kind::Int), "train",
            "max_steps");
      }
    }
    LOOM_CHECK_AS(ConfigError, !job_value("train", "lr_scheduler_kwargs"),
                  job_value("train", "lr_scheduler_kwargs")
                      ? job_value("train", "lr_scheduler_kwargs")->where
                      : std::string(),
                  ": [train] lr_scheduler_kwargs beside ", where("scheduler"),
                  "; the DeepSpeed "
                  "scheduler's params are its arguments");
    std::get<ConfigTable>(table_made("train").value)
        .emplace_back("lr_scheduler_kwargs",
                      ConfigValue{std::move(kwargs), where("scheduler.params")});
  }

  // ---- ZeRO ----
  // The model's hidden size for HF's "auto" bucket sizes: [model] or the from_pretrained folder.
  std::optional<int64_t> hidden_size() {
    const ConfigValue* model = table("model");
    if (!model || !model->is_table()) return std::nullopt;
    for (const char* key : {"hidden_size", "n_embd", "d_model"})
      if (const ConfigValue* v = model->find(key); v && v->type() == ValueType::Int)
        return std::get<int64_t>(v->value);
    const ConfigValue* folder = model->find("from_pretrained");
    if (!folder || folder->type() != ValueType::String) return std::nullopt;
    std::filesystem::path path = std::get<std::string>(folder->value);
    if (path.is_relative()) path = job_dir_ / path;
    std::ifstream in(path / "config.json");
    if (!in) return std::nullopt;
    const json config = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!config.is_object()) return std::nullopt;
    for (const char* key : {"hidden_size", "n_embd", "d_model"})
      if (config.contains(key) && config[key].is_number_integer())
        return config[key].get<int64_t>();
    return std::nullopt;
  }
  void hidden_auto(const std::string& ds_key, const std::string& key, double factor, bool squared) {
    const auto hidden = hidden_size();
    if (!hidden) {
      note(detail::cat(ds_key,
                       " = \"auto\": the model's hidden size is not in [model] (or its "
                       "from_pretrained config.json); loom's default [zero] ",
                       key, " stands"));
      return;
    }
    const double h = static_cast<double>(*hidden);
    // HF's int(0.9 * h * h): an integer, as loom's float key.
    const double value = std::floor(factor * (squared ? h * h : h));
    note(detail::cat(ds_key, " = \"auto\": from the hidden size ", *hidden));
    put(ds_key, ConfigValue{value, where(ds_key)}, "zero", key);
  }

  void map_zero(const json& z, const json& ds) {
    LOOM_CHECK_AS(ConfigError, z.is_object(), where("zero_optimization"),
                  " must be an object "
                  "such as { \"stage\": 2 }, not ",
                  json_kind(z));
    const auto key_of = [](const std::string& k) { return "zero_optimization." + k; };
    const int64_t stage =
        z.contains("stage")
            ? std::get<int64_t>(converted(key_of("stage"), z["stage"], Kind::Int).value)
            : 0;
    LOOM_CHECK_AS(ConfigError, stage >= 0 && stage <= 3, where(key_of("stage")),
                  " must be 0, 1, 2 or 3, got ", stage);
    put(key_of("stage"), ConfigValue{stage, where(key_of("stage"))}, "zero", "stage");

    static const std::map<std::string, std::string> no_effect = {
        {"allgather_partitions", "loom always all-gathers the updated partitions"},
        {"reduce_scatter", "loom reduce-scatters at stages 1-3 and all-reduces at stage 0"},
        {"contiguous_gradients", "loom's gradient buckets are contiguous already"},
        {"load_from_fp32_weights", "loom resumes from the fp32 masters always"},
        {"elastic_checkpoint", "loom reshards a checkpoint onto any number of ranks always"},
        {"sub_group_size", "loom updates each rank's shard tensor by tensor"},
        {"stage3_max_reuse_distance", "loom frees a gathered unit once its backward is done"},
        {"stage3_gather_16bit_weights_on_model_save",
         "loom's checkpoints are sharded; `loom "
         "consolidate` or `loom export` gives the whole model"},
        {"stage3_gather_fp16_weights_on_model_save",
         "loom's checkpoints are sharded; `loom "
         "consolidate` or `loom export` gives the whole model"},
        {"ignore_unused_parameters", "a parameter without a gradient gets none in loom too"},
        {"round_robin_gradients", "loom's buckets are its own"},
        {"mics_hierarchical_params_gather", "loom's gathers stay within the shard group"},
        {"memory_efficient_linear", "loom's Linear keeps what autograd needs"},
        {"override_module_apply", "loom's models do not use module.apply hooks"},
        {"pipeline_loading_checkpoint", "no pipeline engine"},
        {"use_multi_rank_bucket_allreduce", "loom's buckets are its own"},
        {"log_trace_cache_warnings", "loom has no trace cache"},
        {"stage3_module_granularity_threshold", "loom gathers by its model's units"},
        {"use_all_reduce_for_fetch_params", "loom gathers by all-gather"},
        {"cpu_offload_use_pin_memory", "mapped onto the offload tables' pin_memory"}};
    for (const auto& [key, value] : z.items()) {
      const std::string k = key_of(key);
      if (key == "stage") continue;
      if (key == "allgather_bucket_size" || key == "reduce_bucket_size" || key == "overlap_comm" ||
          key == "stage3_prefetch_bucket_size" || key == "stage3_param_persistence_threshold" ||
          key == "stage3_max_live_parameters") {
        const bool flag = key == "overlap_comm";
        if (is_auto(value) && key == "reduce_bucket_size")
          hidden_auto(k, key, 1.0, true);
        else if (is_auto(value) && stage == 3 && key == "stage3_prefetch_bucket_size")
          hidden_auto(k, key, 0.9, true);
        else if (is_auto(value) && stage == 3 && key == "stage3_param_persistence_threshold")
          hidden_auto(k, key, 10.0, false);
        else if (is_auto(value))
          note(k + " = \"auto\": loom's default");
        else
          assign(k, value, "zero", key, flag ? Kind::Bool : Kind::Float);
        continue;
      }
      if (key == "offload_optimizer" || key == "offload_param") {
        map_offload(k, value, key, ds);
        continue;
      }
      if (key == "cpu_offload" || key == "cpu_offload_params") {  // DeepSpeed's older spelling
        if (switched_on(value)) {
          json legacy = {{"device", "cpu"}};
          if (z.contains("cpu_offload_use_pin_memory"))
            legacy["pin_memory"] = z["cpu_offload_use_pin_memory"];
          map_offload(k, legacy, key == "cpu_offload" ? "offload_optimizer" : "offload_param", ds);
        }
        continue;
      }
      if (key == "zero_hpz_partition_size") {
        if (value.is_number() && value.get<double>() > 1)
          refuse(k, "hierarchical partitioning (ZeRO++ hpZ) is not in loom yet");
        continue;
      }
      if (key == "mics_shard_size") {
        // MiCS: every model state sharded within groups of this many ranks, replicated across
        // them: hybrid sharding (Note [Hybrid sharding] in loom/sharding/zero_driver.h). -1
        // (DeepSpeed's default) is off.
        if (value.is_number() && value.get<double>() > 0)
          assign(k, value, "zero", "shard_group_size", Kind::Int);
        continue;
      }
      if (key == "zero_quantized_weights" || key == "zero_quantized_gradients" ||
          key == "zero_quantized_nontrainable_weights") {
        if (switched_on(value)) refuse(k, "ZeRO++'s quantized communication");
        continue;
      }
      if (auto it = no_effect.find(key); it != no_effect.end()) {
        if (key != "cpu_offload_use_pin_memory") warn(k, it->second);
        continue;
      }
      std::vector<std::string> names = {"stage",
                                        "allgather_bucket_size",
                                        "reduce_bucket_size",
                                        "overlap_comm",
                                        "offload_optimizer",
                                        "offload_param",
                                        "stage3_prefetch_bucket_size",
                                        "stage3_param_persistence_threshold",
                                        "stage3_max_live_parameters",
                                        "zero_hpz_partition_size"};
      for (const auto& [name, why] : no_effect) names.push_back(name);
      const auto hint = closest_match(key, names);
      throw ConfigError(detail::cat(where(k), ": not a key of DeepSpeed's zero_optimization",
                                    hint ? "; did you mean '" + *hint + "'?" : std::string()));
    }
  }

  // offload_optimizer / offload_param = { device, nvme_path, pin_memory, buffer_count, ... } onto
  // [zero]'s table of the same name; aio's block_size and queue_depth go with an NVMe device.
  void map_offload(const std::string& ds_key, const json& o, const std::string& name,
                   const json& ds) {
    LOOM_CHECK_AS(ConfigError, o.is_object(), where(ds_key),
                  " must be an object such as "
                  "{ \"device\": \"cpu\" }, not ",
                  json_kind(o));
    std::string device = "none";
    if (o.contains("device"))
      device =
          std::get<std::string>(converted(ds_key + ".device", o["device"], Kind::String).value);
    LOOM_CHECK_AS(ConfigError, device == "none" || device == "cpu" || device == "nvme",
                  where(ds_key + ".device"), " = \"", device,
                  "\": DeepSpeed offloads to \"cpu\", "
                  "\"nvme\" or \"none\"");
    if (device == "none") {
      note(ds_key + ".device = \"none\": no offload");
      return;
    }
    ConfigTable out;
    out.emplace_back("device", ConfigValue{device, where(ds_key + ".device")});
    for (const auto& [key, value] : o.items()) {
      const std::string k = ds_key + "." + key;
      if (key == "device") continue;
      if (key == "nvme_path") {
        out.emplace_back(key, converted(k, value, Kind::String));
      } else if (key == "pin_memory") {
        out.emplace_back(key, converted(k, value, Kind::Bool));
      } else if (key == "buffer_count") {
        out.emplace_back(key, converted(k, value, Kind::Int));
      } else if (key == "ratio") {
        if (number_of(converted(k, value, Kind::Float)) != 1.0)
          refuse(k, "a partial offload; loom offloads the whole state (ratio 1.0)");
      } else if (key == "super_offload" && switched_on(value)) {
        refuse(k, "SuperOffload");
      } else if (key == "fast_init" || key == "pipeline_read" || key == "pipeline_write" ||
                 key == "pipeline" || key == "buffer_size" || key == "max_in_cpu" ||
                 key == "cpuadam_cores_perc" || key == "super_offload") {
        warn(k,
             "loom reads ahead and writes behind by itself, and sizes its buffers by the tensors");
      } else {
        refuse(k, detail::cat("not a key of DeepSpeed's ", name));
      }
    }
    if (device == "nvme" && ds.contains("aio") && ds["aio"].is_object()) {
      for (const auto& [key, value] : ds["aio"].items()) {
        if (key == "block_size" || key == "queue_depth") {
          const std::string& aio_key = key;  // a structured binding: clang captures no such name
          if (std::none_of(out.begin(), out.end(),
                           [&](const auto& kv) { return kv.first == aio_key; }))
            out.emplace_back(key, converted("aio." + key, value, Kind::Int));
        } else if (!aio_warned_) {
          warn("aio." + key,
               "loom's io_uring reader takes block_size and queue_depth only (its threads "
               "checking what lands are [zero] offload_optimizer / offload_param "
               "checksum_threads)");
        }
      }
      aio_warned_ = true;
    }
    // The whole table is one setting: the job's own must not also say where the state lives.
    LOOM_CHECK_AS(ConfigError, !job_value("zero", name),
                  job_value("zero", name) ? job_value("zero", name)->where : std::string(),
                  ": [zero] ", name, " beside ", where(ds_key), "; keep one");
    std::string text;
    for (const auto& [key, value] : out)
      text += (text.empty() ? "" : ", ") + key + " = " + display_text(value);
    note(detail::cat(ds_key, " -> [zero] ", name, " = { ", text, " }"));
    std::get<ConfigTable>(table_made("zero").value)
        .emplace_back(name, ConfigValue{std::move(out), where(ds_key)});
  }

  // DeepSpeed's own TensorBoard monitor: loom's report_to, into output_path/job_name.
  void map_tensorboard(const json& t) {
    if (!switched_on(t)) {
      warn("tensorboard", "not enabled; nothing to do");
      return;
    }
    put("tensorboard.enabled",
        ConfigValue{
            ConfigArray{ConfigValue{std::string("tensorboard"), where("tensorboard.enabled")}},
            where("tensorboard.enabled")},
        "train", "report_to");
    if (t.contains("output_path")) {
      std::string dir = std::get<std::string>(
          converted("tensorboard.output_path", t["output_path"], Kind::String).value);
      if (t.contains("job_name"))
        dir = (std::filesystem::path(dir) /
               std::get<std::string>(
                   converted("tensorboard.job_name", t["job_name"], Kind::String).value))
                  .string();
      put("tensorboard.output_path", ConfigValue{dir, where("tensorboard.output_path")}, "train",
          "logging_dir");
    }
  }

  ConfigValue& root_;
  std::string file_;
  int world_;
  std::filesystem::path job_dir_;
  bool aio_warned_ = false;
  std::vector<std::string> notes_, warnings_;
};

// nlohmann's parse error gives a byte offset: line and column are what a person can find.
[[noreturn]] void not_json(const std::string& file, const std::string& text,
                           const json::parse_error& e) {
  size_t line = 1, column = 1;
  const size_t end = std::min<size_t>(e.byte == 0 ? 0 : e.byte - 1, text.size());
  for (size_t i = 0; i < end; ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  std::string what = e.what();
  if (auto at = what.find("parse error"); at != std::string::npos) what = what.substr(at);
  throw ConfigError(detail::cat(file, ":", line, ":", column, ": not JSON (", what,
                                "); a DeepSpeed config is one JSON object"));
}

}  // namespace

DeepSpeedMapping map_deepspeed_config(ConfigValue& root, const std::filesystem::path& job_dir,
                                      int world_size) {
  const std::optional<ConfigValue> taken = take_key(root, "train", "deepspeed");
  if (!taken) return {};
  const ConfigValue& value = *taken;
  LOOM_CHECK_AS(ConfigError, value.type() == ValueType::String, value.where,
                ": [train] deepspeed "
                "names a DeepSpeed config file (\"ds_config.json\"), not ",
                value.to_text());
  std::filesystem::path path = std::get<std::string>(value.value);
  if (path.is_relative()) path = job_dir / path;
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  LOOM_CHECK_AS(ConfigError, in && std::filesystem::is_regular_file(path, ec), value.where,
                ": [train] deepspeed = \"", std::get<std::string>(value.value), "\": cannot read ",
                path.string(),
                "; give the path of a DeepSpeed config file (relative to the job file)");
  // A config is a few kB; a device or a huge file named by mistake must not be read for ever.
  constexpr uintmax_t kMaxBytes = 16u << 20;
  LOOM_CHECK_AS(ConfigError, std::filesystem::file_size(path, ec) <= kMaxBytes, value.where,
                ": [train] deepspeed = \"", std::get<std::string>(value.value),
                "\": ", path.string(), " is over 16 MiB; that is no DeepSpeed config file");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  const std::string name = path.string();
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    not_json(name, text, e);
  }
  Mapper mapper(root, name, std::max(1, world_size), job_dir);
  mapper.map(doc);
  DeepSpeedMapping out = std::move(mapper).result();
  out.notes.insert(out.notes.begin(), detail::cat(value.where, ": [train] deepspeed = \"",
                                                  std::get<std::string>(value.value),
                                                  "\": DeepSpeed's keys onto loom's tables"));
  return out;
}

}  // namespace loom
