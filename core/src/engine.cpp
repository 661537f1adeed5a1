// The engine: from a prepared job (Note [One resolved job], prepared_job.h) it builds the model,
// the data and the step driver with the active plugins, runs the training loop and fires the
// events in the order documented in loom/engine.h. It keeps the order of setup, the step and
// the event dispatch; each other concern is a unit it calls: the ranks, threads and device
// (run_placement.h), the batches and epochs (training_plan.h), the trainable parameters
// (trainable_params.h), grad_ready's hooks (grad_hooks.h), the step driver's choice and the
// update's checks (step_driver.h), evaluation and the best model (evaluation/training_evaluation.h), when and
// how checkpoints are written (run_saves.h) and what they hold (run_checkpoint.h), and what
// the run says and keeps in output_dir (run_output.h, step_report.h). The commands that only
// read a job or a checkpoint live in commands/.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <csignal>
#include <limits>
#include <utility>

#include "checkpoint_io.h"
#include "comm_backends.h"
#include "device.h"
#include "engine_factory.h"
#include "evaluation/training_evaluation.h"
#include "grad_hooks.h"
#include "half_matmul.h"
#include "loom/log.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/pretrained.h"
#include "loom/step_driver.h"
#include "loom/trainer.h"
#include "optimizer_in_backward.h"
#include "prepared_job.h"
#include "run_checkpoint.h"
#include "run_output.h"
#include "run_placement.h"
#include "run_saves.h"
#include "step_driver.h"
#include "step_sums.h"
#include "trainable_params.h"
#include "training_plan.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

struct Registered {
  int position;  // the plugin's place in the resolved order (Note [Plugin order])
  size_t order;
  Engine::Handler handler;
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
    comm_ = make_comm(CommOptions{});  // one process: the local backend
    log::configure(0, 1, false, log_level_);
    set_job_threads(train, 1);
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
    comm_ = connect_ranks(*prepared_);
    const RankPlacement placed = place_rank(*prepared_, *comm_);
    device_ = placed.device;
    seed_ = static_cast<uint64_t>(train.get_int("seed"));
    state_.max_steps = train.get_int("max_steps");
    state_.accumulation_steps = train.get_int("gradient_accumulation_steps");
    output_dir_ = resolve_path(train.get_string("output_dir"));
    if (train.get_bool("auto_find_batch_size") && comm_->world_size() > 1)
      check_same_batch_on_every_rank(train, state_.accumulation_steps, *comm_);
    log_run_start(*prepared_, *comm_, device_, placed.malloc_note);

    attach_plugins();

    // Data first, so setup handlers can wrap it (preloading).
    const SamplerOptions sampler = sampler_options(train, resolved_.section("data"), seed_,
                                                   comm_->rank(), comm_->world_size());
    std::shared_ptr<const Dataset> dataset = resolved_.data.provider->plugin->create_dataset(
        resolved_.data.name, resolved_.section("data"), *this);
    label_names_ = dataset->label_names();  // the checkpoint keeps the label map
    // Note [Evaluation]: the evaluation set, a share held out of [data] or [eval_data]'s own.
    evaluation_ = std::make_unique<TrainingEvaluation>(resolved_, *this, dataset, sampler.seed,
                                                       comm_->rank(), comm_->world_size());
    data_ = std::make_unique<SampledSource>(std::move(dataset), sampler);
    if (prepared_->steps_by_epochs())
      state_.max_steps =
          count_steps_by_epochs(*prepared_, data_->sampler(), state_.accumulation_steps);
    rule_ = prepared_->take_update_rule();  // Engine::update_rule, from the setup event on
    fire(Event::setup);

    build_model();
    for (auto* list : unit_lists()) list->set_interceptors(interceptors_);
    if (!interceptors_.empty() && unit_lists().empty())
      log::warn("unit interceptors were added (", interceptors_.front()->name(),
                "...) but model '", resolved_.model.name,
                "' has no loom::nn::UnitList: they have nothing to wrap");

    trainable_ = collect_trainable_params(*model_, resolved_.model.name, placements_,
                                          resolved_.section("optimizer"));
    driver_ = make_step_driver(resolved_, trainable_.params, *rule_, comm_.get(), *this);
    if (train.get_bool("optimizer_in_backward"))  // Note [Optimizer in backward]
      in_backward_ = std::make_unique<InBackwardUpdate>(trainable_.params, *driver_, state_,
                                                        final_grads_by_plugin_,
                                                        train.where("optimizer_in_backward"));
    install_grad_hooks();
    fire(Event::params_ready);
    if (in_backward_) {
      const LoadedPlugin* grad_sync = resolved_.table_plugin_in(Slot::grad_sync);
      in_backward_->check_sync(comm_->world_size(), grad_sync ? grad_sync->name : "");
    }

