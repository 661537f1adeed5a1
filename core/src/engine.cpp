// The engine: resolves a job, builds model / data / update rule from the active plugins, runs
// the training loop and fires the events in the order documented in loom/engine.h, and writes
// metrics and checkpoints.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "checkpoint_io.h"
#include "run_checkpoint.h"
#include "device.h"
#include "inference.h"
#include "job.h"
#include "param_groups.h"
#include "loom/comm.h"
#include "loom/cpu.h"
#include "loom/data.h"
#include "loom/log.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"
#include "loom/pretrained.h"
#include "loom/safetensors.h"
#include "loom/step_driver.h"
#include "loom/trainer.h"
#include "plugin_host.h"
#include "resolve.h"
#include "schedule.h"
#include "step_report.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

struct Registered {
  int position;  // the plugin's place in the resolved order (Note [Plugin order])
  size_t order;
  Engine::Handler handler;
};

class EngineImpl;

// Fires grad_ready once a parameter's .grad holds this micro-batch's contribution.
class GradReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(EngineImpl* engine, size_t index) : engine_(engine), index_(index) {}
  void operator()(const torch::autograd::Variable&) override;

 private:
  EngineImpl* engine_;
  size_t index_;
};

class EngineImpl final : public Engine, public Trainer {
 public:
  EngineImpl(Job job) : job_(std::move(job)) {
    resolved_ = resolve(job_, host_);
    const auto& train = resolved_.section("train");
    LOOM_CHECK_AS(ConfigError, train.get_int("max_steps") >= 0, train.where("max_steps"),
                  ": [train] max_steps must be >= 0");
    LOOM_CHECK_AS(ConfigError, train.get_int("per_device_train_batch_size") > 0,
                  train.where("per_device_train_batch_size"),
                  ": [train] per_device_train_batch_size must be positive");
    LOOM_CHECK_AS(ConfigError, train.get_int("gradient_accumulation_steps") > 0,
                  train.where("gradient_accumulation_steps"),
                  ": [train] gradient_accumulation_steps must be positive");
    LOOM_CHECK_AS(ConfigError, train.get_float("learning_rate") >= 0,
                  train.where("learning_rate"), ": [train] learning_rate must be >= 0, got ",
                  train.get_float("learning_rate"));
    LOOM_CHECK_AS(ConfigError, train.get_float("max_grad_norm") >= 0,
                  train.where("max_grad_norm"), ": [train] max_grad_norm must be >= 0");
    schedule_ = make_schedule(train);
    log_level_ = log::parse_level(train.get_string("log_level"));
    cpu::parse_job_isa(train.get_string("cpu_isa"), train.where("cpu_isa"));
    const auto& distributed = resolved_.section("distributed");
    LOOM_CHECK_AS(ConfigError, distributed.get_float("timeout_seconds") > 0,
                  distributed.where("timeout_seconds"),
                  ": [distributed] timeout_seconds must be positive (seconds a collective may "
                  "take before a peer counts as dead), got ",
                  distributed.get_float("timeout_seconds"));
    const auto& optimizer = resolved_.section("optimizer");
    if (optimizer.schema().find("weight_decay") && optimizer.get("weight_decay"))
      LOOM_CHECK_AS(ConfigError, optimizer.get_float("weight_decay") >= 0,
                    optimizer.where("weight_decay"), ": [optimizer] weight_decay must be >= 0, got ",
                    optimizer.get_float("weight_decay"));
    // Note [One validation]: everything `loom check` can know without building is checked here,
    // at construction, so check and run refuse the same jobs: each table plugin's configure()
    // and each provider's validate() against the whole job.
    const Plugin::JobTables tables = [this](const std::string& name) -> const ConfigSection* {
      auto it = resolved_.sections.find(name);
      return it == resolved_.sections.end() ? nullptr : &it->second;
    };
    const std::pair<const ResolvedJob::Choice*, const char*> selectors[] = {
        {&resolved_.model, "model"}, {&resolved_.data, "data"},
        {&resolved_.update_rule, "optimizer"}};
    for (const auto& [choice, table] : selectors)
      if (choice->provider)
        choice->provider->plugin->validate(choice->name, resolved_.section(table), tables);
    for (auto* plugin : resolved_.table_plugins)
      plugin->plugin->configure(resolved_.section(plugin->name));
  }

  ~EngineImpl() override {
    // Plugins' handlers may hold plugin code; drop them before the host destroys plugins.
    for (auto& list : handlers_) list.clear();
    grad_handlers_.clear();
    interceptors_.clear();
  }

  // `loom export`: the model plugin's transformers form of `weights` (see export_checkpoint),
  // with the table plugins' additions folded in first when `merge` (Note [Merged export]).
  pretrained::Export to_pretrained(NamedTensors weights, bool merge) const {
    const auto& model = resolved_.model;
    LOOM_CHECK_AS(ConfigError, model.provider, "the job names no model to export");
    const auto resolve = [this](const std::string& path) { return resolve_path(path); };
    if (merge) {
      bool merged = false;
      for (auto* plugin : resolved_.table_plugins)
        merged = plugin->plugin->merge_for_export(resolved_.section(plugin->name), weights,
                                                  resolve) ||
                 merged;
      LOOM_CHECK_AS(ConfigError, merged, "--merge: nothing in this job folds into the base "
                    "model (no [lora] adapters); export it without --merge");
    }
    auto out = model.provider->plugin->export_pretrained(model.name, resolved_.section("model"),
                                                         weights, resolve);
    LOOM_CHECK_AS(ConfigError, out.has_value(), "model '", model.name, "' (plugin ",
                  plugin_label(model.provider),
                  ") has no transformers form to export; `loom consolidate` writes its weights "
                  "as one safetensors file");
    return std::move(*out);
  }

