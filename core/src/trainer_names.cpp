// Note [Trainer names]
// ~~~~~~~~~~~~~~~~~~~~
// A job written with Hugging Face TrainingArguments' spellings runs: the keys below, in
// [train], are rewritten onto loom's own tables when the job is parsed (after --set), each
// rewrite reported by one info line, so the resolved job, its config hash and the job saved in
// checkpoints hold loom's names only. The same setting spelled both ways is an error naming
// both; a value of the wrong type names the key and the type it takes. The keys loom already
// shares with the Trainer (max_steps, num_train_epochs, learning_rate, seed, data_seed,
// warmup_ratio, save_steps, logging_steps, logging_first_step, eval_strategy ...) need no
// rewrite.
//
//   bf16 / fp16 / tf32 = true      [precision] mode = "bf16" | "fp16" | "tf32" (autocast; note
//                                  that DeepSpeed's "bf16" is loom's "full_bf16")
//   gradient_checkpointing = true  a [checkpointing] table (every unit)
//   optim = "..."                  [optimizer] name: adamw_torch, adamw_torch_fused, adamw_hf,
//                                  adamw -> adamw; adafactor; adamw_bnb_8bit, adamw_8bit ->
//                                  adam8bit; lion_32bit -> lion; sgd
//   adam_beta1, adam_beta2, adam_epsilon, weight_decay   [optimizer] beta1, beta2, eps,
//                                  weight_decay
//   dataloader_num_workers = N     a [preload] table with num_workers = N (0: none)
//   dataloader_pin_memory          [preload] pin_memory
//   save_strategy                  "steps" (save_steps) | "no" (save_steps = 0, no final save)
//   logging_strategy               "steps" (logging_steps) | "no" (no step lines)
#include "trainer_names.h"

#include <map>

#include "job.h"
#include "loom/error.h"

namespace loom {
namespace {

const char* type_name(const ConfigValue& v) {
  switch (v.type()) {
    case ValueType::Int: return "an integer";
    case ValueType::Float: return "a number";
    case ValueType::Bool: return "true or false";
    case ValueType::String: return "a string";
    case ValueType::Array: return "an array";
    case ValueType::Table: return "a table";
    default: return "nothing";
  }
}

class Rewriter {
 public:
  explicit Rewriter(ConfigValue& root) : root_(root) {}

  // Removes [train] `key` and returns it (nullopt when absent).
  std::optional<ConfigValue> take(const std::string& key) { return take_key(root_, "train", key); }

  static bool flag(const std::string& key, const ConfigValue& v) {
    LOOM_CHECK_AS(ConfigError, v.type() == ValueType::Bool, v.where, ": [train] ", key,
                  " (a TrainingArguments flag) takes true or false, not ", type_name(v), " (",
                  v.to_text(), ")");
    return std::get<bool>(v.value);
  }
  static std::string text(const std::string& key, const ConfigValue& v) {
    LOOM_CHECK_AS(ConfigError, v.type() == ValueType::String, v.where, ": [train] ", key,
                  " (a TrainingArguments name) takes a string, not ", type_name(v), " (",
                  v.to_text(), ")");
    return std::get<std::string>(v.value);
  }
  static void number(const std::string& key, const ConfigValue& v, bool integer) {
    const bool ok = v.type() == ValueType::Int || (!integer && v.type() == ValueType::Float);
    LOOM_CHECK_AS(ConfigError, ok, v.where, ": [train] ", key, " (a TrainingArguments value) takes ",
                  integer ? "an integer" : "a number", ", not ", type_name(v), " (", v.to_text(), ")");
  }

  ConfigValue& table(const std::string& name, const std::string& where) {
    return table_of(root_, name, where);
  }

  // [table] key = value, from [train] `from` (written at value.where); the same key already in
  // the job is the same setting spelled twice. `shown`: the [train] value as written, when it
  // is not `value` itself.
  void put(const std::string& from, const std::string& name, const std::string& key, ConfigValue value,
           const std::string& shown = "") {
    ConfigValue& t = table(name, value.where);
    if (const ConfigValue* existing = t.find(key))
      throw ConfigError(detail::cat(value.where, ": [train] ", from, " and ", existing->where,
                                    ": [", name, "] ", key, " are one setting spelled twice (the "
                                    "Trainer's name and loom's); keep one"));
    note(value.where, detail::cat("[train] ", from, " = ", shown.empty() ? display_text(value) : shown,
                                  " -> [", name, "] ", key, " = ", display_text(value)));
    std::get<ConfigTable>(t.value).emplace_back(key, std::move(value));
  }
  // [table] key = "value", for the [train] key `from` whose value `source` names it.
  void put_text(const std::string& from, const ConfigValue& source, const std::string& name,
                const std::string& key, const std::string& value) {
    put(from, name, key, ConfigValue{value, source.where}, display_text(source));
  }
  // A table that turns a plugin on: made (empty) unless the job has it.
  void enable(const std::string& from, const ConfigValue& source, const std::string& name) {
    LOOM_CHECK_AS(ConfigError, root_.find(name) == nullptr, source.where, ": [train] ", from,
                  " and the job's [", name, "] table are one setting spelled twice (the "
                  "Trainer's name and loom's); keep one");
    table(name, source.where);
    note(source.where, detail::cat("[train] ", from, " = ", display_text(source), " -> a [", name,
                                   "] table"));
  }
  void note(const std::string& where, const std::string& what) {
    notes_.push_back(where + ": " + what);
  }
  std::vector<std::string> notes() && { return std::move(notes_); }