    OpenedOutputDir opened = open_output_dir(
        train, output_dir_, *comm_, device_, prepared_->reports_to_tensorboard(),
        [this](const std::string& path) { return resolve_path(path); });
    claim_ = std::move(opened.claim);
    report_ = std::move(opened.report);
    if (opened.resume_from.empty()) report_->start_fresh();
    else load_checkpoint(opened.resume_from);
    // Note [Asynchronous checkpoints] and [Best model]: the saves see the best evaluation.
    saves_ = std::make_unique<RunSaves>(
        train, output_dir_, *comm_, state_, evaluation_->best(),
        RunSaves::Sources{[this] { return run_parts(); }, [this]() -> CheckpointData& {
                            checkpoint_ = CheckpointData{};
                            fire(Event::save);
                            return checkpoint_;
                          }});
    const memory::ModelState held = model_state();
    if (comm_->rank() == 0)  // output_dir/run.json (run_output.h)
      write_run_info_file(output_dir_, {device_.str(), comm_->backend(), job_.hash(),
                                        resolved_.model.name, rule_->name(), at::get_num_threads(),
                                        comm_->world_size(), held});
    log_run_plan({resolved_.model.name, held, data_->describe(), sampler.batch_size,
                  state_.accumulation_steps, comm_->world_size(),
                  evaluation_->has_set() ? evaluation_->describe() : "", rule_->name(),
                  train.get_float("learning_rate"), schedule_.describe(),
                  train.get_float("max_grad_norm")});
    setup_done_ = true;
  }

  bool step() override {
    setup();
    if (state_.step >= state_.max_steps) return false;
    const auto start = Clock::now();
    const int64_t epoch_before = epoch_of_next_batch(*data_);
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
    Window window = draw_window(*data_, state_.accumulation_steps, *comm_);
    state_.window_targets = window.targets;
    LOOM_CHECK_AS(DataError, state_.window_targets > 0, "step ", state_.step + 1,
                  ": the accumulation window has no loss targets (every label is ",
                  kIgnoreIndex, ")");
    // Grad sync averages over ranks, so each rank scales by world / global targets.
    const double normaliser =
        static_cast<double>(comm_->world_size()) / static_cast<double>(state_.window_targets);

    StepSums sums(device_);  // the window's summed loss stays on the device until its read
    bool any_aux = false;
    for (int64_t k = 0; k < state_.accumulation_steps; ++k) {
      state_.micro_step = k;
      state_.sync_grads = state_.is_last_micro_step();
      place_batch(window.batches[k]);
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
        sums.add_aux(output_.aux_loss);
        any_aux = true;
      }
      if (state_.loss_scale != 1.0) {
        loss = loss * state_.loss_scale;
        state_.grads_scaled = true;
      }
      nn::detail::set_aux_loss_grad_scale(state_.loss_scale / accumulation);
      if (in_backward_) in_backward_->before_backward();  // Note [Optimizer in backward]
      loss.backward();
      sums.add_loss(output_.loss_sum);
      fire(Event::after_backward);
      output_.logits = at::Tensor();  // see Engine::output()
    }
    // The step's one host read. On several ranks it gives the window's loss over all ranks'
    // targets, whether any rank was signalled (the ranks agree to stop after this step) and
    // whether any rank's checkpoint writer is still busy.
    const int signal = stop_requested();
    const bool saving_in_flight = saves_->in_flight();
    const StepSums::Read read = sums.read(signal != 0, saves_->writer_busy(), *comm_);
    state_.loss = read.loss_sum / static_cast<double>(state_.window_targets);
    if (read.stop) stop_signal_ = signal != 0 ? signal : SIGTERM;
    // Every rank's writer is done: the save commits at this step's end.
    const bool saves_written = saving_in_flight && !read.writer_busy;
    if (any_aux)  // the mean over the window's micro-batches and the ranks
      state_.metrics.emplace_back(
          "aux_loss",
          read.aux_sum / static_cast<double>(state_.accumulation_steps * comm_->world_size()));

    // Note [Optimizer in backward]: the parameters are updated already; this is their norm.
    const at::Tensor in_backward_norm = in_backward_ ? in_backward_->finish_backward() : at::Tensor();
    fire(Event::before_update);
    update_step(*driver_, state_, in_backward_norm,
                resolved_.section("train").get_float("max_grad_norm"));
    nn::detail::release_widened_blocks();  // Note [Widened blocks kept]: they live for a step
    ++state_.step;
    fire(Event::after_update);

    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    report_->report(state_, seconds, window.samples, window.tokens);
    fire(Event::step_end);
    if (evaluation_->due(state_.step, *data_, epoch_before))
      evaluation_->observe(state_.step, evaluate());
    // Note [Asynchronous checkpoints]: a background save commits at the first step end after
    // every rank's writer is done.
    saves_->step_end(saves_written);
    return true;
  }

  RunSummary run() override {
    RunSummary summary;
    try {
      setup();
      const auto start = Clock::now();
      const int64_t first = state_.step;
      if (evaluation_->on_start()) evaluate();
      while (!stop_signal_ && !evaluation_->stopped_early() && step()) {
      }
      saves_->finish();
      if (report_) report_->end_progress();
      if (stop_signal_) {
        log::warn("stopped by ", stop_signal_ == SIGINT ? "SIGINT" : "SIGTERM", " after step ",
                  state_.step, " of ", state_.max_steps);
        summary.stopped_by_signal = stop_signal_;
      }
      summary.last_checkpoint = saves_->final_checkpoint(stop_signal_ != 0, first);
      log_run_end(state_, first, std::chrono::duration<double>(Clock::now() - start).count(),
                  device_);
      summary.steps = state_.step;
      summary.final_loss = state_.loss;
      const std::string best = evaluation_->report_best(output_dir_, state_.step, summary);
      if (!best.empty()) load_checkpoint(best);  // Note [Best model]: load_best_model_at_end
      fire(Event::teardown);
    } catch (...) {
      if (report_) report_->end_progress();
      if (saves_) saves_->abandon();  // Note [Asynchronous checkpoints]
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
    return saves_->save();
  }

  // Note [Evaluation] (evaluation/evaluator.h).
  std::vector<std::pair<std::string, double>> evaluate() override {
    // Said before anything is built (a checkpoint read).
    LOOM_CHECK_AS(ConfigError, prepared_->has_evaluation_set(),
                  "this job has no evaluation set: add an [eval_data] table (any data source) or "
                  "[data] validation_split");
    setup();
    const Evaluator::Metrics metrics = evaluation_->run(
        *model_, state_,
        [this](const Batch& host) {
          place_batch(host);
          fire(Event::before_forward);
          nn::detail::reset_aux_losses();
          output_ = model_->forward(batch_);
          fire(Event::after_forward);
          return std::exchange(output_, Output{});
        },
        comm_.get());
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
    LOOM_CHECK(model && trainable_.params.empty(), "set_model only in model_built, with a model");
    model_ = std::move(model);
  }
  void place_param(const at::Tensor& param, ParamPlacement placement) override {
    LOOM_CHECK(trainable_.params.empty(), "place_param only in model_built, before params_ready");
    check_placement(param, placement);
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
  const std::vector<Param>& params() const override { return trainable_.params; }
  Batch& batch() override { return batch_; }
  Output& output() override { return output_; }
  CheckpointData& checkpoint() override { return checkpoint_; }
  const UpdateRule& update_rule() const override {
    LOOM_CHECK(rule_, "the update rule exists from the setup event on");
    return *rule_;
  }
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
    const Param& param = trainable_.params[index];
    for (auto& handler : grad_handlers_) handler(*this, param);
    // Last, after every plugin's handler saw the gradient (Note [Optimizer in backward]).
    if (in_backward_) in_backward_->grad_ready(param);
  }

 private:
  void fire(Event event) {
    for (auto& registered : handlers_[static_cast<size_t>(event)]) registered.handler(*this);
  }

  // A host batch onto the device, as batch_. Page-locked host memory lets the copy run
  // asynchronously to the compute stream.
  void place_batch(const Batch& host) {
    batch_ = device_.is_cuda() ? host.pinned().to(device_, /*non_blocking=*/true)
                               : host.to(device_);
  }

  // grad_ready hooks go on every trainable parameter once, when the first handler arrives at
  // or after the parameters are collected (a handler registered in params_ready fires like an
  // earlier one).
  void install_grad_hooks() {
    if ((grad_handlers_.empty() && !in_backward_) || grad_hooks_installed_ ||
        trainable_.params.empty())
      return;
    install_grad_ready_hooks(trainable_.params, [this](size_t index) { fire_grad_ready(index); });
    grad_hooks_installed_ = true;
  }

  memory::ModelState model_state() const override {
    LOOM_CHECK(driver_, "the model state is known from params_ready on");
    // Note [Optimizer in backward]: no gradient held from backward to the update (but
    // accumulated ones).
    return model_state_of(*model_, trainable_, *driver_,
                          in_backward_ && state_.accumulation_steps == 1);
  }

  void load_checkpoint(const std::string& folder) {
    DataPosition at;
    checkpoint_ = resume_run(run_parts(), folder, at);
    evaluation_->best().load(checkpoint_.values);
    fire(Event::load);
    log::info("resumed from ", folder, " at step ", state_.step, " (epoch ", at.epoch,
              ", sample ", at.cursor, ")");
  }

  RunParts run_parts() {
    return RunParts{*model_, resolved_.model.name, *driver_, *data_, state_, *comm_,
                    device_, seed_, job_.hash(), rule_->name(), job_.canonical_text(),
                    job_.dir.string(), label_names_};
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
  TrainableParams trainable_;  // from params_ready on (Engine::params)
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
  std::unique_ptr<TrainingEvaluation> evaluation_;  // Note [Evaluation], Note [Best model]
  std::vector<std::string> label_names_;  // the training data's label map (Dataset::label_names)
  std::string output_dir_;
  std::unique_ptr<OutputDirClaim> claim_;  // rank 0: Note [One run per output_dir]
  bool setup_done_ = false;
  int stop_signal_ = 0;  // the ranks agreed to stop after this step (Note [Graceful stop])
  // Note [Asynchronous checkpoints]; after comm_ and evaluation_: it goes first.
  std::unique_ptr<RunSaves> saves_;
};

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