  // `loom generate`: the model alone, on `device_name` ("auto": the job's choice), with the
  // structure the job's plugins give it at model_built (LoRA adapters, MoE layers) and
  // `weights` (fp32, by loom's names) in it, in eval mode. Nothing else is built.
  Model* build_for_inference(const NamedTensors& weights, const std::string& device_name,
                             const std::string& source) {
    const auto& train = resolved_.section("train");
    CommOptions comm_options;  // one process: the local backend
    comm_ = make_comm(comm_options);
    log::configure(0, 1, false, log_level_);
    const int threads = intra_op_threads(train, 1);
    cpu::apply_job_isa(train.get_string("cpu_isa"), train.where("cpu_isa"));
    at::set_num_threads(threads);
    device_ = pick_device(device_name == "auto" ? train.get_string("device") : device_name,
                          "the generate command's --device", 0, 1);
    activate_device(device_);
    seed_ = static_cast<uint64_t>(train.get_int("seed"));
    attach_plugins();
    build_model();
    pretrained::assign(*model_, weights, source);
    model_->eval();
    return model_.get();
  }

  // [train] num_threads, or (0) the cores this process may use shared among the node's ranks.
  static int intra_op_threads(const ConfigSection& train, int local_world_size) {
    const int threads = static_cast<int>(train.get_int("num_threads"));
    LOOM_CHECK_AS(ConfigError, threads >= 0, train.where("num_threads"),
                  ": [train] num_threads must be >= 0 (0 = all cores)");
    if (threads > 0) return threads;
    cpu_set_t set;
    const int cores = sched_getaffinity(0, sizeof set, &set) == 0
                          ? CPU_COUNT(&set)
                          : static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, cores / std::max(1, local_world_size));
  }

  // In the order the plugins' constraints give (Note [Plugin order]); every event's handlers
  // then run in that order, those registered later (from a handler) last.
  void attach_plugins() {
    for (size_t i = 0; i < resolved_.active.size(); ++i) {
      current_position_ = static_cast<int>(i);
      resolved_.active[i]->plugin->attach(*this);
    }
    current_position_ = std::numeric_limits<int>::max();
  }

  // The model, built right after seeding (its initial weights depend on the seed only), moved to
  // the device, in train mode; then model_built.
  void build_model() {
    at::manual_seed(seed_);
    model_ = resolved_.model.provider->plugin->create_model(resolved_.model.name,
                                                             resolved_.section("model"), *this);
    LOOM_INTERNAL_ASSERT(model_, "plugin ", resolved_.model.provider->name, " made no model");
    model_->to(device_);
    model_->train();
    fire(Event::model_built);
  }

  // ---- Trainer ----
  std::string describe() const override {
    std::ostringstream out;
    const auto& train = resolved_.section("train");
    out << "job " << job_.file.string() << " (config hash " << job_.hash() << ")\n";
    out << "  model      " << resolved_.model.name << "  (plugin "
        << plugin_label(resolved_.model.provider) << ")\n";
    out << "  data       " << resolved_.data.name << "  (plugin "
        << plugin_label(resolved_.data.provider) << ")\n";
    out << "  optimizer  " << resolved_.update_rule.name << "  (plugin "
        << plugin_label(resolved_.update_rule.provider) << ")\n";
    out << "  plugins    ";
    if (resolved_.table_plugins.empty()) out << "(none besides the above)";
    for (auto* p : resolved_.table_plugins) out << p->name << " ";
    // Note [Plugin order]: the order of attach and of every event's handlers.
    out << "\n  order     ";
    for (auto* p : resolved_.active) out << " " << p->name;
    out << "\n  steps      " << train.get_int("max_steps") << " x "
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

  void setup() override {
    if (setup_done_) return;
    const auto& train = resolved_.section("train");
    memory::install_cpu_tracker();
    CommOptions comm_options;
    comm_options.backend = resolved_.section("distributed").get_string("backend");
    const std::string device_name = train.get_string("device");
    comm_options.cuda = device_name.rfind("cuda", 0) == 0 || (device_name == "auto" && at::hasCUDA());
    comm_options.timeout = std::chrono::milliseconds(static_cast<int64_t>(
        resolved_.section("distributed").get_float("timeout_seconds") * 1000));
    comm_ = make_comm(comm_options);
    log::configure(comm_->rank(), comm_->world_size(), train.get_bool("log_all_ranks"),
                   log_level_);

    const int threads = intra_op_threads(train, comm_->local_world_size());
    cpu::apply_job_isa(train.get_string("cpu_isa"), train.where("cpu_isa"));  // before any kernel
    at::set_num_threads(threads);
    device_ = pick_device(device_name, train.where("device"), comm_->local_rank(),
                          comm_->local_world_size());
    activate_device(device_);
    const std::string malloc_note = device_.is_cpu() ? keep_freed_cpu_memory() : "";
    LOOM_CHECK_AS(ConfigError, comm_->device().is_cpu() || device_.is_cuda(),
                  resolved_.section("distributed").where("backend"), ": [distributed] backend = \"",
                  comm_->backend(), "\" moves CUDA tensors only, but this job trains on ",
                  device_.str(), " ([train] device = \"", device_name,
                  "\"); use backend = \"gloo\" or \"mpi\" on CPUs, or a CUDA device");
    // Several ranks need something that keeps their replicas in step.
    bool synced = comm_->world_size() == 1;
    for (auto* plugin : resolved_.table_plugins)
      for (Slot slot : plugin->plugin->slots()) synced |= slot == Slot::grad_sync;
    LOOM_CHECK_AS(ConfigError, synced, "this job runs on ", comm_->world_size(),
                  " ranks but no plugin synchronises gradients, so each rank would train its "
                  "own model; add a [ddp] table (data parallelism)");
    seed_ = static_cast<uint64_t>(train.get_int("seed"));
    state_.max_steps = train.get_int("max_steps");
    state_.accumulation_steps = train.get_int("gradient_accumulation_steps");
    output_dir_ = resolve_path(train.get_string("output_dir"));
    if (train.get_bool("auto_find_batch_size") && comm_->world_size() > 1) {
      // Note [Auto batch size]: each rank chose alone; a rank that chose otherwise (another
      // machine, another budget) would train with another batch than its peers.
      const int64_t mine[2] = {train.get_int("per_device_train_batch_size"),
                               state_.accumulation_steps};
      at::Tensor both = at::tensor({mine[0], mine[1], -mine[0], -mine[1]}, at::kLong).to(comm_->device());
      comm_->all_reduce(both, ReduceOp::max)->wait();
      both = both.cpu();
      const int64_t most = both[0].item<int64_t>(), least = -both[2].item<int64_t>();
      LOOM_CHECK_AS(ConfigError, most == least && both[1].item<int64_t>() == -both[3].item<int64_t>(),
                    train.where("auto_find_batch_size"), ": auto_find_batch_size chose "
                    "per-device batches from ", least, " to ", most, " on different ranks (this "
                    "rank ", mine[0], "); set [train] memory_budget to the same size for every "
                    "rank, or set per_device_train_batch_size yourself");
    }

    log::info("loom ", LOOM_VERSION, " | torch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
              ".", TORCH_VERSION_PATCH, " (", LOOM_BUILD_CUDA, " build) | device ", device_.str(),
              " | intra-op threads ", at::get_num_threads(), " | ranks ", comm_->world_size(),
              " (", comm_->backend(), ")");
    log::info("job ", job_.file.string(), " (config hash ", job_.hash(), ")");
    log::info("cpu ", cpu::read_cpu_info().model, " | oneDNN isa ", cpu::isa_in_effect().summary());
    if (!malloc_note.empty()) log::info(malloc_note);  // Note [Freed memory kept]

    attach_plugins();

    // Data first, so setup handlers can wrap it (preloading).
    SamplerOptions sampler;
    sampler.batch_size = train.get_int("per_device_train_batch_size");
    sampler.shuffle = resolved_.section("data").get_bool("shuffle");
    sampler.drop_last = resolved_.section("data").get_bool("drop_last");
    sampler.seed = seed_;
    sampler.rank = comm_->rank();
    sampler.world_size = comm_->world_size();
    auto dataset = resolved_.data.provider->plugin->create_dataset(
        resolved_.data.name, resolved_.section("data"), *this);
    data_ = std::make_unique<SampledSource>(std::move(dataset), sampler);
    fire(Event::setup);

    build_model();
    for (auto* list : unit_lists()) list->set_interceptors(interceptors_);
    if (!interceptors_.empty() && unit_lists().empty())
      log::warn("unit interceptors were added (", interceptors_.front()->name(),
                "...) but model '", resolved_.model.name,
                "' has no loom::nn::UnitList: they have nothing to wrap");

    collect_params();
    const auto& opt = resolved_.section("optimizer");
    const double weight_decay =
        opt.schema().find("weight_decay") ? opt.get_float("weight_decay") : 0.0;
    LOOM_CHECK_AS(ConfigError, weight_decay >= 0, opt.where("weight_decay"),
                  ": [optimizer] weight_decay must be >= 0");
    rule_ = resolved_.update_rule.provider->plugin->create_update_rule(resolved_.update_rule.name,
                                                                       opt);
    StepDriverOptions driver_options;
    driver_options.params = params_;
    driver_options.rule = rule_.get();
    driver_options.weight_decay = weight_decay;
    driver_options.comm = comm_.get();
    driver_ = make_driver(driver_options);
    install_grad_hooks();
    fire(Event::params_ready);

    prepare_output_dir(train);
    log::info("model ", resolved_.model.name, ": ", model_state().describe());
    write_run_info();
    log::info("data ", data_->describe(), "; ", sampler.batch_size, " samples x ",
              state_.accumulation_steps, " micro-batches x ", comm_->world_size(),
              " rank(s) = ", sampler.batch_size * state_.accumulation_steps * comm_->world_size(),
              " samples per step");
    log::info("optimizer ", rule_->name(), ", lr ", train.get_float("learning_rate"), " (",
              schedule_.describe(), "), max_grad_norm ", train.get_float("max_grad_norm"));
    setup_done_ = true;
  }

  bool step() override {
    setup();
    if (state_.step >= state_.max_steps) return false;
    const auto start = Clock::now();
    const auto& train = resolved_.section("train");
    state_.lr = schedule_.lr(state_.step);
    driver_->zero_grad();
    state_.metrics.clear();
    state_.skip_update = false;
    state_.grads_scaled = false;

    // Note [Loss normalisation]: a token-level loss is the mean over every target of the whole
    // accumulation window (and of all ranks), not the mean of per-micro-batch means — those
    // weight a short micro-batch's tokens more (the bug Hugging Face fixed in late 2024). So the
    // window's micro-batches are drawn first, their targets counted, and each micro-batch's
    // summed loss is divided by that count.
    std::vector<Batch> window;
    int64_t local_targets = 0, samples = 0, tokens = 0;
    for (int64_t k = 0; k < state_.accumulation_steps; ++k) {
      window.push_back(data_->next());
      // A source that moves batches itself (preload) counts them on the host before; one
      // that does not leaves the models to count on the device.
      Batch& drawn = window.back();
      if (!drawn.host_stats.known && (!drawn.input_ids.defined() || drawn.input_ids.is_cpu()))
        drawn.compute_host_stats();
      local_targets += drawn.num_loss_targets();
      samples += drawn.num_samples();
      tokens += drawn.num_tokens();
    }
    state_.window_targets = local_targets;
    if (comm_->world_size() > 1) {
      // On the backend's device (NCCL takes CUDA tensors only); one sync per step.
      at::Tensor counts = at::full({1}, static_cast<double>(local_targets),
                                   at::TensorOptions().dtype(at::kDouble).device(comm_->device()));
      comm_->all_reduce(counts, ReduceOp::sum)->wait();
      state_.window_targets = static_cast<int64_t>(counts.item<double>());
    }
    LOOM_CHECK_AS(DataError, state_.window_targets > 0, "step ", state_.step + 1,
                  ": the accumulation window has no loss targets (every label is ",
                  kIgnoreIndex, ")");
    // Grad sync averages over ranks, so each rank scales by world / global targets.
    const double normaliser =
        static_cast<double>(comm_->world_size()) / static_cast<double>(state_.window_targets);

    // The window's summed loss stays on the device until the step's one host sync below.
    // Element 1 carries this rank's stop request to the all-reduce below (Note [Graceful stop]).
    // Element 2 sums the micro-batches' auxiliary losses (Note [Auxiliary losses]).
    at::Tensor loss_total = at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device_));
    bool any_aux = false;
    for (int64_t k = 0; k < state_.accumulation_steps; ++k) {
      state_.micro_step = k;
      state_.sync_grads = state_.is_last_micro_step();
      // Page-locked host memory lets the copy run asynchronously to the compute stream.
      batch_ = device_.is_cuda() ? window[k].pinned().to(device_, /*non_blocking=*/true)
                                 : window[k].to(device_);
      fire(Event::batch);
      fire(Event::before_forward);
      nn::detail::reset_aux_losses();
      output_ = model_->forward(batch_);
      LOOM_INTERNAL_ASSERT(output_.loss_sum.defined(), "model ", resolved_.model.name,
                           " returned no loss");
      if (!output_.aux_loss.defined()) output_.aux_loss = nn::detail::collected_aux_losses();
      fire(Event::after_forward);
      fire(Event::before_backward);
      at::Tensor loss = output_.loss_sum.to(at::kFloat) * normaliser;
      const double accumulation = static_cast<double>(state_.accumulation_steps);
      if (output_.aux_loss.defined()) {
        // An auxiliary loss counts once per micro-batch, as a mean over the window: its
        // gradient is then the same for any split into micro-batches of the same samples.
        if (output_.aux_loss.requires_grad())
          loss = loss + output_.aux_loss.to(at::kFloat) / accumulation;
        loss_total.narrow(0, 2, 1).add_(output_.aux_loss.detach().to(at::kDouble).reshape({1}));
        any_aux = true;
      }
      if (state_.loss_scale != 1.0) {
        loss = loss * state_.loss_scale;
        state_.grads_scaled = true;
      }
      nn::detail::set_aux_loss_grad_scale(state_.loss_scale / accumulation);
      loss.backward();
      loss_total.narrow(0, 0, 1).add_(output_.loss_sum.detach().to(at::kDouble).reshape({1}));
      fire(Event::after_backward);
      output_.logits = at::Tensor();  // see Engine::output()
    }
    const int signal = stop_requested();
    at::Tensor host;  // the step's one host read of the loss
    if (comm_->world_size() > 1) {
      // The reported loss is the window's mean over all ranks' targets; and the ranks agree
      // whether to stop after this step (one of them was signalled).
      loss_total.narrow(0, 1, 1).fill_(signal != 0 ? 1.0 : 0.0);
      loss_total = loss_total.to(comm_->device());
      comm_->all_reduce(loss_total, ReduceOp::sum)->wait();
      host = loss_total.cpu();
      state_.loss = host[0].item<double>() / static_cast<double>(state_.window_targets);
      if (host[1].item<double>() > 0) stop_signal_ = signal != 0 ? signal : SIGTERM;
    } else {
      host = loss_total.cpu();
      state_.loss = host[0].item<double>() /
                    static_cast<double>(std::max<int64_t>(1, local_targets));
      stop_signal_ = signal;
    }
    if (any_aux)  // the mean over the window's micro-batches and the ranks
      state_.metrics.emplace_back(
          "aux_loss", host[2].item<double>() /
                          static_cast<double>(state_.accumulation_steps * comm_->world_size()));

    fire(Event::before_update);
    if (state_.skip_update) {
      ++state_.skipped_updates;
      log::warn("step ", state_.step + 1, ": update skipped (", state_.skipped_updates,
                " so far)");
    } else {
      // After the loss scaler had its say: an fp16 overflow it skips is not divergence.
      LOOM_CHECK(std::isfinite(state_.loss), "step ", state_.step + 1, ": the loss is ",
                 state_.loss, ": training diverged (or the model produced non-finite values); "
                 "lower [train] learning_rate, check the data, or use [precision] with loss "
                 "scaling for fp16; no checkpoint of this step is written");
      LOOM_INTERNAL_ASSERT(!state_.grads_scaled,
                           "gradients are still scaled by the loss scale at update time; the "
                           "precision plugin must unscale them in before_update");
      state_.grad_norm = std::sqrt(driver_->grad_norm_squared().item<double>());
      LOOM_CHECK(std::isfinite(state_.grad_norm), "step ", state_.step + 1,
                 ": the gradient norm is ", state_.grad_norm, " (loss ", state_.loss,
                 "): training diverged; lower [train] learning_rate, or use [precision] with "
                 "loss scaling for fp16");
      const double max_norm = train.get_float("max_grad_norm");
      if (max_norm > 0) {
        const double coefficient = max_norm / (state_.grad_norm + 1e-6);
        if (coefficient < 1.0) driver_->scale_grads(coefficient);
      }
      driver_->update(state_.step + 1, state_.lr);
    }
    ++state_.step;
    fire(Event::after_update);

    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    report_->report(state_, seconds, samples, tokens);
    fire(Event::step_end);
    const int64_t every = train.get_int("save_steps");
    if (every > 0 && state_.step % every == 0 && state_.step < state_.max_steps)
      save_checkpoint();
    return true;
  }

  RunSummary run() override {
    RunSummary summary;
    try {
      setup();
      const auto start = Clock::now();
      const int64_t first = state_.step;
      while (!stop_signal_ && step()) {
      }
      if (report_) report_->end_progress();
      const auto& train = resolved_.section("train");
      const bool saves = train.get_int("save_steps") > 0 || train.get_bool("save_final");
      const bool saved_now = saved_step_ == state_.step;  // save_steps wrote this step already
      if (stop_signal_) {
        log::warn("stopped by ", stop_signal_ == SIGINT ? "SIGINT" : "SIGTERM", " after step ",
                  state_.step, " of ", state_.max_steps);
        if (saves && train.get_bool("save_on_signal")) {
          summary.last_checkpoint = saved_now ? saved_folder_ : save_checkpoint();
          log::info("resume with [train] resume = \"latest\" (or \"", summary.last_checkpoint,
                    "\")");
        }
        summary.stopped_by_signal = stop_signal_;
      } else if (saved_now) {
        summary.last_checkpoint = saved_folder_;
      } else if (train.get_bool("save_final") && state_.step > first) {
        summary.last_checkpoint = save_checkpoint();
      }
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      log::info("done: ", state_.step, " steps, final loss ", state_.loss, ", ",
                state_.step - first, " steps in ", seconds, " s, peak memory ",
                memory::format_bytes(memory::device_stats(device_).peak_bytes), " (peak RSS ",
                memory::format_bytes(memory::peak_rss_bytes()), ")");
      fire(Event::teardown);
    } catch (...) {
      if (report_) report_->end_progress();
      try {
        if (setup_done_) fire(Event::teardown);
      } catch (const std::exception& error) {
        log::warn("teardown after an error failed too: ", error.what());
      }
      throw;
    }
    summary.steps = state_.step;
    summary.final_loss = state_.loss;
    summary.output_dir = output_dir_;
    summary.peak_memory_bytes = memory::device_stats(device_).peak_bytes;
    return summary;
  }

  std::string save_checkpoint() override {
    setup();
    checkpoint_ = CheckpointData{};
    fire(Event::save);
    const CheckpointContents contents = checkpoint_contents(run_parts(), checkpoint_);
    // Every rank takes part: sharded optimizer state is written by the ranks that hold it.
    const std::string folder = write_checkpoint(
        output_dir_, contents, resolved_.section("train").get_int("save_total_limit"), *comm_);
    log::info("saved checkpoint ", folder);
    saved_step_ = state_.step;
    saved_folder_ = folder;
    return folder;
  }

  Engine& engine() override { return *this; }

  // ---- Engine ----
  void on(Event event, Handler handler) override {
    LOOM_CHECK(event != Event::grad_ready,
               "register grad_ready handlers with on_grad_ready(): they receive the parameter");
    handlers_[static_cast<size_t>(event)].push_back(
        {current_position_, handler_count_++, std::move(handler)});
    auto& list = handlers_[static_cast<size_t>(event)];
    std::stable_sort(list.begin(), list.end(), [](const Registered& a, const Registered& b) {
      return a.position < b.position;
    });
  }
  void on_grad_ready(GradHandler handler) override {
    LOOM_CHECK(!setup_done_, "on_grad_ready must be called during setup (in attach() or a "
               "setup, model_built or params_ready handler), not once training has begun");
    grad_handlers_.push_back(std::move(handler));
    install_grad_hooks();  // no-op before collect_params; after it, hooks go on now
  }
  void add_unit_interceptor(std::shared_ptr<nn::UnitInterceptor> interceptor) override {
    LOOM_CHECK(interceptor, "add_unit_interceptor needs an interceptor");
    interceptors_.push_back(std::move(interceptor));
    if (model_)
      for (auto* list : unit_lists()) list->set_interceptors(interceptors_);
  }
  const ConfigSection& section(const std::string& table) const override {
    return resolved_.section(table);
  }
  std::string resolve_path(const std::string& path) const override {
    std::filesystem::path p(path);
    return (p.is_absolute() ? p : job_.dir / p).lexically_normal().string();
  }
  c10::Device device() const override { return device_; }
  uint64_t seed() const override {
    return seed_ ? seed_ : static_cast<uint64_t>(resolved_.section("train").get_int("seed"));
  }
  TrainState& state() override { return state_; }
  Model& model() override {
    LOOM_CHECK(model_, "the model is built after the setup event");
    return *model_;
  }
  std::shared_ptr<Model> model_ptr() override { return model_; }
  void set_model(std::shared_ptr<Model> model) override {
    LOOM_CHECK(model && params_.empty(), "set_model only in model_built, with a model");
    model_ = std::move(model);
  }
  void place_param(const at::Tensor& param, ParamPlacement placement) override {
    LOOM_CHECK(params_.empty(), "place_param only in model_built, before params_ready");
    if (!placement.global_shape.empty()) {
      LOOM_CHECK(param.dim() >= 1 &&
                     static_cast<int64_t>(placement.global_shape.size()) == param.dim() &&
                     placement.row_offset >= 0 &&
                     placement.row_offset + param.size(0) <= placement.global_shape[0],
                 "place_param: a ", param.sizes(), " parameter cannot be rows ",
                 placement.row_offset, ".. of a global ", placement.global_shape, " tensor");
      for (int64_t d = 1; d < param.dim(); ++d)
        LOOM_CHECK(param.size(d) == placement.global_shape[d], "place_param: a ", param.sizes(),
                   " parameter is not rows of a global ", placement.global_shape, " tensor");
    }
    placements_[param.unsafeGetTensorImpl()] = std::move(placement);
  }
  std::vector<nn::UnitList*> unit_lists() override {
    std::vector<nn::UnitList*> lists;
    if (!model_) return lists;
    for (const auto& module : model_->modules(/*include_self=*/true))
      if (auto* list = dynamic_cast<nn::UnitList*>(module.get())) lists.push_back(list);
    return lists;
  }
  DataSource& data() override {
    LOOM_CHECK(data_, "no data source: it was taken and not given back");
    return *data_;
  }
  std::unique_ptr<DataSource> take_data() override { return std::move(data_); }
  void set_data(std::unique_ptr<DataSource> data) override { data_ = std::move(data); }
  Comm& comm() override { return *comm_; }
  const std::vector<Param>& params() const override { return params_; }
  Batch& batch() override { return batch_; }
  Output& output() override { return output_; }
  CheckpointData& checkpoint() override { return checkpoint_; }
  StepDriver& step_driver() override {
    LOOM_CHECK(driver_, "the step driver exists from params_ready on");
    return *driver_;
  }

  void fire_grad_ready(size_t index) {
    for (auto& handler : grad_handlers_) handler(*this, params_[index]);
  }

 private:
  static std::string plugin_label(const LoadedPlugin* p) {
    return p->builtin() ? "core (built in)" : p->name + " " + p->version + ", " + p->file.string();
  }

  void fire(Event event) {
    for (auto& registered : handlers_[static_cast<size_t>(event)]) registered.handler(*this);
  }

  void collect_params() {
    params_.clear();
    for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) continue;
      Param param;
      param.name = item.key();
      param.tensor = item.value();
      param.group = model_->no_weight_decay(item.key(), item.value()) ? 1 : 0;
      auto placed = placements_.find(item.value().unsafeGetTensorImpl());
      if (placed != placements_.end()) {
        param.global_shape = placed->second.global_shape;
        param.row_offset = placed->second.row_offset;
        param.replicas = placed->second.replicas;
        if (placed->second.group >= 0) param.group = placed->second.group;
      }
      params_.push_back(param);
    }
    param_count_ = trainable_count_ = trainable_bytes_ = 0;
    for (const auto& item : model_->named_parameters(true)) {
      param_count_ += item.value().numel();
      if (item.value().requires_grad()) {
        trainable_count_ += item.value().numel();
        trainable_bytes_ += item.value().numel() * item.value().element_size();
      }
    }
    LOOM_CHECK(!params_.empty(), "model '", resolved_.model.name,
               "' has no trainable parameters (all are frozen)");
    apply_param_groups(resolved_.section("optimizer"), params_);
  }

  // The plugin filling Slot::step_driver makes the driver; else the core's default one.
  std::unique_ptr<StepDriver> make_driver(const StepDriverOptions& options) {
    for (auto* plugin : resolved_.table_plugins)
      for (Slot slot : plugin->plugin->slots())
        if (slot == Slot::step_driver) {
          auto driver = plugin->plugin->create_step_driver(options, *this);
          LOOM_INTERNAL_ASSERT(driver, "plugin ", plugin->name, " made no step driver");
          log::info("step driver ", driver->name(), " (plugin ", plugin->name, ")");
          return driver;
        }
    return make_default_step_driver(options);
  }

  // grad_ready hooks go on every trainable parameter once, when the first handler arrives at
  // or after collect_params (a handler registered in params_ready fires like an earlier one).
  void install_grad_hooks() {
    if (grad_handlers_.empty() || grad_hooks_installed_ || params_.empty()) return;
    for (size_t i = 0; i < params_.size(); ++i)
      torch::autograd::impl::set_post_acc_grad_hooks(
          params_[i].tensor, std::make_unique<GradReadyHook>(this, i));
    grad_hooks_installed_ = true;
  }

  memory::ModelState model_state() const override {
    LOOM_CHECK(driver_, "the model state is known from params_ready on");
    memory::ModelState s;
    // Counts as built (a sharding driver may since have released whole weights); bytes as held.
    s.param_count = param_count_;
    s.trainable_count = trainable_count_;
    std::set<std::string> sharded;
    for (const auto& name : driver_->sharded_weights()) sharded.insert(name);
    for (const auto& item : model_->named_parameters(true))
      if (!sharded.count(item.key()))
        s.param_bytes += item.value().numel() * item.value().element_size();
    s.param_bytes += driver_->sharded_weight_bytes();
    if (driver_->grad_bytes() < 0)  // unsharded: one gradient per weight, as built
      s.grad_bytes = trainable_bytes_;
    if (driver_->grad_bytes() >= 0) s.grad_bytes = driver_->grad_bytes();  // sharded grads
    s.master_bytes = driver_->master_bytes();
    s.optimizer_bytes = driver_->state_bytes();
    return s;
  }

  void prepare_output_dir(const ConfigSection& train) {
    std::filesystem::create_directories(output_dir_);
    if (comm_->rank() == 0) {
      claim_ = std::make_unique<OutputDirClaim>(output_dir_);
      for (const auto& name : claim_->removed_temp_folders())
        log::info("removed ", output_dir_, "/", name, ": a checkpoint save that never finished");
    }
    std::string resume = train.get_string("resume");
    if (resume.empty() && std::getenv("TORCHELASTIC_RESTART_COUNT") &&
        std::atoi(std::getenv("TORCHELASTIC_RESTART_COUNT")) > 0) {
      // A launcher restarted this job after a failure: carry on from where it was.
      log::info("restart ", std::getenv("TORCHELASTIC_RESTART_COUNT"),
                " of this job: resuming from the latest checkpoint");
      resume = "latest";
    }
    std::string folder;
    if (resume == "latest") {
      folder = latest_checkpoint(output_dir_);
      if (folder.empty())
        log::info("resume = \"latest\": no checkpoint in ", output_dir_, " yet, starting fresh");
    } else if (!resume.empty()) {
      folder = resolve_path(resume);
    } else if (!latest_checkpoint(output_dir_).empty()) {
      throw ConfigError(detail::cat(
          train.where("output_dir"), ": output_dir ", output_dir_,
          " already holds checkpoints of an earlier run; set [train] resume = \"latest\" to "
          "continue it, or choose another output_dir (nothing was changed)"));
    }
    StepReport::Options report;
    report.metrics_path = output_dir_ + "/metrics.jsonl";
    report.rank = comm_->rank();
    report.world_size = comm_->world_size();
    report.progress_bar = train.get_bool("progress_bar");
    report.logging_steps = train.get_int("logging_steps");
    report.device = device_;
    report_ = std::make_unique<StepReport>(report);
    if (!folder.empty()) {
      load_checkpoint(folder);
    } else {
      report_->start_fresh();
    }
  }

  void load_checkpoint(const std::string& folder) {
    ReadCheckpoint read = read_checkpoint(folder);
    if (read.contents.config_hash != job_.hash())
      log::warn("checkpoint ", folder, " was written by a job with another configuration (hash ",
                read.contents.config_hash, ", now ", job_.hash(), "); continuing with the new one");
    checkpoint_ = restore_run(run_parts(), read, folder);
    fire(Event::load);
    log::info("resumed from ", folder, " at step ", state_.step, " (epoch ",
              read.contents.data.epoch, ", sample ", read.contents.data.cursor, ")");
  }

  RunParts run_parts() {
    return RunParts{*model_, resolved_.model.name, *driver_, *data_, state_, *comm_,
                    device_, seed_, job_.hash(), rule_->name(), job_.canonical_text(),
                    job_.dir.string()};
  }

  // output_dir/run.json: what ran where, and the model-state bytes, for tools and benchmarks.
  void write_run_info() const {
    if (comm_->rank() != 0) return;
    const auto ms = model_state();
    nlohmann::ordered_json info = {
        {"loom_version", LOOM_VERSION},
        {"build", LOOM_BUILD_STRING},
        {"device", device_.str()},
        {"threads", at::get_num_threads()},
        {"world_size", comm_->world_size()},
        {"backend", comm_->backend()},
        {"config_hash", job_.hash()},
        {"model", resolved_.model.name},
        {"optimizer", rule_->name()},
        {"model_state",
         {{"params", ms.param_count},
          {"trainable_params", ms.trainable_count},
          {"param_bytes", ms.param_bytes},
          {"master_bytes", ms.master_bytes},
          {"grad_bytes", ms.grad_bytes},
          {"optimizer_bytes", ms.optimizer_bytes}}}};
    std::ofstream(output_dir_ + "/run.json") << info.dump(2) << "\n";
  }


  Job job_;
  PluginHost host_;
  ResolvedJob resolved_;
  Schedule schedule_;
  log::Level log_level_ = log::Level::info;
  std::unique_ptr<Comm> comm_;
  c10::Device device_{c10::kCPU};
  uint64_t seed_ = 0;
  TrainState state_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<UpdateRule> rule_;
  std::unique_ptr<StepDriver> driver_;
  bool grad_hooks_installed_ = false;
  int64_t param_count_ = 0, trainable_count_ = 0, trainable_bytes_ = 0;
  std::vector<Param> params_;
  std::map<const void*, ParamPlacement> placements_;  // place_param's, by tensor
  std::array<std::vector<Registered>, static_cast<size_t>(Event::teardown) + 1> handlers_;
  std::vector<GradHandler> grad_handlers_;
  std::vector<std::shared_ptr<nn::UnitInterceptor>> interceptors_;
  int current_position_ = std::numeric_limits<int>::max();
  size_t handler_count_ = 0;
  Batch batch_;
  Output output_;
  CheckpointData checkpoint_;
  std::unique_ptr<StepReport> report_;
  std::string output_dir_;
  std::unique_ptr<OutputDirClaim> claim_;  // rank 0: Note [One run per output_dir]
  bool setup_done_ = false;
  int stop_signal_ = 0;         // the ranks agreed to stop after this step (Note [Graceful stop])
  int64_t saved_step_ = -1;     // the step of the newest checkpoint this run wrote
  std::string saved_folder_;
};

