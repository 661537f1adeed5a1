// Note [One resolved job] (prepared_job.h): a job resolved, configured, validated and its
// update rule built, once, before anything of the run is built or written.
#include "prepared_job.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "checkpoint_io.h"
#include "device.h"
#include "evaluation/best_model.h"
#include "evaluation/evaluator.h"
#include "dist_env.h"
#include "loom/cpu.h"
#include "loom/error.h"
#include "loom/kernel_isa.h"
#include "loom/pretrained.h"
#include "optimizer_in_backward.h"

namespace loom {

std::string plugin_label(const LoadedPlugin* p) {
  return p->builtin() ? "core (built in)" : p->name + " " + p->version + ", " + p->file_label();
}

PreparedJob::PreparedJob(Job job, Purpose purpose)
    : job_(std::move(job)), purpose_(purpose) {
  resolved_ = resolve(job_, host_);
  if (purpose_ == Purpose::train) add_default_data_parallelism();
  const auto& train = section("train");
  LOOM_CHECK_AS(ConfigError, train.get_int("max_steps") >= 0, train.where("max_steps"),
                ": [train] max_steps must be >= 0");
  LOOM_CHECK_AS(ConfigError, train.get_int("logging_steps") >= 0, train.where("logging_steps"),
                ": [train] logging_steps must be >= 0 (0: no step lines)");
  if (train.has("report_to")) {
    // The Trainer's integrations: loom writes TensorBoard's files itself; the others are
    // services loom does not talk to.
    for (const std::string& name : train.get_strings("report_to")) {
      LOOM_CHECK_AS(ConfigError, name == "tensorboard" || name == "all" || name == "none",
                    train.where("report_to"), ": [train] report_to \"", name, "\" is not one "
                    "loom reports to; it knows \"tensorboard\" (\"all\" is the same) and "
                    "\"none\"; metrics.jsonl holds every number for other tools");
      tensorboard_ = tensorboard_ || name == "tensorboard" || name == "all";
    }
  }
  LOOM_CHECK_AS(ConfigError, train.get_int("data_seed") >= -1, train.where("data_seed"),
                ": [train] data_seed must be >= 0, or -1 for seed's");
  const double epochs = train.get_float("num_train_epochs");
  LOOM_CHECK_AS(ConfigError, epochs >= 0 && std::isfinite(epochs), train.where("num_train_epochs"),
                ": [train] num_train_epochs must be >= 0 (0: max_steps decides), got ", epochs);
  if (epochs > 0 && train.has("max_steps"))
    log::info(train.where("max_steps"), ": [train] max_steps = ", train.get_int("max_steps"),
              " decides the run's length; num_train_epochs = ", epochs, " is not used (as the "
              "Trainer does)");
  LOOM_CHECK_AS(ConfigError, train.get_int("per_device_train_batch_size") > 0,
                train.where("per_device_train_batch_size"),
                ": [train] per_device_train_batch_size must be positive");
  LOOM_CHECK_AS(ConfigError, train.get_int("gradient_accumulation_steps") > 0,
                train.where("gradient_accumulation_steps"),
                ": [train] gradient_accumulation_steps must be positive");
  LOOM_CHECK_AS(ConfigError, train.get_float("learning_rate") >= 0, train.where("learning_rate"),
                ": [train] learning_rate must be >= 0, got ", train.get_float("learning_rate"));
  LOOM_CHECK_AS(ConfigError, train.get_float("max_grad_norm") >= 0, train.where("max_grad_norm"),
                ": [train] max_grad_norm must be >= 0");
  check_optimizer_in_backward(train);  // Note [Optimizer in backward]
  LOOM_CHECK_AS(ConfigError, train.get_int("num_threads") >= 0, train.where("num_threads"),
                ": [train] num_threads must be >= 0 (0 = all cores)");
  LOOM_CHECK_AS(ConfigError, train.get_int("save_steps") >= 0, train.where("save_steps"),
                ": [train] save_steps must be >= 0 (0 = only at the end)");
  LOOM_CHECK_AS(ConfigError, train.get_int("save_total_limit") >= 0,
                train.where("save_total_limit"),
                ": [train] save_total_limit must be >= 0 (0 = keep all)");
  check_evaluation();
  schedule_ = make_schedule(train);
  log_level_ = log::parse_level(train.get_string("log_level"));
  cpu::parse_job_isa(train.get_string("cpu_isa"), train.where("cpu_isa"));
  const auto& distributed = section("distributed");
  LOOM_CHECK_AS(ConfigError, distributed.get_float("timeout_seconds") > 0,
                distributed.where("timeout_seconds"),
                ": [distributed] timeout_seconds must be positive (seconds a collective may "
                "take before a peer counts as dead), got ",
                distributed.get_float("timeout_seconds"));
  // The half of the engine's device check that the job alone decides.
  const std::string device = train.get_string("device");
  LOOM_CHECK_AS(ConfigError, !(distributed.get_string("backend") == "nccl" && device == "cpu"),
                distributed.where("backend"), ": [distributed] backend = \"nccl\" moves CUDA "
                "tensors only, but this job trains on cpu ([train] device = \"cpu\"); use "
                "backend = \"gloo\" or \"mpi\" on CPUs, or a CUDA device");
  const auto& optimizer = section("optimizer");
  if (optimizer.schema().find("weight_decay") && optimizer.get("weight_decay"))
    LOOM_CHECK_AS(ConfigError, optimizer.get_float("weight_decay") >= 0,
                  optimizer.where("weight_decay"), ": [optimizer] weight_decay must be >= 0, got ",
                  optimizer.get_float("weight_decay"));
  const std::string state_dtype = optimizer.get_string("state_dtype");
  LOOM_CHECK_AS(ConfigError, state_dtype == "fp32" || state_dtype == "bf16",
                optimizer.where("state_dtype"), ": [optimizer] state_dtype '", state_dtype,
                "' is unknown; use \"fp32\" (the default) or \"bf16\" (adamw)");
  // Note [bf16 weights as their own masters] (step_driver.cpp): bf16 weights. A plugin's step
  // driver must say it keeps no masters (Plugin::keeps_no_masters, checked below with the
  // plugins) and refuses what it cannot build itself (the zero plugin: offload_param without
  // offload_optimizer); one that keeps masters all the same is refused once it is made
  // (make_step_driver).
  const std::string master_dtype = optimizer.get_string("master_dtype");
  LOOM_CHECK_AS(ConfigError, master_dtype == "fp32" || master_dtype == "bf16",
                optimizer.where("master_dtype"), ": [optimizer] master_dtype '", master_dtype,
                "' is unknown; use \"fp32\" (the default: fp32 masters beside half weights) or "
                "\"bf16\" (no masters: the bf16 weights updated with stochastic rounding)");
  if (master_dtype == "bf16") {
    const auto precision = resolved_.sections.find("precision");
    const std::string mode =
        precision == resolved_.sections.end() ? "" : precision->second.get_string("mode");
    LOOM_CHECK_AS(ConfigError, mode == "full_bf16", optimizer.where("master_dtype"),
                  ": [optimizer] master_dtype = \"bf16\" keeps no fp32 masters and writes each "
                  "update into the bf16 weights, but ",
                  mode.empty() ? std::string("the job has no [precision] table: its weights are fp32")
                               : "[precision] mode = \"" + mode + "\" keeps " +
                                     (mode == "full_fp16" ? "fp16" : "fp32") + " weights",
                  "; set [precision] mode = \"full_bf16\", or remove master_dtype");
  }
  // LOOM_KERNEL_ISA is read by the kernels at every call; a bad value is refused here, before
  // the job writes anything, where the first step would refuse it after (Note [Kernel ISA cap]).
  (void)cpu::kernel_isa();
  (void)kept_large_blocks_mib();  // the same for LOOM_KEEP_LARGE_BLOCKS_MIB, read at run start

  // Every table plugin's own table, then every active plugin against the whole job.
  for (auto* plugin : resolved_.table_plugins) plugin->plugin->configure(section(plugin->name));
  Plugin::JobTables tables;
  tables.table = [this](const std::string& name) -> const ConfigSection* {
    auto it = resolved_.sections.find(name);
    return it == resolved_.sections.end() ? nullptr : &it->second;
  };
  tables.resolve_path = [this](const std::string& path) { return resolve_path(path); };
  const std::pair<const ResolvedJob::Choice*, const char*> selectors[] = {
      {&resolved_.model, "model"}, {&resolved_.data, "data"},
      {&resolved_.update_rule, "optimizer"}};
  for (const auto& [choice, table] : selectors) {
    if (purpose_ == Purpose::inference && std::string(table) == "data") continue;
    choice->provider->plugin->validate(choice->name, section(table), tables);
  }
  // A from_pretrained folder (the key every model plugin reads) is opened here, config.json and
  // the weight files' headers, so `check` refuses a folder that building the model would: a
  // missing file, a broken index, a part of a model (Note [Partial model files]).
  const auto& model_table = section("model");
  if (model_table.schema().find("from_pretrained") &&
      !model_table.get_string("from_pretrained").empty())
    pretrained::Folder{resolve_path(model_table.get_string("from_pretrained"))};
  if (resolved_.eval_data.provider && purpose_ != Purpose::inference)
    resolved_.eval_data.provider->plugin->validate(resolved_.eval_data.name, section("eval_data"),
                                                   tables);

  // Built now, so every value the rule takes is checked before anything else is; it holds no
  // state until the engine hands it parameters. The table plugins validate against it
  // (JobTables::update_rule): what the rule needs is known here, not only at setup.
  rule_ = resolved_.update_rule.provider->plugin->create_update_rule(resolved_.update_rule.name,
                                                                     optimizer);
  LOOM_INTERNAL_ASSERT(rule_, "plugin ", resolved_.update_rule.provider->name,
                       " made no update rule '", resolved_.update_rule.name, "'");
  // Note [Stochastic rounding of the state] (core/src/adamw.cpp): a rule that does not keep its
  // state in the asked dtype is refused by name, never left to ignore the key.
  const auto offered = rule_->state_dtypes();
  if (std::find(offered.begin(), offered.end(), state_dtype) == offered.end()) {
    std::string list;
    for (const auto& dtype : offered) list += (list.empty() ? "\"" : ", \"") + dtype + "\"";
    throw ConfigError(detail::cat(optimizer.where("state_dtype"), ": [optimizer] state_dtype = \"",
                                  state_dtype, "\" is not offered by the update rule '",
                                  resolved_.update_rule.name, "', which keeps its state as ", list,
                                  " only; use name = \"adamw\" for bf16 state, or remove "
                                  "state_dtype"));
  }
  rule_->set_seed(static_cast<uint64_t>(train.get_int("seed")));
  tables.update_rule = rule_.get();
  for (auto* plugin : resolved_.table_plugins)
    plugin->plugin->validate(plugin->name, section(plugin->name), tables);
  if (master_dtype == "bf16")
    if (const LoadedPlugin* driver = resolved_.table_plugin_in(Slot::step_driver))
      LOOM_CHECK_AS(ConfigError, driver->plugin->keeps_no_masters(section(driver->name)),
                    optimizer.where("master_dtype"), ": [optimizer] master_dtype = \"bf16\" keeps "
                    "no fp32 masters, but [", driver->name, "] gives the job a step driver that "
                    "does not say it can keep none (plugin ", driver->name, ": "
                    "Plugin::keeps_no_masters); remove master_dtype, or drop [", driver->name,
                    "] for the core's step driver");
  if (purpose_ == Purpose::train) check_output_dir();
}

// Note [Data parallelism by default]: a job launched on several ranks with no plugin in the
// grad_sync slot ([ddp], [zero]) would train one model per rank; torchrun with the Trainer, and
// Accelerate, make that data parallelism unless told otherwise, and so does loom: [ddp] with
// its defaults (the engine says so in one info line). Only the tables resolution reads gain it:
// the job, and so the config hash its checkpoints record, stays as written, and the same job
// on one rank resumes them without a warning. The launcher's environment gives the world size
// (dist_env.h); the estimator's solo probes see one rank and get none.
void PreparedJob::add_default_data_parallelism() {
  for (auto* plugin : resolved_.table_plugins)
    for (Slot slot : plugin->plugin->slots())
      if (slot == Slot::grad_sync) return;
  if (section("distributed").get_string("backend") == "local" || detect_dist_env().world_size <= 1)
    return;
  Job with_ddp = job_;
  ConfigValue ddp;
  ddp.value = ConfigTable{};
  ddp.where = job_.file.string() + " (no [ddp] or [zero] on several ranks: [ddp] by default)";
  std::get<ConfigTable>(with_ddp.root.value).emplace_back("ddp", std::move(ddp));
  resolved_ = resolve(with_ddp, host_);
  default_ddp_ = true;
}

bool PreparedJob::has_evaluation_set() const {
  return resolved_.eval_data.provider != nullptr ||
         section("data").get_float("validation_split") > 0;
}

// Note [Evaluation]: when and on what, checked before anything is built.
void PreparedJob::check_evaluation() const {
  const auto& train = section("train");
  const std::string strategy = train.get_string("eval_strategy");
  LOOM_CHECK_AS(ConfigError, strategy == "no" || strategy == "steps" || strategy == "epoch",
                train.where("eval_strategy"), ": [train] eval_strategy = \"", strategy,
                "\" is unknown; use \"no\", \"steps\" or \"epoch\"");
  LOOM_CHECK_AS(ConfigError, train.get_int("eval_steps") >= 0, train.where("eval_steps"),
                ": [train] eval_steps must be >= 0 (0 = logging_steps), got ",
                train.get_int("eval_steps"));
  LOOM_CHECK_AS(ConfigError, train.get_int("per_device_eval_batch_size") > 0,
                train.where("per_device_eval_batch_size"),
                ": [train] per_device_eval_batch_size must be positive, got ",
                train.get_int("per_device_eval_batch_size"));
  const auto& data = section("data");
  const double split = data.get_float("validation_split");
  LOOM_CHECK_AS(ConfigError, split >= 0 && split < 1, data.where("validation_split"),
                ": [data] validation_split must be in [0, 1) (the share held out), got ", split);
  const bool table = resolved_.eval_data.provider != nullptr;
  LOOM_CHECK_AS(ConfigError, !(table && split > 0), data.where("validation_split"),
                ": [data] validation_split = ", split, " and an [eval_data] table both give an "
                "evaluation set; keep one of them");
  const bool evaluates = strategy != "no" || train.get_bool("eval_on_start");
  // Note [Best model].
  LOOM_CHECK_AS(ConfigError, train.get_int("early_stopping_patience") >= 0,
                train.where("early_stopping_patience"),
                ": [train] early_stopping_patience must be >= 0 (0 = never stop early)");
  LOOM_CHECK_AS(ConfigError, train.get_float("early_stopping_threshold") >= 0,
                train.where("early_stopping_threshold"),
                ": [train] early_stopping_threshold must be >= 0");
  const BestModel::Options best = BestModel::options_from(train);
  if (!best.metric.empty()) {
    const char* key = best.load_at_end            ? "load_best_model_at_end"
                      : best.patience > 0         ? "early_stopping_patience"
                                                  : "metric_for_best_model";
    LOOM_CHECK_AS(ConfigError, strategy != "no", train.where(key), ": [train] ", key,
                  " ranks evaluations, but eval_strategy = \"no\" evaluates none; set "
                  "eval_strategy = \"steps\" (with eval_steps) or \"epoch\"");
  }
  if (!best.metric.empty()) {
    const std::vector<std::string> known = {"eval_loss", "eval_perplexity", "eval_accuracy",
                                            "eval_f1", "eval_runtime", "eval_samples_per_second",
                                            "eval_steps_per_second"};
    std::string listed;
    for (const auto& name : known) listed += (listed.empty() ? "" : ", ") + name;
    LOOM_CHECK_AS(ConfigError, std::find(known.begin(), known.end(), best.metric) != known.end(),
                  train.where("metric_for_best_model"), ": [train] metric_for_best_model '",
                  train.get_string("metric_for_best_model"), "' names no metric an evaluation "
                  "computes; use one of ", listed, " (the eval_ prefix may be left out)");
  }
  if (best.load_at_end) {
    const int64_t every = evaluation_interval(train);
    const int64_t save = train.get_int("save_steps");
    LOOM_CHECK_AS(ConfigError, strategy == "steps" && save > 0 && save % every == 0,
                  train.where("load_best_model_at_end"), ": [train] load_best_model_at_end needs "
                  "a checkpoint at evaluation steps: eval_strategy = \"steps\" and save_steps a "
                  "multiple of eval_steps (now eval_strategy = \"", strategy, "\", save_steps = ",
                  save, ", evaluations every ", every, " steps)");
  }
  LOOM_CHECK_AS(ConfigError, !evaluates || has_evaluation_set(),
                train.where(strategy != "no" ? "eval_strategy" : "eval_on_start"),
                ": [train] ", strategy != "no" ? "eval_strategy = \"" + strategy + "\""
                                               : std::string("eval_on_start = true"),
                " needs evaluation data: an [eval_data] table (any data source) or [data] "
                "validation_split = 0.1 (a share of [data] held out)");
}

std::string PreparedJob::resolve_path(const std::string& path) const {
  std::filesystem::path p(path);
  return (p.is_absolute() ? p : job_.dir / p).lexically_normal().string();
}

std::unique_ptr<UpdateRule> PreparedJob::take_update_rule() {
  LOOM_INTERNAL_ASSERT(rule_, "the prepared job's update rule was taken already");
  return std::move(rule_);
}

// What the engine's output folder will refuse at setup, refused before anything is written.
void PreparedJob::check_output_dir() const {
  const auto& train = section("train");
  const std::string output_dir = resolve_path(train.get_string("output_dir"));
  std::string resume = train.get_string("resume");
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (resume.empty() && restarts && std::atoi(restarts) > 0) return;  // resumes "latest"
  if (resume.empty()) {
    if (!latest_checkpoint(output_dir).empty())
      throw ConfigError(detail::cat(
          train.where("output_dir"), ": output_dir ", output_dir,
          " already holds checkpoints of an earlier run; set [train] resume = \"latest\" to "
          "continue it, or choose another output_dir (nothing was changed)"));
  } else if (resume != "latest") {
    const std::string folder = resolve_path(resume);
    std::error_code ec;
    LOOM_CHECK_AS(ConfigError, std::filesystem::is_directory(folder, ec), train.where("resume"),
                  ": [train] resume = \"", resume, "\": checkpoint folder '", folder,
                  "' does not exist; give a checkpoint folder (output_dir/checkpoint-N), "
                  "\"latest\", or \"\" for a fresh run");
  }
}

std::string PreparedJob::describe() const {
  std::ostringstream out;
  const auto& train = section("train");
  out << "job " << job_.file.string() << " (config hash " << job_.hash() << ")\n";
  for (const auto& note : job_.notes) out << "  " << note << "\n";
  for (const auto& warning : job_.warnings) out << "  warning: " << warning << "\n";
  out << "  model      " << resolved_.model.name << "  (plugin "
      << plugin_label(resolved_.model.provider) << ")\n";
  out << "  data       " << resolved_.data.name << "  (plugin "
      << plugin_label(resolved_.data.provider) << ")\n";
  if (resolved_.eval_data.provider)
    out << "  eval data  " << resolved_.eval_data.name << "  (plugin "
        << plugin_label(resolved_.eval_data.provider) << ")\n";
  out << "  optimizer  " << resolved_.update_rule.name << "  (plugin "
      << plugin_label(resolved_.update_rule.provider) << ")\n";
  out << "  plugins    ";
  if (resolved_.table_plugins.empty()) out << "(none besides the above)";
  for (auto* p : resolved_.table_plugins) out << p->name << " ";
  // Note [Plugin order]: the order of attach and of every event's handlers.
  out << "\n  order     ";
  for (auto* p : resolved_.active) out << " " << p->name;
  // Every plugin library loaded for the job, by the file that runs (links resolved).
  const char* heading = "\n  files      ";
  for (const auto& p : host_.plugins()) {
    if (p->builtin()) continue;
    out << heading << p->name << " " << p->version << ": " << p->file_label();
    heading = "\n             ";
  }
  if (steps_by_epochs())
    out << "\n  epochs     " << train.get_float("num_train_epochs")
        << " (steps counted when the data is read)";
  out << "\n  steps      "
      << (steps_by_epochs() ? std::string("by epochs") : std::to_string(train.get_int("max_steps")))
      << " x "
      << train.get_int("per_device_train_batch_size") << " samples x "
      << train.get_int("gradient_accumulation_steps") << " micro-batches per rank\n";
  for (const auto& [name, section] : resolved_.sections) {
    if (section.values().empty()) continue;
    out << "  [" << name << "]";
    for (const auto& [key, value] : section.values()) out << " " << key << "=" << value.to_text();
    out << "\n";
  }
  return out.str();
}

bool PreparedJob::steps_by_epochs() const {
  const auto& train = section("train");
  return train.get_float("num_train_epochs") > 0 && !train.has("max_steps");
}

}  // namespace loom
