// The `lora` plugin: low-rank adapters (LoRA, Hu et al. 2021) on the loom::nn::Linear modules a
// job names, with the base weights frozen, so only the adapters (and modules_to_save) reach the
// update rule. Adapters are saved and loaded in Hugging Face PEFT's format. Not DoRA, not
// quantised bases (QLoRA), not adapters on embeddings or convolutions.
#include "lora.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/log.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"
#include "loom/safetensors.h"

namespace {

namespace fs = std::filesystem;
using loom::CheckpointError;
using loom::ConfigError;
using Json = nlohmann::json;

// PEFT's prefix of every key in adapter_model.safetensors (PeftModel.base_model.model).
constexpr const char* kPeftPrefix = "base_model.model.";
constexpr const char* kAdapterFile = "adapter_model.safetensors";
constexpr const char* kConfigFile = "adapter_config.json";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A few names of a long list, for error messages.
std::string some_of(const std::vector<std::string>& names, size_t most = 12) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > most) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out.empty() ? "(none)" : out;
}

enum class Init { kaiming, gaussian, none };

// What an adapter is: the fields of PEFT's LoraConfig that loom supports.
struct LoraOptions {
  int64_t r = 8;
  double alpha = 8.0;
  double dropout = 0.0;
  bool use_rslora = false;
  // PEFT's target_modules: a string is a regex over the full module name ("all-linear" is every
  // Linear but the output layer); a list holds name suffixes.
  bool target_is_pattern = false;
  std::string target_pattern;
  std::vector<std::string> target_list;
  std::vector<std::string> modules_to_save;
  std::string bias = "none";  // none | all | lora_only
  Init init = Init::kaiming;

  double scaling() const {
    return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
  }
  Json target_json() const {
    return target_is_pattern ? Json(target_pattern) : Json(target_list);
  }
  Json init_json() const {
    return init == Init::gaussian ? Json("gaussian") : Json(init == Init::kaiming);
  }
};

// scaling · B·A, (out,in) in B's and A's dtype: what merging adds to the base weight.
at::Tensor lora_delta(const at::Tensor& lora_b, const at::Tensor& lora_a, double scaling) {
  return at::matmul(lora_b, lora_a) * scaling;
}

// One adapter: delta = scaling · B·A·dropout(x). A is (r,in), B is (out,r).
class LoraAdapter final : public loom::nn::LinearAdapter {
 public:
  LoraAdapter(const loom::nn::Linear& base, int64_t r, double scaling, double dropout, Init init)
      : scaling_(scaling), dropout_(dropout) {
    auto options = base.weight.options();
    at::NoGradGuard no_grad;
    // PEFT's kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    const double bound_a = 1.0 / std::sqrt(static_cast<double>(base.in_features));
    at::Tensor a = at::empty({r, base.in_features}, options);
    at::Tensor b = at::zeros({base.out_features, r}, options);
    if (init == Init::gaussian) {
      a.normal_(0.0, 1.0 / static_cast<double>(r));
    } else {
      a.uniform_(-bound_a, bound_a);
    }
    // init_lora_weights = false leaves B as an nn.Linear(r, out) would start: not a no-op.
    if (init == Init::none) b.uniform_(-1.0 / std::sqrt(double(r)), 1.0 / std::sqrt(double(r)));
    lora_A = register_parameter("lora_A", a);
    lora_B = register_parameter("lora_B", b);
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& base_out) override {
    // x is (..., in), base_out (..., out); returns the (..., out) delta.
    if (merged_) return at::zeros({}, base_out.options());  // already inside the weight
    at::Tensor h = x.to(lora_A.scalar_type());
    if (dropout_ > 0.0) h = at::dropout(h, dropout_, is_training());
    return (loom::nn::linear(loom::nn::linear(h, lora_A), lora_B) * scaling_).to(base_out.scalar_type());
  }

  // scaling · B·A, (out,in) in the adapter's dtype.
  at::Tensor delta_weight() const { return lora_delta(lora_B, lora_A, scaling_); }

  bool merge(loom::nn::Linear& base) {
    if (merged_) return false;
    at::NoGradGuard no_grad;
    base.weight.add_(delta_weight().to(base.weight.scalar_type()));
    merged_ = true;
    return true;
  }
  bool unmerge(loom::nn::Linear& base) {
    if (!merged_) return false;
    at::NoGradGuard no_grad;
    base.weight.sub_(delta_weight().to(base.weight.scalar_type()));
    merged_ = false;
    return true;
  }
  bool merged() const { return merged_; }