void GradReadyHook::operator()(const torch::autograd::Variable&) {
  engine_->fire_grad_ready(index_);
}

}  // namespace

Trainer::~Trainer() = default;

std::unique_ptr<Trainer> make_trainer(Job job) {
  return std::make_unique<EngineImpl>(std::move(job));
}

std::unique_ptr<Trainer> Trainer::from_file(const std::filesystem::path& job,
                                            const std::vector<std::string>& overrides) {
  return make_trainer(with_auto_batch(Job::load(job, overrides)));
}

std::unique_ptr<Trainer> Trainer::from_text(const std::string& toml,
                                            const std::filesystem::path& dir,
                                            const std::vector<std::string>& overrides) {
  return make_trainer(with_auto_batch(Job::parse(toml, dir / "job.toml", overrides)));
}

namespace {

// The job a checkpoint records, its step, and its weights in fp32 by loom's names: consolidated
// (any world size or ZeRO stage) into a temporary file in `scratch_dir`, then read.
struct CheckpointModel {
  Job job;
  int64_t step = 0;
  NamedTensors weights;
};
CheckpointModel checkpoint_model(const std::filesystem::path& checkpoint,
                                 const std::filesystem::path& scratch_dir) {
  namespace fs = std::filesystem;
  const CheckpointContents info = read_checkpoint_info(checkpoint.string());
  LOOM_CHECK_AS(CheckpointError, !info.job_text.empty(), "checkpoint '",
                checkpoint.string(), "' does not record its job (written by an older loom); "
                "resume it for one step with this loom and use that checkpoint");
  Job job = Job::parse(info.job_text, fs::path(info.job_dir) / "job.toml (saved in the checkpoint)");
  const fs::path temp = scratch_dir / (".loom-weights-" + std::to_string(::getpid()) + ".safetensors");
  std::error_code ec;
  NamedTensors weights;
  try {
    consolidate_checkpoint_folder(checkpoint.string(), temp.string());
    weights = safetensors::load(temp).tensors;
  } catch (...) {
    fs::remove(temp, ec);
    throw;
  }
  fs::remove(temp, ec);
  return {std::move(job), info.step, std::move(weights)};
}

}  // namespace