 private:
  ConfigValue& root_;
  std::vector<std::string> notes_;
};

}  // namespace

std::vector<std::string> map_trainer_names(ConfigValue& root) {
  Rewriter r(root);

  // Mixed precision: at most one of the modes.
  std::string mode, mode_key;
  std::optional<ConfigValue> mode_source;
  for (const char* key : {"bf16", "fp16", "tf32"}) {
    auto v = r.take(key);
    if (!v) continue;
    if (!Rewriter::flag(key, *v)) {
      r.note(v->where, detail::cat("[train] ", key, " = false: nothing to change"));
      continue;
    }
    if (!mode.empty() && std::string(key) == "tf32") {
      r.note(v->where, detail::cat("[train] tf32 = true beside ", mode_key, ": loom's ", mode,
                                   " mode alone (its matmuls run in ", mode, ")"));
      continue;
    }
    LOOM_CHECK_AS(ConfigError, mode.empty(), v->where, ": [train] ", key, " and ", mode_key,
                  " are both true; mixed precision is one of bf16 and fp16");
    mode = key;
    mode_key = key;
    mode_source = std::move(*v);
  }
  if (mode_source) r.put_text(mode_key, *mode_source, "precision", "mode", mode);

  if (auto v = r.take("gradient_checkpointing")) {
    if (Rewriter::flag("gradient_checkpointing", *v)) r.enable("gradient_checkpointing", *v, "checkpointing");
    else r.note(v->where, "[train] gradient_checkpointing = false: nothing to change");
  }

  if (auto v = r.take("optim")) {
    static const std::map<std::string, std::string> kOptimizers = {
        {"adamw_torch", "adamw"},       {"adamw_torch_fused", "adamw"}, {"adamw_hf", "adamw"},
        {"adamw", "adamw"},             {"adafactor", "adafactor"},     {"adamw_bnb_8bit", "adam8bit"},
        {"adamw_8bit", "adam8bit"},     {"lion_32bit", "lion"},         {"sgd", "sgd"}};
    const std::string name = Rewriter::text("optim", *v);
    const auto it = kOptimizers.find(name);
    if (it == kOptimizers.end()) {
      std::string known;
      for (const auto& [hf, mine] : kOptimizers) known += (known.empty() ? "" : ", ") + hf;
      throw ConfigError(detail::cat(v->where, ": [train] optim = \"", name, "\" has no loom "
                                    "optimizer; the Trainer's names loom maps: ", known,
                                    " (or set [optimizer] name)"));
    }
    r.put_text("optim", *v, "optimizer", "name", it->second);
  }
  for (const auto& [hf, mine] : std::vector<std::pair<std::string, std::string>>{
           {"adam_beta1", "beta1"}, {"adam_beta2", "beta2"}, {"adam_epsilon", "eps"},
           {"weight_decay", "weight_decay"}}) {
    if (auto v = r.take(hf)) {
      Rewriter::number(hf, *v, /*integer=*/false);
      r.put(hf, "optimizer", mine, std::move(*v));
    }
  }

  if (auto v = r.take("dataloader_num_workers")) {
    Rewriter::number("dataloader_num_workers", *v, /*integer=*/true);
    if (std::get<int64_t>(v->value) > 0) r.put("dataloader_num_workers", "preload", "num_workers", std::move(*v));
    else r.note(v->where, "[train] dataloader_num_workers = 0: batches made on the training thread (no [preload])");
  }
  if (auto v = r.take("dataloader_pin_memory")) {
    Rewriter::flag("dataloader_pin_memory", *v);
    if (root.find("preload")) r.put("dataloader_pin_memory", "preload", "pin_memory", std::move(*v));
    else r.note(v->where, "[train] dataloader_pin_memory: no [preload] workers, nothing to pin");
  }

  if (auto v = r.take("save_strategy")) {
    const std::string s = Rewriter::text("save_strategy", *v);
    if (s == "no") {
      r.put("save_strategy", "train", "save_steps", ConfigValue{int64_t{0}, v->where}, "\"no\"");
      r.put("save_strategy", "train", "save_final", ConfigValue{false, v->where}, "\"no\"");
    } else if (s == "steps") {
      r.note(v->where, "[train] save_strategy = \"steps\": every save_steps, as loom does");
    } else {
      throw ConfigError(detail::cat(v->where, ": [train] save_strategy = \"", s, "\": loom saves "
                                    "\"steps\" (every save_steps) or \"no\"; with "
                                    "load_best_model_at_end it keeps the best of them"));
    }
  }
  if (auto v = r.take("logging_strategy")) {
    const std::string s = Rewriter::text("logging_strategy", *v);
    if (s == "no") r.put("logging_strategy", "train", "logging_steps", ConfigValue{int64_t{0}, v->where}, "\"no\"");
    else if (s == "steps") r.note(v->where, "[train] logging_strategy = \"steps\": every logging_steps, as loom does");
    else
      throw ConfigError(detail::cat(v->where, ": [train] logging_strategy = \"", s, "\": loom logs "
                                    "\"steps\" (every logging_steps) or \"no\""));
  }
  return std::move(r).notes();
}

}  // namespace loom