  at::Tensor lora_A, lora_B;

 private:
  double scaling_, dropout_;
  bool merged_ = false;
};

template <class F>
int64_t for_each_adapter(torch::nn::Module& model, F&& f) {
  int64_t count = 0;
  for (const auto& module : model.modules(/*include_self=*/true))
    if (auto* linear = dynamic_cast<loom::nn::Linear*>(module.get()))
      if (auto* adapter = dynamic_cast<LoraAdapter*>(linear->adapter()))
        count += f(*linear, *adapter) ? 1 : 0;
  return count;
}

void write_text_atomically(const fs::path& file, const std::string& text) {
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    LOOM_CHECK(out.good(), "cannot write ", tmp.string(), "; check the folder's permissions and space");
  }
  fs::rename(tmp, file);
}

class LoraPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "lora"; }
  std::string description() const override {
    return "LoRA adapters on loom::nn::Linear modules; base weights frozen; PEFT-format adapters";
  }
  // After MoE (its experts' Linears are adapted too) and precision (full_bf16's cast runs on the
  // base before the adapters exist, which the adapters then follow); after ZeRO, whose teardown
  // gathers the stage-3 weights that LoRA's teardown writes as the adapter. The parameter set
  // (ZeRO's partitioning, the frozen weights held in half) is read later, at params_ready, when
  // the adapters exist whatever the order.
  Order order() const override { return {.after = {"moe", "precision", "zero"}}; }
  bool shapes_model() const override { return true; }

  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("lora");
    s.key_int("r", 8, "rank of the update B·A")
        .key_float("lora_alpha", 8.0, "the update is scaled by lora_alpha / r")
        .key_float("lora_dropout", 0.0, "dropout on the adapter's input, in [0, 1)")
        .key_bool("use_rslora", false, "scale by lora_alpha / sqrt(r) (rank-stabilised LoRA)")
        .key_optional("target_modules", loom::ValueType::Any,
                      "Linear modules to adapt: a list of name suffixes (\"qkv\" matches "
                      "h.0.attn.qkv), a regex over the whole name, or \"all-linear\" (as PEFT)")
        .key_optional("modules_to_save", loom::ValueType::Array,
                      "modules (name suffixes) trained in full and saved with the adapter")
        .key_string("bias", "none", "biases that train: none, all, or lora_only (adapted Linears')")
        .add({"init_lora_weights", loom::ValueType::Any, loom::ConfigValue{true, "default"},
              "true: A Kaiming-uniform, B zero; \"gaussian\": A ~ N(0, 1/r); false: B random too"})
        .key_string("adapter_path", "",
                    "folder holding adapter_model.safetensors + adapter_config.json to start from "
                    "(its config defines the adapter)")
        .key_bool("save_adapter", true,
                  "at the end, write adapter_model.safetensors + adapter_config.json to output_dir")
        .key_bool("save_merged", false,
                  "at the end, also write the merged model to output_dir/merged/model.safetensors")
        .key_string("base_model_name_or_path", "", "recorded in adapter_config.json")
        .key_string("task_type", "", "recorded in adapter_config.json (CAUSAL_LM, SEQ_CLS...); "
                                     "empty: none");
    return {s};
  }

  void configure(const loom::ConfigSection& t) override {
    table_ = t;
    opts_.r = t.get_int("r");
    LOOM_CHECK_AS(ConfigError, opts_.r > 0, t.where("r"), ": [lora] r must be a positive rank, got ",
                  opts_.r, "; typical values are 4 to 64");
    opts_.alpha = t.get_float("lora_alpha");
    LOOM_CHECK_AS(ConfigError, opts_.alpha > 0, t.where("lora_alpha"),
                  ": [lora] lora_alpha must be positive, got ", opts_.alpha);
    opts_.dropout = t.get_float("lora_dropout");
    LOOM_CHECK_AS(ConfigError, opts_.dropout >= 0 && opts_.dropout < 1, t.where("lora_dropout"),
                  ": [lora] lora_dropout must be in [0, 1), got ", opts_.dropout);
    opts_.use_rslora = t.get_bool("use_rslora");
    opts_.bias = t.get_string("bias");
    check_bias(opts_.bias, t.where("bias"));
    opts_.init = parse_init(*t.get("init_lora_weights"), t.where("init_lora_weights"));
    if (const auto* v = t.get("target_modules")) {
      if (std::holds_alternative<std::string>(v->value)) {
        opts_.target_is_pattern = true;
        opts_.target_pattern = std::get<std::string>(v->value);
      } else {
        opts_.target_list = t.get_strings("target_modules");
        LOOM_CHECK_AS(ConfigError, !opts_.target_list.empty(), t.where("target_modules"),
                      ": [lora] target_modules is an empty list; name the Linear modules to adapt");
      }
    }
    opts_.modules_to_save = t.get_strings("modules_to_save");
    adapter_path_ = t.get_string("adapter_path");
  }

  // Note [One resolved job]: what inject() would refuse at model_built, refused from the job.
  void validate(const std::string&, const loom::ConfigSection& t,
                const JobTables& job) const override {
    if (!adapter_path_.empty()) {
      // Both files there and the config readable; the saved adapter's config decides the
      // targets.
      (void)saved_config(job.resolve_path(adapter_path_));
      return;
    }
    LOOM_CHECK_AS(ConfigError, opts_.target_is_pattern || !opts_.target_list.empty(),
                  t.where("target_modules"),
                  ": [lora] needs target_modules (e.g. [\"qkv\", \"proj\"] or \"all-linear\"), "
                  "or adapter_path naming a saved adapter");
    if (opts_.target_is_pattern && lower(opts_.target_pattern) != "all-linear") {
      try {
        std::regex(opts_.target_pattern, std::regex::ECMAScript);
      } catch (const std::regex_error& error) {
        throw ConfigError(loom::detail::cat(t.where("target_modules"),
                                            ": [lora] target_modules \"", opts_.target_pattern,
                                            "\" is not a valid regex (", error.what(), ")"));
      }
    }
  }

  // Note [Merged export]: `loom export --merge` folds every adapter of the checkpoint's weights
  // into its Linear weight, W + scaling · B·A in fp32 (PEFT's merge_and_unload), and drops the
  // adapter tensors. The scaling is the run's (LoraOptions::scaling): from the job, or from the
  // adapter_config.json of the job's adapter_path (which defined the adapter the run trained
  // on), with r the rows of each adapter's A.
  bool merge_for_export(
      const loom::ConfigSection& t, loom::NamedTensors& weights,
      const std::function<std::string(const std::string&)>& resolve_path) const override {
    const std::string adapter_path = t.get_string("adapter_path");
    const LoraOptions run = adapter_path.empty() ? opts_ : saved_config(resolve_path(adapter_path));
    const std::string a_tail = ".adapter.lora_A", b_tail = ".adapter.lora_B";
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < weights.size(); ++i) index[weights[i].first] = i;
    std::set<std::string> folded;
    at::NoGradGuard no_grad;
    for (const auto& [name, a] : weights) {
      if (!ends_with(name, a_tail)) continue;
      const std::string linear = name.substr(0, name.size() - a_tail.size());
      const auto b = index.find(linear + b_tail);
      const auto w = index.find(linear + ".weight");
      LOOM_CHECK_AS(CheckpointError, b != index.end() && w != index.end(), "the checkpoint has ",
                    name, " but not ", b == index.end() ? linear + b_tail : linear + ".weight",
                    "; it is not a whole LoRA checkpoint");
      const at::Tensor& lora_b = weights[b->second].second;
      at::Tensor& weight = weights[w->second].second;
      LOOM_CHECK_AS(CheckpointError,
                    lora_b.dim() == 2 && a.dim() == 2 && lora_b.size(1) == a.size(0) &&
                        weight.dim() == 2 && weight.size(0) == lora_b.size(0) &&
                        weight.size(1) == a.size(1),
                    "the checkpoint's ", linear, " adapter (A ", a.sizes(), ", B ", lora_b.sizes(),
                    ") does not fit its weight ", weight.sizes());
      LoraOptions adapter = run;
      adapter.r = a.size(0);  // the rank the tensors have
      weight = weight + lora_delta(lora_b.to(at::kFloat), a.to(at::kFloat), adapter.scaling())
                            .to(weight.scalar_type());
      folded.insert(name);
      folded.insert(linear + b_tail);
    }
    weights.erase(std::remove_if(weights.begin(), weights.end(),
                                 [&](const auto& t) { return folded.count(t.first) > 0; }),
                  weights.end());
    return !folded.empty();
  }

  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::model_built, [this](loom::Engine& e) { inject(e); });
    engine.on(loom::Event::params_ready, [this](loom::Engine& e) { report(e); });
    engine.on(loom::Event::teardown, [this](loom::Engine& e) { finish(e); });
  }

 private:
  static void check_bias(const std::string& bias, const std::string& where) {
    LOOM_CHECK_AS(ConfigError, bias == "none" || bias == "all" || bias == "lora_only", where,
                  ": [lora] bias '", bias, "' is unknown; use none, all or lora_only");
  }

  static Init parse_init(const loom::ConfigValue& v, const std::string& where) {
    if (const auto* b = std::get_if<bool>(&v.value)) return *b ? Init::kaiming : Init::none;
    if (const auto* s = std::get_if<std::string>(&v.value); s && *s == "gaussian")
      return Init::gaussian;
    throw ConfigError(loom::detail::cat(
        where, ": [lora] init_lora_weights ", v.to_text(),
        " is not supported; use true, false or \"gaussian\" (PEFT's pissa, olora, loftq... are not "
        "implemented in loom)"));
  }

  // ---- model_built: attach adapters, freeze the rest, load a saved adapter ----
  void inject(loom::Engine& engine) {
    if (!adapter_path_.empty()) adopt_saved_config(engine);
    LOOM_CHECK_AS(ConfigError, opts_.target_is_pattern || !opts_.target_list.empty(),
                  table_.where("target_modules"),
                  ": [lora] needs target_modules (e.g. [\"qkv\", \"proj\"] or \"all-linear\"), "
                  "or adapter_path naming a saved adapter");
    loom::Model& model = engine.model();
    model_name_ = engine.section("train").get_string("model");

    std::regex pattern;
    const bool all_linear = opts_.target_is_pattern && lower(opts_.target_pattern) == "all-linear";
    if (opts_.target_is_pattern && !all_linear) {
      try {
        pattern = std::regex(opts_.target_pattern, std::regex::ECMAScript);
      } catch (const std::regex_error& error) {
        throw ConfigError(loom::detail::cat(table_.where("target_modules"),
                                            ": [lora] target_modules \"", opts_.target_pattern,
                                            "\" is not a valid regex (", error.what(), ")"));
      }
    }
    auto is_target = [&](const std::string& name) {
      if (all_linear) return name != "lm_head" && !ends_with(name, ".lm_head");  // PEFT skips the output layer
      if (opts_.target_is_pattern) return std::regex_match(name, pattern);
      for (const auto& t : opts_.target_list)
        if (name == t || ends_with(name, "." + t)) return true;
      return false;
    };

    std::vector<std::string> linear_names, module_names;
    std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
    std::set<std::string> used_targets;
    adapters_.clear();
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      module_names.push_back(item.key());
      modules[item.key()] = item.value();
      auto linear = std::dynamic_pointer_cast<loom::nn::Linear>(item.value());
      if (!linear) continue;
      linear_names.push_back(item.key());
      if (!is_target(item.key())) continue;
      LOOM_CHECK(!linear->adapter(), "[lora] Linear '", item.key(),
                 "' already has an adapter (set by another plugin); one adapter per Linear");
      adapters_.push_back({item.key(), linear, nullptr});
      for (const auto& t : opts_.target_list)
        if (item.key() == t || ends_with(item.key(), "." + t)) used_targets.insert(t);
    }
    LOOM_CHECK_AS(ConfigError, !adapters_.empty(), table_.where("target_modules"),
                  ": [lora] target_modules ", opts_.target_json().dump(),
                  " match no loom::nn::Linear of model '", model_name_, "'; its Linear modules are: ",
                  some_of(linear_names),
                  ". Give name suffixes (\"qkv\"), a regex over the whole name, or \"all-linear\"");
    for (const auto& t : opts_.target_list)
      if (!used_targets.count(t))
        loom::log::warn("[lora] target_modules entry '", t, "' matches no Linear of model '",
                        model_name_, "'");

    // modules_to_save: trained in full (PEFT copies them; loom trains them in place).
    std::vector<std::string> saved_modules;
    for (const auto& wanted : opts_.modules_to_save) {
      size_t found = 0;
      for (const auto& name : module_names) {
        if (name != wanted && !ends_with(name, "." + wanted)) continue;
        for (const auto& a : adapters_)
          LOOM_CHECK_AS(ConfigError, a.name.rfind(name, 0) != 0 && name.rfind(a.name, 0) != 0,
                        table_.where("modules_to_save"), ": [lora] modules_to_save entry '",
                        wanted, "' (", name, ") overlaps the adapted Linear '", a.name,
                        "'; a module is either adapted or saved in full");
        saved_modules.push_back(name);
        ++found;
      }
      if (found == 0) {
        // Entries are name suffixes: list the distinct last parts of the names.
        std::vector<std::string> leaves;
        for (const auto& name : module_names) {
          const std::string leaf = name.substr(name.rfind('.') + 1);
          if (std::find(leaves.begin(), leaves.end(), leaf) == leaves.end()) leaves.push_back(leaf);
        }
        throw ConfigError(loom::detail::cat(
            table_.where("modules_to_save"), ": [lora] modules_to_save entry '", wanted,
            "' matches no module of model '", model_name_, "'; its module names end in: ",
            some_of(leaves, 40)));
      }
    }

    const double scaling = opts_.scaling();
    for (auto& a : adapters_) {
      a.adapter = std::make_shared<LoraAdapter>(*a.linear, opts_.r, scaling, opts_.dropout,
                                                opts_.init);
      a.linear->set_adapter(a.adapter);
    }

    // Which tensors train, and their PEFT names (Note [PEFT key names]).
    // Note [PEFT key names]: PEFT wraps an adapted Linear, so its own tensors move under
    // "base_layer." (a trained bias is saved as "<path>.base_layer.bias"); a modules_to_save
    // module is saved under its plain path; the prefix is always "base_model.model.".
    peft_tensors_.clear();
    const auto adapted_names = linear_names_of(adapters_);
    const std::set<std::string> adapted(adapted_names.begin(), adapted_names.end());
    auto peft_name = [&](const std::string& param) {
      const auto dot = param.rfind('.');
      const std::string owner = dot == std::string::npos ? "" : param.substr(0, dot);
      if (adapted.count(owner)) return kPeftPrefix + owner + ".base_layer" + param.substr(dot);
      return kPeftPrefix + param;
    };
    for (const auto& a : adapters_) {
      peft_tensors_.push_back({kPeftPrefix + a.name + ".lora_A.weight", a.adapter->lora_A});
      peft_tensors_.push_back({kPeftPrefix + a.name + ".lora_B.weight", a.adapter->lora_B});
    }
    std::set<std::string> trainable_base;
    for (const auto& name : saved_modules)
      for (const auto& p : modules[name]->named_parameters(/*recurse=*/true))
        if (trainable_base.insert(name + "." + p.key()).second)
          peft_tensors_.push_back({peft_name(name + "." + p.key()), p.value()});
    for (const auto& p : model.named_parameters(/*recurse=*/true)) {
      if (p.key().find(".adapter.lora_") != std::string::npos) continue;
      const bool is_bias = p.key() == "bias" || ends_with(p.key(), ".bias");
      const std::string owner = p.key().substr(0, p.key().rfind('.'));
      const bool train_bias =
          is_bias && (opts_.bias == "all" || (opts_.bias == "lora_only" && adapted.count(owner)));
      if (train_bias && trainable_base.insert(p.key()).second)
        peft_tensors_.push_back({peft_name(p.key()), p.value()});
      if (!trainable_base.count(p.key())) p.value().set_requires_grad(false);
    }
    for (auto& a : adapters_) {
      a.adapter->lora_A.set_requires_grad(true);
      a.adapter->lora_B.set_requires_grad(true);
    }
    if (!adapter_path_.empty()) load_adapter(engine);
    loom::log::info("lora: r ", opts_.r, ", lora_alpha ", opts_.alpha, ", scaling ", scaling,
                    opts_.use_rslora ? " (rsLoRA)" : "", ", dropout ", opts_.dropout, "; ",
                    adapters_.size(), " of ", linear_names.size(), " Linear modules adapted (",
                    some_of(adapted_names, 6), ")",
                    saved_modules.empty() ? "" : "; trained in full: " + some_of(saved_modules, 6));
  }

  static std::string lower(std::string s) {
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  }

  struct Adapted {
    std::string name;
    std::shared_ptr<loom::nn::Linear> linear;
    std::shared_ptr<LoraAdapter> adapter;
  };
  static std::vector<std::string> linear_names_of(const std::vector<Adapted>& adapters) {
    std::vector<std::string> names;
    for (const auto& a : adapters) names.push_back(a.name);
    return names;
  }

  // ---- adapter_path: the saved adapter_config.json defines the adapter ----
  void adopt_saved_config(loom::Engine& engine) {
    const fs::path dir = engine.resolve_path(adapter_path_);
    const LoraOptions saved = saved_config(dir);
    // Keys the job sets must agree with the adapter: a silent override would train another shape.
    auto agree = [&](const char* key, bool same, const std::string& job, const std::string& file_value) {
      LOOM_CHECK_AS(ConfigError, !table_.has(key) || same, table_.where(key), ": [lora] ", key,
                    " = ", job, " but the adapter in ", dir.string(), " has ", key, " = ",
                    file_value, "; remove ", key, " from [lora] (adapter_path defines the adapter)");
    };
    agree("r", opts_.r == saved.r, std::to_string(opts_.r), std::to_string(saved.r));
    agree("lora_alpha", opts_.alpha == saved.alpha, Json(opts_.alpha).dump(), Json(saved.alpha).dump());
    agree("use_rslora", opts_.use_rslora == saved.use_rslora, Json(opts_.use_rslora).dump(),
          Json(saved.use_rslora).dump());
    agree("bias", opts_.bias == saved.bias, opts_.bias, saved.bias);
    auto sorted_targets = opts_.target_list;
    std::sort(sorted_targets.begin(), sorted_targets.end());
    agree("target_modules",
          opts_.target_is_pattern == saved.target_is_pattern &&
              opts_.target_pattern == saved.target_pattern && sorted_targets == saved.target_list,
          opts_.target_json().dump(), saved.target_json().dump());
    agree("modules_to_save", opts_.modules_to_save == saved.modules_to_save,
          Json(opts_.modules_to_save).dump(), Json(saved.modules_to_save).dump());
    opts_ = saved;
  }

  // The job's options with the adapter_config.json in `dir` over them (the saved adapter
  // defines r, lora_alpha, use_rslora, bias and the targets).
  LoraOptions saved_config(const fs::path& dir) const {
    const fs::path file = dir / kConfigFile;
    const std::string where = table_.where("adapter_path");
    LOOM_CHECK_AS(ConfigError, fs::exists(dir / kAdapterFile), where, ": [lora] adapter_path ",
                  dir.string(), " holds no ", kAdapterFile, "; point it at a folder a LoRA run "
                  "(or PEFT's save_pretrained) wrote");
    LOOM_CHECK_AS(ConfigError, fs::exists(file), where, ": [lora] adapter_path ", dir.string(),
                  " holds no ", kConfigFile, "; the adapter's r, lora_alpha and target_modules "
                  "are read from it");
    Json config;
    try {
      std::ifstream in(file);
      config = Json::parse(in);
    } catch (const std::exception& error) {
      throw ConfigError(loom::detail::cat(file.string(), ": not valid JSON (", error.what(), ")"));
    }
    auto field = [&](const char* key) -> const Json& {
      static const Json null;
      auto it = config.find(key);
      return it == config.end() ? null : *it;
    };
    auto bad = [&](const char* key, const char* want) {
      return ConfigError(loom::detail::cat(file.string(), ": field '", key, "' must be ", want,
                                           ", got ", field(key).dump()));
    };
    LOOM_CHECK_AS(ConfigError, field("peft_type") == "LORA", file.string(),
                  ": peft_type is ", field("peft_type").dump(),
                  "; loom's [lora] loads LoRA adapters only (peft_type \"LORA\")");
    for (const char* unsupported : {"use_dora", "fan_in_fan_out"})
      LOOM_CHECK_AS(ConfigError, !field(unsupported).is_boolean() || !field(unsupported).get<bool>(),
                    file.string(), ": ", unsupported, " = true is not supported by loom");
    for (const char* unsupported : {"rank_pattern", "alpha_pattern"})
      LOOM_CHECK_AS(ConfigError, field(unsupported).is_null() || field(unsupported).empty(),
                    file.string(), ": per-module ", unsupported, " is not supported by loom");
    LoraOptions saved = opts_;
    if (!field("r").is_number_integer()) throw bad("r", "an integer");
    saved.r = field("r").get<int64_t>();
    LOOM_CHECK_AS(ConfigError, saved.r > 0, file.string(), ": r must be positive, got ", saved.r);
    if (!field("lora_alpha").is_number()) throw bad("lora_alpha", "a number");
    saved.alpha = field("lora_alpha").get<double>();
    if (field("use_rslora").is_boolean()) saved.use_rslora = field("use_rslora").get<bool>();
    if (field("bias").is_string()) saved.bias = field("bias").get<std::string>();
    check_bias(saved.bias, file.string());
    const Json& targets = field("target_modules");
    if (targets.is_string()) {
      saved.target_is_pattern = true;
      saved.target_pattern = targets.get<std::string>();
      saved.target_list.clear();
    } else if (targets.is_array() && !targets.empty()) {
      saved.target_is_pattern = false;
      saved.target_list.clear();
      for (const auto& t : targets) {
        if (!t.is_string()) throw bad("target_modules", "a string or a list of strings");
        saved.target_list.push_back(t.get<std::string>());
      }
      // PEFT stores a set: compare as sets.
      std::sort(saved.target_list.begin(), saved.target_list.end());
    } else {
      throw bad("target_modules", "a string or a non-empty list of strings");
    }
    saved.modules_to_save.clear();
    if (field("modules_to_save").is_array())
      for (const auto& m : field("modules_to_save")) saved.modules_to_save.push_back(m.get<std::string>());
    return saved;
  }

  void load_adapter(loom::Engine& engine) {
    const fs::path file = fs::path(engine.resolve_path(adapter_path_)) / kAdapterFile;
    auto contents = loom::safetensors::load(file);
    std::map<std::string, at::Tensor> by_name(contents.tensors.begin(), contents.tensors.end());
    at::NoGradGuard no_grad;
    for (auto& [key, tensor] : peft_tensors_) {
      auto it = by_name.find(key);
      LOOM_CHECK_AS(CheckpointError, it != by_name.end(), "'", file.string(), "' has no tensor '",
                    key, "' that the adapter on model '", model_name_,
                    "' needs; the adapter was made for another model or other target_modules");
      LOOM_CHECK_AS(CheckpointError, it->second.sizes() == tensor.sizes(), "'", file.string(),
                    "': tensor '", key, "' is ", it->second.sizes(), " but model '", model_name_,
                    "' needs ", tensor.sizes(), "; the adapter belongs to another model shape");
      at::Tensor target = tensor;
      target.detach().copy_(it->second);
      by_name.erase(it);
    }
    LOOM_CHECK_AS(CheckpointError, by_name.empty(), "'", file.string(), "' holds tensor '",
                  by_name.empty() ? "" : by_name.begin()->first, "' that the adapter on model '",
                  model_name_, "' does not have; the adapter was made for another model");
    loom::log::info("lora: loaded ", peft_tensors_.size(), " tensors from ", file.string());
  }

  // ---- params_ready: the trainable share, as PEFT's print_trainable_parameters ----
  void report(loom::Engine& engine) {
    const auto state = engine.model_state();
    const double percent =
        state.param_count ? 100.0 * static_cast<double>(state.trainable_count) / state.param_count
                          : 0.0;
    char share[32];
    std::snprintf(share, sizeof share, "%.4f", percent);
    loom::log::info("lora: trainable params: ", grouped(state.trainable_count),
                    " || all params: ", grouped(state.param_count), " || trainable%: ", share);
  }

  static std::string grouped(int64_t n) {
    std::string digits = std::to_string(n), out;
    for (size_t i = 0; i < digits.size(); ++i) {
      if (i && (digits.size() - i) % 3 == 0) out += ',';
      out += digits[i];
    }
    return out;
  }

  // ---- teardown: the adapter (and the merged model) once the run has completed ----
  void finish(loom::Engine& engine) {
    // teardown also follows an error; only a run that reached max_steps is a result.
    if (engine.state().step < engine.state().max_steps || engine.comm().rank() != 0) return;
    const fs::path out = engine.resolve_path(engine.section("train").get_string("output_dir"));
    if (table_.get_bool("save_adapter")) {
      save_adapter(out);
      loom::log::info("lora: saved adapter to ", (out / kAdapterFile).string());
    }
    if (table_.get_bool("save_merged")) {
      const fs::path dir = out / "merged";
      fs::create_directories(dir);
      loom::safetensors::save(dir / "model.safetensors", merged_state(engine.model()),
                              {{"format", "pt"}});
      loom::log::info("lora: saved the merged model to ", (dir / "model.safetensors").string());
    }
  }

 public:
  void save_adapter(const fs::path& dir) const {
    fs::create_directories(dir);
    loom::NamedTensors tensors;
    for (const auto& [key, tensor] : peft_tensors_) tensors.emplace_back(key, tensor.detach());
    loom::safetensors::save(dir / kAdapterFile, tensors, {{"format", "pt"}});
    const std::string base = table_.get_string("base_model_name_or_path");
    const std::string task = table_.get_string("task_type");
    Json config = {
        {"peft_type", "LORA"},
        {"auto_mapping", nullptr},
        {"base_model_name_or_path", base.empty() ? Json() : Json(base)},
        {"revision", nullptr},
        {"task_type", task.empty() ? Json() : Json(task)},
        {"inference_mode", true},
        {"r", opts_.r},
        {"target_modules", opts_.target_json()},
        {"exclude_modules", nullptr},
        {"lora_alpha", opts_.alpha},
        {"lora_dropout", opts_.dropout},
        {"fan_in_fan_out", false},  // loom's Linear keeps weight as (out, in)
        {"bias", opts_.bias},
        {"use_rslora", opts_.use_rslora},
        {"modules_to_save", opts_.modules_to_save.empty() ? Json() : Json(opts_.modules_to_save)},
        {"init_lora_weights", opts_.init_json()},
        {"layers_to_transform", nullptr},
        {"layers_pattern", nullptr},
        {"rank_pattern", Json::object()},
        {"alpha_pattern", Json::object()},
        {"use_dora", false},
        {"lora_bias", false},
        {"layer_replication", nullptr}};
    write_text_atomically(dir / kConfigFile, config.dump(2) + "\n");
  }

  // The base model's tensors, with scaling · B·A folded into each adapted weight; no adapter
  // tensors. Leaves the model as it is.
  loom::NamedTensors merged_state(torch::nn::Module& model) const {
    std::map<std::string, const Adapted*> by_weight;
    for (const auto& a : adapters_) by_weight[a.name + ".weight"] = &a;
    loom::NamedTensors out;
    at::NoGradGuard no_grad;
    // Frozen tensors held in half under autocast are written in the adapters' dtype, as the
    // run's other weights are (a merged model is one dtype wherever it trained in one).
    const auto wide = adapters_.empty() ? at::kFloat : adapters_.front().adapter->lora_A.scalar_type();
    for (const auto& p : model.named_parameters(/*recurse=*/true)) {
      if (p.key().find(".adapter.lora_") != std::string::npos) continue;
      auto it = by_weight.find(p.key());
      at::Tensor value = p.value().detach();
      if (value.is_floating_point() && value.element_size() < c10::elementSize(wide))
        value = value.to(wide);
      if (it != by_weight.end() && !it->second->adapter->merged()) {
        value = value + it->second->adapter->delta_weight().to(value.scalar_type());
      }
      out.emplace_back(p.key(), value);
    }
    for (const auto& b : model.named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
    return out;
  }

 private:
  loom::ConfigSection table_;
  LoraOptions opts_;
  std::string adapter_path_, model_name_;
  std::vector<Adapted> adapters_;
  std::vector<std::pair<std::string, at::Tensor>> peft_tensors_;  // PEFT key -> live tensor
};

}  // namespace

extern "C" LOOM_PLUGIN_EXPORT int64_t loom_lora_merge(torch::nn::Module* model) {
  LOOM_CHECK(model, "loom_lora_merge needs a model");
  return for_each_adapter(*model, [](loom::nn::Linear& l, LoraAdapter& a) { return a.merge(l); });
}

extern "C" LOOM_PLUGIN_EXPORT int64_t loom_lora_unmerge(torch::nn::Module* model) {
  LOOM_CHECK(model, "loom_lora_unmerge needs a model");
  return for_each_adapter(*model, [](loom::nn::Linear& l, LoraAdapter& a) { return a.unmerge(l); });
}

LOOM_DEFINE_PLUGIN(LoraPlugin, "lora", "0.1.0")