void export_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& out_dir,
                       const ExportOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  LOOM_CHECK_AS(CheckpointError, !fs::exists(out_dir, ec) || (fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)),
                "'", out_dir.string(), "' exists and is not an empty folder; choose a new folder "
                "(an export never overwrites)");
  const fs::path parent = fs::absolute(out_dir).lexically_normal().parent_path();
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(parent, ec), "cannot export into '",
                out_dir.string(), "': its parent folder '", parent.string(), "' does not exist");
  auto [job, step, weights] = checkpoint_model(checkpoint, parent);
  EngineImpl engine(std::move(job));  // resolved and validated; nothing is built
  pretrained::write_folder(out_dir, engine.to_pretrained(std::move(weights), options.merge));
}

InferenceModel open_for_inference(const std::filesystem::path& path, const std::string& device) {
  namespace fs = std::filesystem;
  std::error_code ec;
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(path, ec), "'", path.string(),
                "' is not a folder; give a checkpoint folder (runs/x/checkpoint-300) or a run's "
                "output_dir (its newest checkpoint is used)");
  InferenceModel out;
  out.checkpoint = path.string();
  if (!fs::exists(path / "manifest.json", ec))
    if (std::string newest = latest_checkpoint(path.string()); !newest.empty())
      out.checkpoint = newest;
  auto [job, step, weights] = checkpoint_model(out.checkpoint, fs::temp_directory_path());
  out.step = step;
  // What the data was, for the prompt's encoding. Training's own tables go: the core's
  // [optimizer] and [distributed], and every table whose plugin does not shape the model
  // (Plugin::shapes_model: precision, ZeRO, DDP, checkpointing, preloading, a third party's EMA;
  // none changes a weight's meaning). The model, the tables that shape it (lora, moe) and
  // [data] (the model checks its sequence length against it; nothing reads the data) stay.
  out.data_source = "random_tokens";
  if (const ConfigValue* data = job.table("data"))
    if (const ConfigValue* source = data->find("source"))
      if (const auto* name = std::get_if<std::string>(&source->value)) out.data_source = *name;
  std::set<std::string> training_only = {"optimizer", "distributed"};
  {
    PluginHost host;
    for (auto* plugin : resolve(job, host).table_plugins)
      if (!plugin->plugin->shapes_model()) training_only.insert(plugin->name);
  }
  auto& tables = std::get<ConfigTable>(job.root.value);
  tables.erase(std::remove_if(tables.begin(), tables.end(),
                              [&](const auto& t) { return training_only.count(t.first) > 0; }),
               tables.end());
  auto engine = std::make_unique<EngineImpl>(std::move(job));
  out.model = engine->build_for_inference(weights, device,
                                          "checkpoint '" + out.checkpoint + "'");
  out.owner = std::move(engine);
  return out;
}

