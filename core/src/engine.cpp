// The engine: from a prepared job (Note [One resolved job], prepared_job.h) it builds the model,
// the data and the step driver with the active plugins, runs the training loop, fires the
// events in the order documented in loom/engine.h, and writes metrics and checkpoints. The
// commands that only read a job or a checkpoint (export, generate, plugins, estimate) live in
// commands/.
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
#include <limits>
#include <set>
#include <sstream>
#include <thread>

#include "async_checkpoint.h"
#include "checkpoint_io.h"
#include "comm_backends.h"
#include "evaluation/best_model.h"
#include "evaluation/evaluator.h"
#include "run_checkpoint.h"
#include "device.h"
#include "dist_env.h"
#include "engine_factory.h"
#include "job.h"
#include "optimizer_in_backward.h"
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
#include "prepared_job.h"
#include "resolve.h"
#include "run_output.h"
#include "schedule.h"
#include "step_report.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

std::string join_names(const std::vector<std::string>& names) {
  if (names.empty()) return "integer ids";
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

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
  // Note [One resolved job]: the job arrives resolved, configured, validated and with its
  // update rule built (prepared_job.h); the engine only builds and runs.
  explicit EngineImpl(std::unique_ptr<PreparedJob> prepared)
      : prepared_(std::move(prepared)),
        job_(prepared_->job()),
        resolved_(prepared_->resolved()),
        schedule_(prepared_->schedule()),
        log_level_(prepared_->log_level()) {}

  ~EngineImpl() override {
    // Plugins' handlers may hold plugin code; drop them before the host destroys plugins.
    for (auto& list : handlers_) list.clear();
    grad_handlers_.clear();
    interceptors_.clear();
  }

  // `loom generate`: see build_for_inference in engine.h. Nothing else is built.
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
  std::string describe() const override { return prepared_->describe(); }

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
    CommChecks comm_checks;  // Note [Hang reports]
    comm_checks.check_collectives = resolved_.section("distributed").get_bool("check_collectives");
    comm_checks.trace_folder = resolve_path(train.get_string("output_dir"));
    comm_ = make_comm(comm_options, comm_checks);
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
    if (prepared_->data_parallel_by_default())  // Note [Data parallelism by default]
      log::info("data parallelism by default: ", comm_->world_size(), " ranks and no [ddp] or "
                "[zero] table, so [ddp] with its defaults (a [ddp] or [zero] table chooses)");
    // Several ranks need something that keeps their replicas in step (a world size the
    // launcher's environment did not say, e.g. [distributed] backend = "local" under mpirun).
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
    // Where the rendezvous (gloo, nccl) met, when loom derived the address or port from
    // Slurm's variables rather than being told.
    if (comm_->backend() == "gloo" || comm_->backend() == "nccl") {
      const std::string derived = describe_derived_rendezvous(detect_dist_env());
      if (!derived.empty()) log::info(derived);
    }
    log::info("job ", job_.file.string(), " (config hash ", job_.hash(), ")");
    for (const auto& note : job_.notes) log::info("job: ", note);
    for (const auto& warning : job_.warnings) log::warn("job: ", warning);
    // The code this run loads, by the real file of each plugin (a link named with its target).
    for (const auto& plugin : prepared_->host().plugins())
      if (!plugin->builtin())
        log::info("plugin ", plugin->name, " ", plugin->version, " from ", plugin->file_label());
    log::info("cpu ", cpu::read_cpu_info().model, " | oneDNN isa ", cpu::isa_in_effect().summary());
    if (!malloc_note.empty()) log::info(malloc_note);  // Note [Freed memory kept]

    attach_plugins();

    // Data first, so setup handlers can wrap it (preloading).
    SamplerOptions sampler;
    sampler.batch_size = train.get_int("per_device_train_batch_size");
    sampler.shuffle = resolved_.section("data").get_bool("shuffle");
    sampler.drop_last = resolved_.section("data").get_bool("drop_last");
    // [train] data_seed (the Trainer's): the data order's own seed; -1 = seed.
    const int64_t data_seed = train.get_int("data_seed");
    sampler.seed = data_seed >= 0 ? static_cast<uint64_t>(data_seed) : seed_;
    sampler.rank = comm_->rank();
    sampler.world_size = comm_->world_size();
    std::shared_ptr<const Dataset> dataset = resolved_.data.provider->plugin->create_dataset(
        resolved_.data.name, resolved_.section("data"), *this);
    label_names_ = dataset->label_names();  // the checkpoint keeps the label map
    // Note [Evaluation]: the evaluation set, a share held out of [data] or [eval_data]'s own.
    std::shared_ptr<const Dataset> eval_set;
    if (const double split = resolved_.section("data").get_float("validation_split"); split > 0) {
      SplitDatasets parts = split_for_validation(std::move(dataset), split, sampler.seed);
      dataset = std::move(parts.train);
      eval_set = std::move(parts.eval);
    } else if (resolved_.eval_data.provider) {
      eval_set = resolved_.eval_data.provider->plugin->create_dataset(
          resolved_.eval_data.name, resolved_.section("eval_data"), *this);
    }
    if (eval_set && eval_set->label_names() != label_names_)
      throw ConfigError(detail::cat(
          "[eval_data]'s label map (", join_names(eval_set->label_names()),
          ") differs from [data]'s (", join_names(label_names_), "): the ids would mean other "
          "classes; set the same label_names = [...] in both tables"));
    if (eval_set)
      evaluator_ = std::make_unique<Evaluator>(
          std::move(eval_set),
          Evaluator::Options{train.get_int("per_device_eval_batch_size"), comm_->rank(),
                             comm_->world_size()});
    best_ = BestModel(BestModel::options_from(train));  // Note [Best model]
    if (best_.tracking() && evaluator_) {
      // The metrics a classifier's evaluation gives differ from a language model's: said now,
      // not at the first evaluation.
      const std::string& metric = best_.options().metric;
      const bool classifies = evaluator_->classifies();
      const bool needs_classes = metric == "eval_accuracy" || metric == "eval_f1";
      LOOM_CHECK_AS(ConfigError, !(metric == "eval_perplexity" && classifies),
                    train.where("metric_for_best_model"), ": [train] metric_for_best_model '",
                    metric, "' is never computed: the evaluation set holds classification labels "
                    "(eval_loss, eval_accuracy, eval_f1)");
      LOOM_CHECK_AS(ConfigError, !needs_classes || classifies, train.where("metric_for_best_model"),
                    ": [train] metric_for_best_model '", metric, "' is never computed: the "
                    "evaluation set holds next-token labels (eval_loss, eval_perplexity)");
    }
    data_ = std::make_unique<SampledSource>(std::move(dataset), sampler);
    if (prepared_->steps_by_epochs()) count_steps_by_epochs();
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
    rule_ = prepared_->take_update_rule();
    StepDriverOptions driver_options;
    driver_options.params = params_;
    driver_options.rule = rule_.get();
    driver_options.weight_decay = weight_decay;
    driver_options.comm = comm_.get();
    driver_ = make_driver(driver_options);
    if (train.get_bool("optimizer_in_backward"))  // Note [Optimizer in backward]
      in_backward_ = std::make_unique<InBackwardUpdate>(
          params_, *driver_, state_, final_grads_by_plugin_, train.where("optimizer_in_backward"));
    install_grad_hooks();
    fire(Event::params_ready);
    if (in_backward_) in_backward_->check_sync(comm_->world_size(), grad_sync_plugin());

    prepare_output_dir(train);
    // Note [Asynchronous checkpoints].
    if (train.get_bool("async_save"))
      async_saves_ = std::make_unique<AsyncCheckpointer>(output_dir_, *comm_);
    log::info("model ", resolved_.model.name, ": ", model_state().describe());
    write_run_info();
    log::info("data ", data_->describe(), "; ", sampler.batch_size, " samples x ",
              state_.accumulation_steps, " micro-batches x ", comm_->world_size(),
              " rank(s) = ", sampler.batch_size * state_.accumulation_steps * comm_->world_size(),
              " samples per step");
    if (evaluator_)
      log::info("eval data ", evaluator_->describe(), "; ", eval_when(train));
    log::info("optimizer ", rule_->name(), ", lr ", train.get_float("learning_rate"), " (",
              schedule_.describe(), "), max_grad_norm ", train.get_float("max_grad_norm"));
    setup_done_ = true;
  }

  bool step() override {
    setup();
    if (state_.step >= state_.max_steps) return false;
    const auto start = Clock::now();
    const auto& train = resolved_.section("train");
    const int64_t epoch_before = epoch_of_next_batch();
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
    // Element 3 counts the ranks whose checkpoint writer is still busy (Note [Asynchronous
    // checkpoints]).
    at::Tensor loss_total = at::zeros({4}, at::TensorOptions().dtype(at::kDouble).device(device_));
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
    const bool saving_in_flight = async_saves_ && async_saves_->in_flight();
    const bool writer_busy = saving_in_flight && !async_saves_->written_here();
    bool saves_written = false;  // every rank's writer is done: the save commits at step end
    at::Tensor host;  // the step's one host read of the loss
    if (comm_->world_size() > 1) {
      // The reported loss is the window's mean over all ranks' targets; and the ranks agree
      // whether to stop after this step (one of them was signalled).
      loss_total.narrow(0, 1, 1).fill_(signal != 0 ? 1.0 : 0.0);
      loss_total.narrow(0, 3, 1).fill_(writer_busy ? 1.0 : 0.0);
      loss_total = loss_total.to(comm_->device());
      comm_->all_reduce(loss_total, ReduceOp::sum)->wait();
      host = loss_total.cpu();
      state_.loss = host[0].item<double>() / static_cast<double>(state_.window_targets);
      if (host[1].item<double>() > 0) stop_signal_ = signal != 0 ? signal : SIGTERM;
      saves_written = saving_in_flight && host[3].item<double>() == 0;
    } else {
      host = loss_total.cpu();
      state_.loss = host[0].item<double>() /
                    static_cast<double>(std::max<int64_t>(1, local_targets));
      stop_signal_ = signal;
      saves_written = saving_in_flight && !writer_busy;
    }
    if (any_aux)  // the mean over the window's micro-batches and the ranks
      state_.metrics.emplace_back(
          "aux_loss", host[2].item<double>() /
                          static_cast<double>(state_.accumulation_steps * comm_->world_size()));

    // Note [Optimizer in backward]: the parameters are updated already; this is their norm.
    const at::Tensor in_backward_norm = in_backward_ ? in_backward_->finish_backward() : at::Tensor();
    fire(Event::before_update);
    if (state_.skip_update) {
      LOOM_CHECK(!in_backward_, "step ", state_.step + 1, ": a plugin asked to skip this update "
                 "in before_update, but [train] optimizer_in_backward applied it during "
                 "backward; turn optimizer_in_backward off for this job");
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
      state_.grad_norm = std::sqrt(
          (in_backward_ ? in_backward_norm : driver_->grad_norm_squared()).item<double>());
      LOOM_CHECK(std::isfinite(state_.grad_norm), "step ", state_.step + 1,
                 ": the gradient norm is ", state_.grad_norm, " (loss ", state_.loss,
                 "): training diverged; lower [train] learning_rate, or use [precision] with "
                 "loss scaling for fp16");
      const double max_norm = train.get_float("max_grad_norm");
      if (max_norm > 0) {
        const double coefficient = max_norm / (state_.grad_norm + 1e-6);
        if (coefficient < 1.0) driver_->scale_grads(coefficient);
      }
      if (!in_backward_) driver_->update(state_.step + 1, state_.lr);
    }
    ++state_.step;
    fire(Event::after_update);

    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    report_->report(state_, seconds, samples, tokens);
    fire(Event::step_end);
    if (evaluation_due(train, epoch_before)) {
      best_.observe(state_.step, evaluate());
      if (best_.should_stop() && !early_stopped_) {
        early_stopped_ = true;
        log::info("early stopping after step ", state_.step, ": ", best_.options().metric,
                  " has not improved by more than ", best_.options().threshold, " in ",
                  best_.patience_count(), " evaluations (best ", best_.best_value(), " at step ",
                  best_.best_step(), ")");
      }
    }
    if (saves_written) finish_async_save();
    const int64_t every = train.get_int("save_steps");
    // Note [Asynchronous checkpoints]: the host buffers made while training goes on, once the
    // first update has made the optimizer state (the first save's pause is then a copy).
    if (async_saves_ && every > 0 && !async_saves_->prepared())
      async_saves_->prepare(checkpoint_contents(run_parts(), CheckpointData{}));
    if (every > 0 && state_.step % every == 0 && state_.step < state_.max_steps) {
      if (async_saves_) start_async_save();
      else save_checkpoint();
    }
    return true;
  }

  // Note [Asynchronous checkpoints]: the host copy and the writer started; at most one in flight.
  void start_async_save() {
    if (async_saves_->in_flight()) {
      if (!said_save_wait_)
        log::warn("step ", state_.step, ": checkpoint-", async_saves_->step(),
                  " is still being written in the background; training waits for it (one "
                  "asynchronous save at a time: raise [train] save_steps, or write to faster "
                  "storage). Said once per run");
      said_save_wait_ = true;
      finish_async_save();
    }
    checkpoint_ = CheckpointData{};
    fire(Event::save);
    best_.saving(state_.step);  // Note [Best model]: this one may hold the best evaluation
    best_.save(checkpoint_.values);
    async_saves_->start(checkpoint_contents(run_parts(), checkpoint_),
                        resolved_.section("train").get_int("save_total_limit"),
                        best_.best_checkpoint_step());
    log::debug("checkpoint-", state_.step, ": copied in ", async_saves_->copy_seconds(),
               " s, being written in the background");
  }

  // Every rank together: waits for the in-flight save, commits it (rotation after).
  void finish_async_save() {
    if (!async_saves_ || !async_saves_->in_flight()) return;
    const int64_t step = async_saves_->step();
    const std::string folder = async_saves_->finish();
    const AsyncCheckpointer& saves = *async_saves_;
    log::info("saved checkpoint ", folder, " (in the background: written in ",
              saves.write_seconds(), " s; training paused ",
              saves.copy_seconds() + saves.commit_seconds(), " s for it: ", saves.copy_seconds(),
              " s copying, ", saves.commit_seconds(), " s committing",
              saves.wait_seconds() > 0.001
                  ? detail::cat("; and ", saves.wait_seconds(), " s waiting for the writer")
                  : std::string(),
              ")");
    saved_step_ = step;
    saved_folder_ = folder;
  }

  RunSummary run() override {
    RunSummary summary;
    try {
      setup();
      const auto start = Clock::now();
      const int64_t first = state_.step;
      if (evaluator_ && resolved_.section("train").get_bool("eval_on_start")) evaluate();
      while (!stop_signal_ && !early_stopped_ && step()) {
      }
      finish_async_save();
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
      summary.steps = state_.step;
      summary.final_loss = state_.loss;
      if (best_.best_checkpoint_step() >= 0) {
        summary.best_checkpoint =
            output_dir_ + "/checkpoint-" + std::to_string(best_.best_checkpoint_step());
        summary.best_metric = best_.best_value();
        log::info("best checkpoint ", summary.best_checkpoint, " (", best_.options().metric, " ",
                  best_.best_value(), " at step ", best_.best_step(), ")");
        // Note [Best model]: the run ends holding the best checkpoint's state, as if resumed
        // from it.
        if (best_.options().load_at_end && best_.best_checkpoint_step() != state_.step) {
          log::info("load_best_model_at_end: loading ", summary.best_checkpoint);
          load_checkpoint(summary.best_checkpoint);
        }
      }
      fire(Event::teardown);
    } catch (...) {
      if (report_) report_->end_progress();
      if (async_saves_) async_saves_->abandon();  // Note [Asynchronous checkpoints]
      try {
        if (setup_done_) fire(Event::teardown);
      } catch (const std::exception& error) {
        log::warn("teardown after an error failed too: ", error.what());
      }
      throw;
    }
    summary.output_dir = output_dir_;
    summary.peak_memory_bytes = memory::device_stats(device_).peak_bytes;
    return summary;
  }

  std::string save_checkpoint() override {
    setup();
    finish_async_save();  // Note [Asynchronous checkpoints]: one save at a time, in order
    const auto start = Clock::now();
    checkpoint_ = CheckpointData{};
    fire(Event::save);
    best_.saving(state_.step);  // Note [Best model]: this one may hold the best evaluation
    best_.save(checkpoint_.values);
    const CheckpointContents contents = checkpoint_contents(run_parts(), checkpoint_);
    // Every rank takes part: sharded optimizer state is written by the ranks that hold it.
    const std::string folder =
        write_checkpoint(output_dir_, contents,
                         resolved_.section("train").get_int("save_total_limit"), *comm_,
                         best_.best_checkpoint_step());
    log::info("saved checkpoint ", folder, " (training paused ",
              std::chrono::duration<double>(Clock::now() - start).count(), " s for it)");
    saved_step_ = state_.step;
    saved_folder_ = folder;
    return folder;
  }

  // Note [Evaluation] (evaluation/evaluator.h).
  std::vector<std::pair<std::string, double>> evaluate() override {
    // Said before anything is built (a checkpoint read).
    LOOM_CHECK_AS(ConfigError, prepared_->has_evaluation_set(),
                  "this job has no evaluation set: add an [eval_data] table (any data source) or "
                  "[data] validation_split");
    setup();
    Evaluator::Metrics metrics;
    {
      // Back to training however the evaluation ends.
      struct TrainAgain {
        EngineImpl& engine;
        ~TrainAgain() {
          engine.state_.evaluating = false;
          engine.model_->train();
        }
      } train_again{*this};
      state_.evaluating = true;
      model_->eval();
      at::NoGradGuard no_grad;
      metrics = evaluator_->run(
          [this](const Batch& host) {
            batch_ = device_.is_cuda() ? host.pinned().to(device_, /*non_blocking=*/true)
                                       : host.to(device_);
            fire(Event::before_forward);
            nn::detail::reset_aux_losses();
            output_ = model_->forward(batch_);
            fire(Event::after_forward);
            Output out = std::move(output_);
            output_ = Output{};
            return out;
          },
          comm_.get());
    }
    state_.eval_metrics = metrics;
    report_->report_eval(state_.step, metrics);
    fire(Event::evaluate);
    return metrics;
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
    return prepared_->resolve_path(path);
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

  void grad_final(const at::Tensor& param, const at::Tensor& grad) override {
    LOOM_CHECK(in_backward_, "grad_final hands a gradient to [train] optimizer_in_backward, "
               "which this job does not set");
    in_backward_->grad_final(param, grad);
  }
  void will_hand_final_grads() override {
    final_grads_by_plugin_ = true;
    if (in_backward_) in_backward_->plugin_hands_final_grads();
  }

  void fire_grad_ready(size_t index) {
    for (auto& handler : grad_handlers_) handler(*this, params_[index]);
    // Last, after every plugin's handler saw the gradient (Note [Optimizer in backward]).
    if (in_backward_) in_backward_->grad_ready(params_[index]);
  }

 private:
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

  // eval_strategy's moments: every evaluation_interval steps, or the step that took an epoch's
  // last batch.
  std::string eval_when(const ConfigSection& train) const {
    const std::string strategy = train.get_string("eval_strategy");
    std::string when = strategy == "steps"   ? detail::cat("every ", evaluation_interval(train), " steps")
                       : strategy == "epoch" ? std::string("at the end of every epoch")
                                             : std::string("never during training");
    if (train.get_bool("eval_on_start")) when += ", and before the first step";
    return "evaluated " + when;
  }
  bool evaluation_due(const ConfigSection& train, int64_t epoch_before) const {
    if (!evaluator_) return false;
    const std::string strategy = train.get_string("eval_strategy");
    if (strategy == "steps") return state_.step % evaluation_interval(train) == 0;
    return strategy == "epoch" && epoch_of_next_batch() > epoch_before;
  }
  // The data position is of the next batch, and an epoch whose last batch was taken rolls over
  // only when the next is drawn: {e, end of e} is the start of e + 1.
  int64_t epoch_of_next_batch() const {
    const DataPosition next = data_->position();
    const Sampler& sampler = data_->sampler();
    const int64_t per_rank = sampler.samples_per_rank(), batch = sampler.options().batch_size;
    const bool finished = next.cursor >= per_rank ||
                          (sampler.options().drop_last && next.cursor + batch > per_rank);
    return finished ? next.epoch + 1 : next.epoch;
  }

  std::string grad_sync_plugin() const {
    for (auto* plugin : resolved_.table_plugins)
      for (Slot slot : plugin->plugin->slots())
        if (slot == Slot::grad_sync) return plugin->name;
    return "";
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
    if ((grad_handlers_.empty() && !in_backward_) || grad_hooks_installed_ || params_.empty())
      return;
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
    // Note [Optimizer in backward]: none held from backward to the update (but accumulated ones).
    if (in_backward_ && state_.accumulation_steps == 1) s.grad_bytes = 0;
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
    const std::string folder = resume_folder(
        train, output_dir_, [this](const std::string& p) { return resolve_path(p); });
    StepReport::Options report;
    report.metrics_path = output_dir_ + "/metrics.jsonl";
    report.rank = comm_->rank();
    report.world_size = comm_->world_size();
    report.progress_bar = train.get_bool("progress_bar");
    report.logging_steps = train.get_int("logging_steps");
    report.logging_first_step = train.get_bool("logging_first_step");
    if (prepared_->reports_to_tensorboard())
      report.tensorboard_dir = train.get_string("logging_dir").empty()
                                   ? output_dir_ + "/runs"
                                   : resolve_path(train.get_string("logging_dir"));
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
    best_.load(checkpoint_.values);
    fire(Event::load);
    log::info("resumed from ", folder, " at step ", state_.step, " (epoch ",
              read.contents.data.epoch, ", sample ", read.contents.data.cursor, ")");
  }

  // [train] num_train_epochs, as the Trainer counts: optimizer steps per epoch = the rank's
  // batches per epoch // gradient_accumulation_steps (at least 1), and max_steps = ceil(epochs
  // x that); the schedule (warm-up ratio, decay) spans them.
  void count_steps_by_epochs() {
    const auto& train = resolved_.section("train");
    const double epochs = train.get_float("num_train_epochs");
    const int64_t per_epoch =
        std::max<int64_t>(1, data_->sampler().batches_per_epoch() / state_.accumulation_steps);
    state_.max_steps = static_cast<int64_t>(std::ceil(epochs * static_cast<double>(per_epoch)));
    prepared_->set_total_steps(state_.max_steps);
    log::info("num_train_epochs ", epochs, " x ", per_epoch, " optimizer steps per epoch = ",
              state_.max_steps, " steps");
  }

  RunParts run_parts() {
    return RunParts{*model_, resolved_.model.name, *driver_, *data_, state_, *comm_,
                    device_, seed_, job_.hash(), rule_->name(), job_.canonical_text(),
                    job_.dir.string(), label_names_};
  }

  // output_dir/run.json (run_output.h).
  void write_run_info() const {
    if (comm_->rank() != 0) return;
    write_run_info_file(output_dir_, {device_.str(), comm_->backend(), job_.hash(),
                                      resolved_.model.name, rule_->name(), at::get_num_threads(),
                                      comm_->world_size(), model_state()});
  }

  std::unique_ptr<PreparedJob> prepared_;
  const Job& job_;
  const ResolvedJob& resolved_;
  const Schedule& schedule_;
  log::Level log_level_;
  std::unique_ptr<Comm> comm_;
  c10::Device device_{c10::kCPU};
  uint64_t seed_ = 0;
  TrainState state_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<UpdateRule> rule_;
  std::unique_ptr<StepDriver> driver_;
  std::unique_ptr<InBackwardUpdate> in_backward_;  // [train] optimizer_in_backward only
  bool final_grads_by_plugin_ = false;              // Engine::will_hand_final_grads
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
  std::unique_ptr<Evaluator> evaluator_;  // null: no evaluation set
  std::vector<std::string> label_names_;  // the training data's label map (Dataset::label_names)
  BestModel best_;                        // Note [Best model]
  bool early_stopped_ = false;
  std::string output_dir_;
  std::unique_ptr<OutputDirClaim> claim_;  // rank 0: Note [One run per output_dir]
  bool setup_done_ = false;
  int stop_signal_ = 0;         // the ranks agreed to stop after this step (Note [Graceful stop])
  int64_t saved_step_ = -1;     // the step of the newest checkpoint this run wrote
  std::string saved_folder_;
  // [train] async_save (Note [Asynchronous checkpoints]); after comm_: it goes first.
  std::unique_ptr<AsyncCheckpointer> async_saves_;
  bool said_save_wait_ = false;  // the "training waits for the previous save" line, once
};

void GradReadyHook::operator()(const torch::autograd::Variable&) {
  engine_->fire_grad_ready(index_);
}

}  // namespace

Trainer::~Trainer() = default;

std::unique_ptr<Trainer> make_trainer(std::unique_ptr<PreparedJob> job) {
  return std::make_unique<EngineImpl>(std::move(job));
}

std::unique_ptr<Trainer> make_trainer(Job job) {
  return make_trainer(std::make_unique<PreparedJob>(std::move(job)));
}

InferenceBuild build_for_inference(std::unique_ptr<PreparedJob> job, const NamedTensors& weights,
                                   const std::string& device, const std::string& source) {
  auto engine = std::make_unique<EngineImpl>(std::move(job));
  Model* model = engine->build_for_inference(weights, device, source);
  return {std::move(engine), model};
}

}  // namespace loom