namespace {

// Every command of the loadable plugins, by name; a clash is a PluginError naming both.
std::map<std::string, std::pair<Command, std::string>> plugin_commands(PluginHost& host) {
  host.load_all();  // a plugin that does not load has no commands (`loom plugins` says why)
  std::map<std::string, std::pair<Command, std::string>> out;
  for (const auto& record : host.plugins()) {
    const std::string where = record->builtin() ? "the core" : record->file.string();
    for (auto& command : record->plugin->commands()) {
      LOOM_CHECK_AS(PluginError, !is_own_command(command.name), "plugin '", where,
                    "' adds the command '", command.name, "', which is one of loom's own; "
                    "rename it");
      auto [it, fresh] = out.emplace(command.name, std::make_pair(command, where));
      LOOM_CHECK_AS(PluginError, fresh, "two plugins add the command '", command.name, "': ",
                    it->second.second, " and ", where, "; remove one from the plugin search path");
    }
  }
  return out;
}

}  // namespace

bool is_own_command(const std::string& name) {
  static const std::set<std::string> own = {"run", "check", "estimate", "plugins", "env",
                                            "consolidate", "export", "generate"};
  return own.count(name) > 0;
}

std::vector<std::string> plugin_command_usages(const std::vector<std::filesystem::path>& extra_path) {
  PluginHost host;
  host.prepend_search_path(extra_path);
  std::vector<std::string> out;
  for (const auto& [name, command] : plugin_commands(host))
    out.push_back(command.first.usage + "  (plugin " + command.second + ")");
  return out;
}

std::optional<int> run_plugin_command(const std::string& name, const std::vector<std::string>& args,
                                      const std::vector<std::filesystem::path>& extra_path) {
  PluginHost host;
  host.prepend_search_path(extra_path);
  auto commands = plugin_commands(host);
  auto it = commands.find(name);
  if (it == commands.end()) return std::nullopt;
  return it->second.first.run(args);  // the host, and so the plugin, outlive the call
}

std::string describe_plugins(const std::vector<std::filesystem::path>& extra_path) {
  PluginHost host;
  host.prepend_search_path(extra_path);
  auto failures = host.load_all();
  std::ostringstream out;
  out << "plugin search path:";
  for (const auto& folder : host.search_path()) out << " " << folder.string();
  out << "\n";
  auto print_schema = [&](const Schema& schema) {
    out << "    [" << schema.table() << "]";
    if (!schema.provider().empty())
      out << " " << (schema.table() == "model"      ? "when [train] model = \""
                     : schema.table() == "data"     ? "when source = \""
                                                    : "when name = \"")
          << schema.provider() << "\"";
    out << "\n";
    for (const auto& key : schema.keys()) {
      out << "      " << key.name << " (" << to_string(key.type);
      if (key.required) out << ", required";
      else if (key.default_value) out << ", default " << key.default_value->to_text();
      out << "): " << key.doc << "\n";
    }
  };
  out << "\ncore tables\n";
  for (const auto& schema : core_schemas()) print_schema(schema);
  for (const auto& record : host.plugins()) {
    out << "\n" << record->name << " " << record->version << " — "
        << record->plugin->description() << "\n";
    out << "    file: " << (record->builtin() ? "(built into libloom_core)" : record->file.string())
        << "\n";
    auto slots = record->plugin->slots();
    for (const auto& schema : record->plugin->schemas())
      if (!schema.provider().empty())
        out << "    provides " << schema.table() << " '" << schema.provider() << "'\n";
    if (!slots.empty()) {
      out << "    fills slot(s):";
      for (Slot slot : slots) out << " " << to_string(slot);
      out << "\n";
    }
    for (const auto& schema : record->plugin->schemas()) print_schema(schema);
  }
  for (const auto& failure : failures) out << "\nFAILED TO LOAD: " << failure << "\n";
  return out.str();
}

}  // namespace loom
