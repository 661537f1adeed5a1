// The `zero` plugin: ZeRO data parallelism (Rajbhandari et al. 2020) in the grad_sync and
// step_driver slots. [zero] stage = 0 is plain data parallelism on sharding's gradient buckets
// (what [ddp] does); 1 shards the optimizer state and fp32 masters; 2 also the gradients; 3
// also the weights of the model's units (sharding/zero_driver.h), gathered around each unit by
// a unit interceptor. Every replica starts from rank 0's weights and buffers.
#include <ATen/ATen.h>

#include <malloc.h>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/log.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/offload/offloaded_driver.h"
#include "loom/plugin.h"
#include "loom/sharding/grad_buckets.h"
#include "loom/sharding/sharded_init.h"
#include "loom/sharding/zero_driver.h"
#include "loom/step_driver.h"
#include "zero_memory.h"

namespace {

// Stage 3: a unit's weights whole for its forward, released after; gathered again when backward
// reaches the unit's output (the driver releases them once its gradients are bucketed). Added
// last, so it is the innermost interceptor: activation checkpointing's recompute runs through
// it and gathers again.
class GatherUnits final : public loom::nn::UnitInterceptor {
 public:
  explicit GatherUnits(loom::sharding::ZeroDriver* driver) : driver_(driver) {}
  std::string name() const override { return "zero-3"; }
  at::Tensor intercept(int64_t, loom::nn::Unit& unit, const at::Tensor& x,
                       const loom::nn::UnitFn& next) override {
    if (!driver_->shards_unit(&unit)) return next(x);
    driver_->gather_unit(&unit, /*forward=*/true);
    at::Tensor y = next(x);
    if (at::GradMode::is_enabled() && y.requires_grad()) {
      auto* driver = driver_;
      const void* key = &unit;
      y.register_hook([driver, key](const at::Tensor&) { driver->gather_unit(key, false); });
    }
    driver_->release_unit(&unit);
    return y;
  }

 private:
  loom::sharding::ZeroDriver* driver_;
};

// Forwards reads; reports nothing unread, so the driver it is given to leaves the leftover
// check to the caller.
class UncheckedReader final : public loom::StateReader {
 public:
  explicit UncheckedReader(loom::StateReader& inner) : inner_(inner) {}
  void read(const std::string& name, const std::vector<int64_t>& global_shape, int64_t offset,
            at::Tensor& into) override {
    inner_.read(name, global_shape, offset, into);
  }
  std::vector<std::string> unread() const override { return {}; }
  bool holds(const std::string& name) const override { return inner_.holds(name); }
  std::string where() const override { return inner_.where(); }

 private:
  loom::StateReader& inner_;
};

// Note [ZeRO with placed parameters]: under expert parallelism the expert weights are placed
// (rows of global tensors, held by their replicas only: Note [Placed parameters]). ZeRO stages
// 1-2 shard the other, dense parameters over every rank as usual; the placed ones keep whole
// state on their ranks, in the core's default driver, their gradients all-reduced over their
// replicas by gradient buckets (as [ddp] does). This driver runs the two side by side: one
// gradient norm (each part's is already summed over the ranks), one clip, one update.
class SplitDriver final : public loom::StepDriver {
 public:
  SplitDriver(std::unique_ptr<loom::StepDriver> sharded, std::unique_ptr<loom::StepDriver> placed,
              int64_t placed_grad_bytes)
      : sharded_(std::move(sharded)), placed_(std::move(placed)),
        placed_grad_bytes_(placed_grad_bytes) {}
  std::string name() const override { return sharded_->name() + " + placed (default)"; }
  void zero_grad() override {
    sharded_->zero_grad();
    placed_->zero_grad();
  }
  at::Tensor grad_norm_squared() override {
    at::Tensor dense = sharded_->grad_norm_squared();
    return dense + placed_->grad_norm_squared().to(dense.device());
  }
  std::vector<at::Tensor> grads() override {
    auto all = sharded_->grads();
    for (auto& g : placed_->grads()) all.push_back(g);
    return all;
  }
  void scale_grads(double factor) override {
    sharded_->scale_grads(factor);
    placed_->scale_grads(factor);
  }
  void update(int64_t step, double lr) override {
    sharded_->update(step, lr);
    placed_->update(step, lr);
  }
  loom::StatePieces state_pieces() const override {
    auto all = sharded_->state_pieces();
    for (auto& piece : placed_->state_pieces()) all.push_back(std::move(piece));
    return all;
  }
  void load_state(loom::StateReader& reader) override {
    // The placed part first, unchecked; the sharded driver's check then sees what is left.
    UncheckedReader unchecked(reader);
    placed_->load_state(unchecked);
    sharded_->load_state(reader);
  }
  bool state_is_sharded() const override { return true; }
  int64_t state_bytes() const override {
    return sharded_->state_bytes() + placed_->state_bytes();
  }
  int64_t master_bytes() const override {
    return sharded_->master_bytes() + placed_->master_bytes();
  }
  int64_t grad_bytes() const override {
    const int64_t sharded = sharded_->grad_bytes();
    return sharded < 0 ? -1 : sharded + placed_grad_bytes_;
  }
  std::vector<std::string> sharded_weights() const override {
    auto all = sharded_->sharded_weights();
    for (auto& name : placed_->sharded_weights()) all.push_back(name);
    return all;
  }
  int64_t sharded_weight_bytes() const override {
    return sharded_->sharded_weight_bytes() + placed_->sharded_weight_bytes();
  }

 private:
  std::unique_ptr<loom::StepDriver> sharded_, placed_;
  int64_t placed_grad_bytes_;
};

class Zero final : public loom::Plugin {
 public:
  // A build that threw before teardown ran leaves no observer of a dead plugin behind.
  ~Zero() override { remove_sharded_init(); }
  std::string name() const override { return "zero"; }
  std::string description() const override {
    return "ZeRO data parallelism: stage 0 (replicated), 1 (optimizer state and fp32 masters "
           "sharded), 2 (also gradients, reduce-scattered during backward)";
  }
  // After MoE and precision (both "first"), before every other plugin: before LoRA, whose
  // teardown writes the adapter from the weights gathered here, and before preloading, so the
  // model-state baseline taken at setup holds no preload buffer.
  Order order() const override { return {.after = {"moe", "precision"}, .before = {"*"}}; }
  std::vector<loom::Slot> slots() const override {
    return {loom::Slot::grad_sync, loom::Slot::step_driver};
  }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("zero");
    s.key_int("stage", 2,
              "0: data parallel, 1: + optimizer state sharded, 2: + gradients, 3: + weights")
        .key_float("reduce_bucket_size", 25.0 * (1 << 20),
                   "bytes of fp32 gradients per reduce-scatter (all-reduce at stage 0) bucket")
        .key_float("allgather_bucket_size", 50.0 * (1 << 20),
                   "bytes of updated parameters in flight in the all-gather after an update")
        .key_bool("overlap_comm", true,
                  "launch each bucket as soon as its gradients are ready (false: after backward)")
        .key_bool("broadcast_buffers", true, "start every rank with rank 0's buffers too")
        .key_float("stage3_prefetch_bucket_size", 5e7,
                   "stage 3: prefetch the next unit's weights when it has at most this many "
                   "elements (0: no prefetch)")
        .key_float("stage3_param_persistence_threshold", 1e5,
                   "stage 3: parameters with fewer elements stay whole on every rank")
        .key_float("stage3_max_live_parameters", 1e9,
                   "stage 3: no prefetch once this many elements are gathered")
        .key_optional("offload_optimizer", loom::ValueType::Table,
                      "where fp32 masters and optimizer state live (DeepSpeed's keys): { device "
                      "= \"nvme\", nvme_path = \"/local_nvme\", buffer_count = 4, "
                      "pin_memory = true, block_size = 1048576, queue_depth = 8, "
                      "delayed_update = false, overlap_update = true }; device = \"cpu\" on a "
                      "CPU run changes nothing")
        .key_optional("offload_param", loom::ValueType::Table,
                      "stage 3: where the weights' shards live between uses (DeepSpeed's key): "
                      "{ device = \"nvme\", nvme_path = \"/local_nvme\" } needs half-precision "
                      "weights ([precision] mode = \"full_bf16\"); device = \"cpu\" (a GPU "
                      "run: page-locked host memory, pin_memory = true) changes nothing on a "
                      "CPU run")
        .key_int("shard_group_size", 0,
                 "stages 1-3: shard over groups of this many consecutive ranks (a node's, "
                 "typically) and replicate across the groups, HSDP (Note [Hybrid sharding] in "
                 "loom/sharding/zero_driver.h); must divide the world size; 0: every rank")
        .key_bool("sharded_init", true,
                  "stage 3 on the CPU: build the model a unit at a time, each cut to this "
                  "rank's part as soon as it is initialised or read from from_pretrained, so no "
                  "rank ever holds the whole model (Note [Sharded initialization] in loom/nn.h); "
                  "false: build it whole on every rank, then shard it (left out, false for a "
                  "job with [lora] or [moe], which change the units once they are built)")
        .key_bool("stage3_return_freed_memory", true,
                  "stage 3 on the CPU: freed blocks of 1 MiB and more go back to the system "
                  "(the least resident memory: a freed unit's weights do not stay in malloc's "
                  "heap), at the cost of faulting every step's large blocks in again; false "
                  "keeps them (Note [Freed weights go back])")
        .key_bool("stage3_gather_weights_at_end", true,
                  "stage 3: make the weights whole again once training ends (for exporters "
                  "such as [lora] save_adapter; false keeps them sharded: loom consolidate)");
    return {s};
  }
  // The stages' and offloads' bytes (zero_memory.cpp; see Note [Memory declarations]).
  void declare_memory(const loom::ConfigSection& table, const loom::memory::MemoryContext& context,
                      loom::memory::MemoryTerms& terms) const override {
    loom::zero::declare_memory(table, context, terms);
  }
  std::vector<loom::memory::MemoryVariant> memory_variants() const override {
    return loom::zero::memory_variants();
  }
  void configure(const loom::ConfigSection& t) override {
    stage_ = static_cast<int>(t.get_int("stage"));
    LOOM_CHECK_AS(ConfigError, stage_ >= 0 && stage_ <= 3, t.where("stage"),
                  ": [zero] stage must be 0, 1, 2 or 3 (ZeRO's stages), got ", stage_);
    where_stage_ = t.where("stage");
    options_.prefetch_elements = static_cast<int64_t>(t.get_float("stage3_prefetch_bucket_size"));
    persistence_threshold_ =
        static_cast<int64_t>(t.get_float("stage3_param_persistence_threshold"));
    options_.max_live_elements = static_cast<int64_t>(t.get_float("stage3_max_live_parameters"));
    for (const char* key : {"stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                            "stage3_max_live_parameters"})
      LOOM_CHECK_AS(ConfigError, t.get_float(key) >= 0, t.where(key), ": [zero] ", key,
                    " must be >= 0, got ", t.get_float(key));
    options_.stage = stage_;
    options_.reduce_bucket_bytes = static_cast<int64_t>(t.get_float("reduce_bucket_size"));
    options_.allgather_bucket_bytes = static_cast<int64_t>(t.get_float("allgather_bucket_size"));
    LOOM_CHECK_AS(ConfigError, options_.reduce_bucket_bytes > 0, t.where("reduce_bucket_size"),
                  ": [zero] reduce_bucket_size must be positive, got ", options_.reduce_bucket_bytes);
    LOOM_CHECK_AS(ConfigError, options_.allgather_bucket_bytes > 0,
                  t.where("allgather_bucket_size"), ": [zero] allgather_bucket_size must be "
                  "positive, got ", options_.allgather_bucket_bytes);
    options_.overlap = t.get_bool("overlap_comm");
    options_.shard_group_size = static_cast<int>(t.get_int("shard_group_size"));
    where_group_ = t.where("shard_group_size");
    LOOM_CHECK_AS(ConfigError, t.get_int("shard_group_size") >= 0 &&
                                   t.get_int("shard_group_size") <= (1 << 30),
                  where_group_, ": [zero] shard_group_size must be a positive number of ranks "
                  "dividing the world size (0: every rank), got ", t.get_int("shard_group_size"));
    LOOM_CHECK_AS(ConfigError, stage_ >= 1 || options_.shard_group_size == 0, where_group_,
                  ": [zero] shard_group_size = ", options_.shard_group_size, " shards stages "
                  "1-3 within groups of ranks, but stage = 0 shards nothing; set stage = 1, 2 "
                  "or 3, or leave shard_group_size out");
    parse_offload(t);
    broadcast_buffers_ = t.get_bool("broadcast_buffers");
    gather_at_end_ = t.get_bool("stage3_gather_weights_at_end");
    sharded_init_ = t.get_bool("sharded_init");
    return_freed_memory_ = t.get_bool("stage3_return_freed_memory");
    sharded_init_set_ = t.has("sharded_init");
    built_whole_for_.clear();
    where_sharded_init_ = t.where("sharded_init");
    LOOM_CHECK_AS(ConfigError, !(sharded_init_set_ && sharded_init_) || stage_ == 3,
                  where_sharded_init_, ": [zero] sharded_init = true cuts the units' weights "
                  "as the model is built, which stage 3 alone shards; set stage = 3 or remove "
                  "sharded_init");
  }

  // Stages 1-2 update each rank's chunk as it lands (see Note [Updating chunks in backward]), but
  // a rule with whole-tensor statistics (UpdateRule::reduction_rounds: Adafactor's factored
  // moments) needs every chunk's sums, from every rank, before any update.
  void refuse_whole_tensor_rule_in_backward(const loom::UpdateRule& rule,
                                            const std::string& where) const {
    LOOM_CHECK_AS(ConfigError, rule.reduction_rounds() == 0, where, ": [train] "
                  "optimizer_in_backward at [zero] stage ", stage_, " (", where_stage_, ") "
                  "updates each rank's chunk as it lands, but update rule '", rule.name(),
                  "' sums statistics over whole tensors across the ranks before any update; use "
                  "[zero] stage = 0 (or [ddp]) for it, an elementwise rule such as name = "
                  "\"adamw\", or turn optimizer_in_backward off");
  }

  // Note [One resolved job]: what the driver would refuse once built, refused from the job.
  void validate(const std::string&, const loom::ConfigSection&,
                const JobTables& job) const override {
    // Note [Optimizer in backward] (core/src/optimizer_in_backward.h): stage 0 hands each
    // bucket's averaged gradients over as they land; stages 1-2 update each chunk as it lands
    // (Note [Updating chunks in backward]); stage 3 and the swapped drivers update after
    // backward.
    if (job("train")->get_bool("optimizer_in_backward")) {
      LOOM_CHECK_AS(ConfigError, stage_ <= 2, where_stage_, ": [zero] stage 3 with [train] "
                    "optimizer_in_backward is not built (a unit's weight shards, which its next "
                    "gather reads, are updated after backward); use stage = 1 or 2, or turn "
                    "optimizer_in_backward off");
      LOOM_CHECK_AS(ConfigError, offload_.device != "nvme", where_offload_, ": [zero] "
                    "offload_optimizer to NVMe with [train] optimizer_in_backward is not built "
                    "(the swapped state is updated in one pipelined walk after backward); leave "
                    "offload_optimizer out or turn optimizer_in_backward off");
      // The host store's driver updates after backward (or bucket by bucket, Note [Overlapped
      // update]), never through the engine's hooks; with delayed_update it is refused below,
      // naming both.
      LOOM_CHECK_AS(ConfigError, offload_.device == "none" || offload_.delayed_update,
                    where_offload_, ": [zero] offload_optimizer.device = \"cpu\" with [train] "
                    "optimizer_in_backward is not built (the host store runs the update itself, "
                    "not as each gradient becomes final); leave offload_optimizer out or turn "
                    "optimizer_in_backward off");
      // A rule's whole-tensor sums need every chunk first (see Note [Updating chunks in
      // backward]); the same refusal stands in create_step_driver, as the backstop.
      if (stage_ >= 1 && job.update_rule)
        refuse_whole_tensor_rule_in_backward(*job.update_rule, job("train")->where(
                                                 "optimizer_in_backward"));
    }
    // Note [Delayed update] (loom/offload/offloaded_driver.h).
    if (offload_.delayed_update) {
      LOOM_CHECK_AS(ConfigError, offload_.device != "none", where_offload_, ": [zero] "
                    "offload_optimizer.delayed_update runs the offloaded update on the CPU one "
                    "step late, but offload_optimizer.device is \"none\"; set device = \"cpu\" "
                    "or \"nvme\"");
      LOOM_CHECK_AS(ConfigError, stage_ == 0, where_offload_, ": [zero] offload_optimizer."
                    "delayed_update is built for stage 0 (one GPU, or data parallelism with the "
                    "whole state on every rank), not stage ", stage_, "; set stage = 0 or turn "
                    "delayed_update off");
      LOOM_CHECK_AS(ConfigError, !job("train")->get_bool("optimizer_in_backward"), where_offload_,
                    ": [zero] offload_optimizer.delayed_update and [train] optimizer_in_backward "
                    "both move the update, one after the next step's backward, the other into "
                    "this step's; choose one");
    }
    if (offloads_params(job("train")->get_string("device").rfind("cuda", 0) == 0)) {
      LOOM_CHECK_AS(ConfigError, stage_ == 3, where_offload_param_, ": [zero] offload_param "
                    "offloads stage 3's weight shards, but stage = ", stage_, "; set stage = 3");
      // Note [Offloaded parameters]: the offloaded shards are the half weights, rebuilt from
      // the fp32 masters after each update: only the precision plugin's pure half modes have
      // both.
      const loom::ConfigSection* precision = job("precision");
      const std::string mode = precision ? precision->get_string("mode") : "fp32 (no [precision])";
      LOOM_CHECK_AS(ConfigError, mode == "full_bf16" || mode == "full_fp16", where_offload_param_,
                    ": [zero] offload_param keeps half-precision weight shards off the device "
                    "and rebuilds them from the fp32 masters, but [precision] mode is ", mode,
                    "; use [precision] mode = \"full_bf16\" (or \"full_fp16\")");
    }
    // Note [ZeRO without masters] (loom/sharding/zero_driver.h): without masters, offload_param's
    // shards are updated where they live by the walk over the offloaded optimizer state.
    const loom::ConfigSection* optimizer = job("optimizer");
    if (optimizer && optimizer->get_string("master_dtype") == "bf16") {
      const bool cuda = job("train")->get_string("device").rfind("cuda", 0) == 0;
      LOOM_CHECK_AS(ConfigError, !offloads_params(cuda) || offloads_state(cuda),
                    optimizer->where("master_dtype"),
                    ": [optimizer] master_dtype = \"bf16\" keeps no fp32 masters, so [zero] "
                    "offload_param (", where_offload_param_, ") updates each weight shard where "
                    "it lives, in the walk over the offloaded optimizer state, but "
                    "offload_optimizer ",
                    offload_.device == "none" ? std::string("is not set")
                                              : "(\"cpu\") moves nothing on a CPU run",
                    "; set offload_optimizer = { device = \"",
                    cuda ? "cpu" : "nvme", "\", ... } too, or remove master_dtype");
    }
    // Note [Sharded initialization]: plugins that change the units once the model is built
    // need it whole. Left out, sharded_init is resolved off for this job (said at setup); set
    // true, it is refused.
    if (stage_ == 3 && sharded_init_) {
      const std::pair<const char*, const char*> whole_model[] = {
          {"lora", "freezes the units' weights and adds adapters to them"},
          {"moe", "replaces the units' feed-forward layers"}};
      for (const auto& [table, what] : whole_model) {
        if (!job(table)) continue;
        LOOM_CHECK_AS(ConfigError, !sharded_init_set_, where_sharded_init_, ": [zero] "
                      "sharded_init = true cuts each unit to this rank's part as it is built, "
                      "but [", table, "] ", what, " after the model is built, which needs the "
                      "whole model; set [zero] sharded_init = false, or leave it out");
        sharded_init_ = false;
        built_whole_for_ = loom::detail::cat("[", table, "] ", what, " after the model is built");
        break;
      }
    }
    if (stage_ == 3 && sharded_init_) {
      const std::string device = job("train")->get_string("device");
      LOOM_CHECK_AS(ConfigError, !sharded_init_set_ || device.rfind("cuda", 0) != 0,
                    where_sharded_init_, ": [zero] sharded_init = true is built for CPU runs "
                    "(the model moves to the GPU whole once it is built); set [zero] "
                    "sharded_init = false, or train on the CPU");
    }
  }

  // Note [ZeRO without masters], Note [Offloaded without masters]: every driver it makes keeps
  // none under master_dtype = "bf16" (what it cannot build, validate refuses).
  bool keeps_no_masters(const loom::ConfigSection&) const override { return true; }

  std::unique_ptr<loom::StepDriver> create_step_driver(const loom::StepDriverOptions& options,
                                                       loom::Engine& engine) override {
    // Note [Hybrid sharding]: the world size is known from here on.
    if (options_.shard_group_size > 0) {
      const int n = options.comm->world_size();
      LOOM_CHECK_AS(ConfigError, options_.shard_group_size <= n &&
                                     n % options_.shard_group_size == 0,
                    where_group_, ": [zero] shard_group_size = ", options_.shard_group_size,
                    " must divide the world size ", n, " (groups of consecutive ranks that "
                    "each hold one copy of the sharded state); use a divisor of ", n,
                    " such as the ranks per node, or leave it out to shard over every rank");
    }
    // Every replica starts from rank 0's weights, before the driver copies its chunks.
    loom::sharding::start_from_rank0(engine, broadcast_buffers_);
    auto& comm = *options.comm;
    // Note [Offloaded parameters] (loom/sharding/shard_file.h): "cpu" is a GPU run's host
    // store; a CPU run holds its weights in host memory already, so it changes nothing there
    // unless LOOM_OFFLOAD_CPU_STORE=1 asks for its twin (Note [Parameter offload twin]).
    if (offloads_params(engine.device().is_cuda())) {
      LOOM_CHECK_AS(ConfigError, stage_ == 3, where_offload_param_, ": [zero] offload_param "
                    "offloads stage 3's weight shards, but stage = ", stage_, "; set stage = 3");
      if (offload_param_.device == "nvme")
        offload_param_.nvme.path = engine.resolve_path(offload_param_.nvme.path);
      options_.offload_param = offload_param_;
      options_.offload_param_twin = engine.device().is_cpu() && cpu_twin();
      loom::log::info("zero: stage 3 weight shards offloaded to ",
                      offload_param_.device == "nvme"
                          ? "NVMe (" + offload_param_.nvme.path + ")"
                          : std::string(offload_param_.pin_memory && engine.device().is_cuda()
                                            ? "page-locked host memory"
                                            : "host memory"),
                      options_.offload_param_twin ? ", staged as on a GPU (the CPU twin)" : "");
    } else if (offload_param_.device == "cpu") {
      loom::log::info("zero: offload_param.device = \"cpu\" on a CPU run: the weights are in "
                      "CPU memory already; nothing changes");
    }
    // Note [Host store]: device = "cpu" is ZeRO-Offload for a GPU run. On a CPU run the state
    // is in host memory already, so it changes nothing, unless LOOM_OFFLOAD_CPU_STORE=1: the
    // tests run the GPU path's host store on the CPU that way (its CPU twin).
    offload_active_ = offloads_state(!engine.device().is_cpu());
    if (offload_.device == "cpu" && !offload_active_) {
      loom::log::info("zero: offload_optimizer.device = \"cpu\" on a CPU run: the state is in "
                      "CPU memory already; nothing changes");
    } else if (offload_active_) {
      if (offload_.device == "nvme") {
        offload_.nvme.path = engine.resolve_path(offload_.nvme.path);
        loom::log::info("zero: stage ", stage_, ", optimizer state offloaded to NVMe (",
                        offload_.nvme.path, ")");
      } else {
        loom::log::info("zero: stage ", stage_, ", optimizer state",
                        bf16_own_masters(engine.section("optimizer"), options.params)
                            ? " (no fp32 masters: the bf16 weights are their own)"
                            : " and fp32 masters",
                        " offloaded to ",
                        offload_.pin_memory && engine.device().is_cuda() ? "page-locked " : "",
                        "host memory; the update runs on the CPU");
      }
      // Placed (expert-parallel) parameters keep whole state on their ranks only, which
      // neither offloaded layout knows how to checkpoint or clip.
      for (const auto& p : options.params)
        LOOM_CHECK_AS(ConfigError, !p.placed(), where_offload_, ": [zero] offload_optimizer "
                      "does not take parameters placed on some ranks only ('", p.name,
                      "': expert parallelism); offload without [moe] expert_parallel_size > 1");
      if (stage_ == 0) {
        // Data parallelism on the buckets, and every rank its own swap file holding all the
        // state (the process id in its name keeps them apart in one folder).
        if (comm.world_size() > 1)
          buckets_ = std::make_unique<loom::sharding::GradBuckets>(
              options.params, options_.reduce_bucket_bytes, comm, options_.overlap);
        auto offloaded = loom::offload::make_offloaded_step_driver(options, offload_);
        offloaded_ = offloaded.get();
        // Note [Overlapped update] (loom/offload/offloaded_driver.h): on several ranks each
        // averaged gradient goes to the host store as its bucket is waited for.
        clips_ = engine.section("train").get_float("max_grad_norm") > 0;
        if (buckets_ && offloaded_->overlaps_backward())
          buckets_->on_final_grad(loom::sharding::GradBuckets::FinalGrad::in_grad,
                                  [this, &engine](const at::Tensor& param, const at::Tensor&) {
                                    hand_to_offloaded(engine, param);
                                  });
        return offloaded;
      }
      // Stages 1-3: the ZeRO driver with its rank's pieces in a swap file (Note [Offloaded
      // ZeRO]), whose walk runs after backward.
      LOOM_CHECK_AS(ConfigError, !engine.section("train").get_bool("optimizer_in_backward"),
                    where_offload_, ": [zero] offload_optimizer at stage ", stage_, " with "
                    "[train] optimizer_in_backward is not built (the offloaded pieces are "
                    "updated in one walk after backward); leave offload_optimizer out or turn "
                    "optimizer_in_backward off");
      options_.offload = offload_;
    }
    if (stage_ == 0) {
      // One rank has nothing to all-reduce: no buckets (a second copy of the gradients).
      if (comm.world_size() > 1) {
        buckets_ = std::make_unique<loom::sharding::GradBuckets>(
            options.params, options_.reduce_bucket_bytes, comm, options_.overlap);
        if (engine.section("train").get_bool("optimizer_in_backward")) {
          engine.will_hand_final_grads();  // Note [Optimizer in backward]
          buckets_->on_final_grad(loom::sharding::GradBuckets::FinalGrad::handed_over,
                                  [&engine](const at::Tensor& param, const at::Tensor& grad) {
                                    engine.grad_final(param, grad);
                                  });
        }
        loom::log::info("zero: stage 0 (data parallel) over ", comm.world_size(), " ranks, ",
                        buckets_->bucket_count(), " gradient bucket(s)");
      } else {
        loom::log::info("zero: stage 0 on one rank: nothing to reduce");
      }
      return loom::make_default_step_driver(options);
    }
    // Note [ZeRO with placed parameters].
    loom::StepDriverOptions dense = options, placed = options;
    dense.params.clear();
    placed.params.clear();
    int64_t placed_grad_bytes = 0;
    for (const auto& p : options.params) {
      (p.placed() ? placed : dense).params.push_back(p);
      if (p.placed()) placed_grad_bytes += p.tensor.numel() * p.tensor.element_size();
    }
    if (!placed.params.empty()) {
      LOOM_CHECK_AS(ConfigError, stage_ <= 2, where_stage_, ": [zero] stage 3 does not shard "
                    "parameters placed on some ranks only ('", placed.params.front().name,
                    "': expert parallelism); use stage 1 or 2 with [moe] expert_parallel_size "
                    "> 1, or expert_parallel_size = 1");
      LOOM_CHECK_AS(ConfigError, !dense.params.empty(), where_stage_,
                    ": [zero] has no dense parameters to shard: every trainable one is placed");
    }
    // Refused from the job in validate(); here too, the backstop (see Note [Updating chunks in
    // backward]).
    if (engine.section("train").get_bool("optimizer_in_backward"))
      refuse_whole_tensor_rule_in_backward(*options.rule,
                                           engine.section("train").where("optimizer_in_backward"));
    if (stage_ == 3) {
      find_units(engine, options);
      if (sharded_init_observer_) take_built_chunks(engine, options);
    }
    // The driver frees each built chunk once its shard is made: it holds the only reference.
    loom::sharding::ZeroOptions zero = options_;
    options_.built_chunks.clear();
    auto driver = std::make_unique<loom::sharding::ZeroDriver>(dense, std::move(zero));
    driver_ = driver.get();
    if (!placed.params.empty()) {
      buckets_ = std::make_unique<loom::sharding::GradBuckets>(
          placed.params, options_.reduce_bucket_bytes, comm, options_.overlap);
      loom::log::info("zero: ", placed.params.size(), " placed (expert-parallel) parameter(s) "
                      "kept whole on their ranks, reduced over their replicas in ",
                      buckets_->bucket_count(), " bucket(s)");
      loom::log::info("zero: ", driver_->describe(), " (", comm.backend(), ", overlap ",
                      options_.overlap ? "on" : "off", ")");
      return std::make_unique<SplitDriver>(std::move(driver),
                                           loom::make_default_step_driver(placed),
                                           placed_grad_bytes);
    }
    if (stage_ == 3) engine.add_unit_interceptor(std::make_shared<GatherUnits>(driver_));
    loom::log::info("zero: ", driver_->describe(), " (", comm.backend(), ", overlap ",
                    options_.overlap ? "on" : "off", ")");
    return driver;
  }

  void attach(loom::Engine& engine) override {
    // Note [Sharded initialization]: the observer is there while the model is built only.
    engine.on(loom::Event::setup, [this](loom::Engine& e) { install_sharded_init(e); });
    engine.on(loom::Event::model_built, [this](loom::Engine& e) { finish_sharded_init(e); });
    engine.on(loom::Event::teardown, [this](loom::Engine&) { remove_sharded_init(); });
    engine.on(loom::Event::params_ready, [this](loom::Engine& e) { report_start_peak(e); });
    engine.on_grad_ready([this](loom::Engine& e, const loom::Param& p) {
      // Stages 2 and 3 land every micro-step's gradient in the shard; 0 and 1 sync once.
      if (buckets_ && e.state().sync_grads && (!driver_ || p.placed())) buckets_->grad_ready(p);
      if (driver_ && !p.placed() && (stage_ >= 2 || e.state().sync_grads)) driver_->grad_ready(p);
      // Note [Overlapped update]: one rank's gradients are final as backward accumulates them.
      if (offloaded_ && !buckets_ && e.state().sync_grads && offloaded_->overlaps_backward())
        hand_to_offloaded(e, p.tensor);
    });
    // Note [Hybrid sharding]: the last micro-step's chunks go across the groups as they land.
    engine.on(loom::Event::before_backward, [this](loom::Engine& e) {
      if (driver_) driver_->begin_backward(e.state().is_last_micro_step());
    });
    engine.on(loom::Event::after_backward, [this](loom::Engine& e) {
      const bool last = e.state().is_last_micro_step();
      if (buckets_ && last) {
        buckets_->finish();
        e.state().metrics.emplace_back("zero_comm_s", buckets_->last_stats().comm_seconds);
        e.state().metrics.emplace_back("zero_exposed_comm_s", buckets_->last_stats().exposed_seconds);
      }
      if (driver_ && (stage_ >= 2 || last)) {
        driver_->finish_backward(/*window_end=*/last);
        if (last) {
          e.state().metrics.emplace_back("zero_comm_s", driver_->stats().comm_seconds);
          e.state().metrics.emplace_back("zero_exposed_comm_s", driver_->stats().exposed_seconds);
        }
      }
    });
    // Note [Measured model state]: what the memory tracker sees allocated after the first update
    // (weights, gradients or their shards, masters, optimizer state; activations are gone),
    // against the ZeRO paper's formula for this stage, world size and precision (with [train]
    // optimizer_in_backward, and at stage 1, less the gradients: freed as they updated, or once
    // packed and reduced (Note [Stage 1's gradient once packed]); formula_bytes says so).
    engine.on(loom::Event::setup, [this](loom::Engine& e) {
      baseline_bytes_ = loom::memory::device_stats(e.device()).current_bytes;
    });
    engine.on(loom::Event::after_update, [this](loom::Engine& e) {
      // Offloaded state (NVMe, or the host arena of a GPU run) is outside the formula's memory.
      if (measured_ || (!driver_ && !buckets_) || offload_active_ ||
          offloads_params(e.device().is_cuda()))
        return;
      measured_ = true;
      const int64_t measured =
          loom::memory::device_stats(e.device()).current_bytes - baseline_bytes_;
      const auto [formula, text] = formula_bytes(e);
      e.state().metrics.emplace_back("zero_model_state_measured_bytes", static_cast<double>(measured));
      e.state().metrics.emplace_back("zero_model_state_formula_bytes", static_cast<double>(formula));
      char off[32];
      std::snprintf(off, sizeof off, "%+.2f %%",
                    formula > 0 ? 100.0 * static_cast<double>(measured - formula) / formula : 0.0);
      loom::log::info("zero: model state on rank ", e.comm().rank(), " after the first update: ",
                      loom::memory::format_bytes(measured), " measured (memory tracker), ",
                      loom::memory::format_bytes(formula), " by ZeRO's formula ", text, " (",
                      off, ")");
    });
    // Note [Delayed update]: a checkpoint holds no update in flight, and the run ends with all.
    engine.on(loom::Event::save, [this](loom::Engine&) {
      if (offloaded_) offloaded_->synchronize();
    });
    engine.on(loom::Event::teardown, [this](loom::Engine&) {
      if (offloaded_) offloaded_->synchronize();
    });
    engine.on(loom::Event::save, [this](loom::Engine& e) {
      // What cut the pieces (informational: a resume reads them at any world size and group
      // size by their global offsets, Note [Hybrid sharding]).
      if (driver_) {
        auto& values = e.checkpoint().values;
        values["zero.stage"] = std::to_string(stage_);
        values["zero.shard_group_size"] = std::to_string(driver_->shard_group_size());
      }
    });
    engine.on(loom::Event::teardown, [this](loom::Engine& e) {
      // Only after a finished run: after an error a peer may be gone.
      if (driver_ && stage_ == 3 && gather_at_end_ && e.state().step >= e.state().max_steps)
        driver_->gather_all_weights();
    });
    engine.on(loom::Event::after_update, [this](loom::Engine& e) {
      const loom::offload::OffloadStats* stats =
          offloaded_ ? &offloaded_->last_stats() : driver_ ? driver_->offload_stats() : nullptr;
      if (stats && !e.state().skip_update) {
        // Note [Pipelined update]: how much of the swap file's I/O the rule's compute hid.
        const auto& s = *stats;
        e.state().metrics.emplace_back("offload_update_s", s.update_seconds);
        e.state().metrics.emplace_back("offload_compute_s", s.compute_seconds);
        e.state().metrics.emplace_back("offload_io_wait_s", s.io_wait_seconds);
        e.state().metrics.emplace_back("offload_bytes_read", static_cast<double>(s.bytes_read));
        e.state().metrics.emplace_back("offload_bytes_written",
                                       static_cast<double>(s.bytes_written));
        if (offloaded_ && offloaded_->overlaps_backward())  // Note [Overlapped update]
          e.state().metrics.emplace_back("offload_updated_in_backward",
                                         static_cast<double>(s.updated_in_backward));
      }
      if (driver_)
        e.state().metrics.emplace_back("zero_comm_elements",
                                       static_cast<double>(driver_->stats().elements));
      if (driver_ && driver_->replicas() > 1)  // Note [Hybrid sharding]
        e.state().metrics.emplace_back("zero_cross_group_elements",
                                       static_cast<double>(driver_->stats().cross_group_elements));
      if (driver_ && driver_->offloads_params()) {
        // Note [Offloaded parameters]: how much of the shard reads the read-ahead hid.
        e.state().metrics.emplace_back("offload_param_reads_ahead",
                                       static_cast<double>(driver_->stats().shard_reads_ahead));
        e.state().metrics.emplace_back("offload_param_wait_s", driver_->stats().shard_wait_seconds);
      }
    });
  }

 private:
  // Note [Freed weights go back]: stage 3 frees and re-allocates every unit's weights twice a
  // step. glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so
  // after the first step those blocks come from the heap, which keeps their pages: measured on
  // a 0.63 B GPT over 4 CPU ranks, RSS 5.5 GiB against 3.5 GiB of peak tensors. A fixed 1 MiB
  // threshold returns them (RSS 3.9 GiB, docs/BENCHMARKS.md). The price is time: every block of
  // 1 MiB and more (weights, activations, buckets) is then mapped and faulted in, zeroed, anew
  // each step. On GPT-2 124M over 2 gloo ranks x 1 thread that was 10.6 M minor faults against
  // 2.7 M, a fifth of the rank's samples in the kernel, and the step 1.2x slower than with the
  // blocks kept (docs/BENCHMARKS.md, "ZeRO stage 3 against PyTorch FSDP2"), for 0.8 GiB less RSS
  // per rank. Tensors of 2 MiB and more now fault in huge pages instead (Note [Large blocks in
  // huge pages], memory.cpp): most of the faults are gone, the zeroing is not, and the gap to
  // the kept blocks fell to 1.03x. So it is a choice, `[zero] stage3_return_freed_memory`
  // (true: the least memory, the default, since stage 3 is chosen for memory; false: the heap
  // keeps them, as every other CPU run does, Note [Freed memory kept]). A threshold the user set
  // through glibc's environment wins either way.
  void return_freed_memory(loom::Engine& engine) const {
    if (!engine.device().is_cpu() || std::getenv("GLIBC_TUNABLES") ||
        std::getenv("MALLOC_MMAP_THRESHOLD_"))
      return;
    if (!return_freed_memory_) {
      loom::log::info("zero: stage 3 on the CPU: freed blocks stay in malloc's heap for the next "
                      "step ([zero] stage3_return_freed_memory = false)");
      return;
    }
    if (mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1) {
      // Tensors of 2 MiB and more in mappings of their own, in huge pages (Note [Large blocks
      // in huge pages], memory.cpp): a twelfth of the faults on GPT-2 124M.
      loom::memory::map_large_cpu_blocks(true);
      loom::log::info("zero: stage 3 on the CPU: blocks of 1 MiB and more are returned to the "
                      "system when freed, tensors of 2 MiB and more in transparent huge pages "
                      "([zero] stage3_return_freed_memory; GLIBC_TUNABLES overrides)");
    }
  }

  // Note [Sharded initialization] (loom/nn.h): installed at setup, right before the engine
  // builds the model, on CPU runs at stage 3 (a GPU run moves the model whole to the device).
  void install_sharded_init(loom::Engine& engine) {
    if (stage_ != 3) return;
    loom::memory::reset_device_peak(engine.device());  // report_start_peak's
    return_freed_memory(engine);  // from the build on: it frees every unit's weights
    if (!built_whole_for_.empty())
      loom::log::info("zero: ", built_whole_for_, ": building the model whole before sharding "
                      "it (sharded_init off)");
    if (!sharded_init_) return;
    if (!engine.device().is_cpu()) {
      LOOM_CHECK_AS(ConfigError, !sharded_init_set_, where_sharded_init_, ": [zero] "
                    "sharded_init = true is built for CPU runs (the model moves to ",
                    engine.device().str(), " whole once it is built); set [zero] sharded_init "
                    "= false, or train on the CPU");
      loom::log::info("zero: stage 3 on ", engine.device().str(), ": the model is built whole, "
                      "then sharded (sharded_init is built for CPU runs)");
      return;
    }
    const int world = engine.comm().world_size();
    const int group = options_.shard_group_size > 0 ? options_.shard_group_size : world;
    if (group > world || world % group != 0) return;  // create_step_driver says why
    loom::sharding::ShardedInitOptions init;
    init.partitioning = engine.update_rule().partitioning();
    init.persistence_threshold = persistence_threshold_;
    init.comm = &engine.comm();
    init.shard_group_size = group;
    sharded_init_observer_ = std::make_unique<loom::sharding::ShardedInit>(init);
    loom::nn::set_unit_build_observer(sharded_init_observer_.get());
  }

  void remove_sharded_init() {
    if (loom::nn::unit_build_observer() == sharded_init_observer_.get())
      loom::nn::set_unit_build_observer(nullptr);
  }

  void finish_sharded_init(loom::Engine& engine) {
    if (!sharded_init_observer_) return;
    remove_sharded_init();
    const int64_t missing = sharded_init_observer_->uninitialised_units();
    LOOM_CHECK_AS(ConfigError, missing == 0, where_sharded_init_, ": [zero] sharded_init: "
                  "model '", engine.section("train").get_string("model"), "' built ", missing,
                  " unit(s) that loom::nn::init_normal_ never initialised, so their weights "
                  "were released unset (Note [Sharded initialization] in loom/nn.h); set [zero] "
                  "sharded_init = false for this model");
  }

  // The chunks cut while the model was built, for the driver; each unit's group must be the
  // tensors the observer cut (a plugin that changed a unit's trainable weights since would
  // leave them mismatched).
  void take_built_chunks(loom::Engine& engine, const loom::StepDriverOptions& options) {
    for (const auto& [unit, indices] : options_.units) {
      const auto* kept = sharded_init_observer_->kept_tensors(unit);
      if (!kept && indices.empty()) continue;
      bool same = kept && kept->size() == indices.size();
      for (size_t i = 0; same && i < indices.size(); ++i)
        same = (*kept)[i].unsafeGetTensorImpl() ==
               options.params[indices[i]].tensor.unsafeGetTensorImpl();
      LOOM_CHECK_AS(ConfigError, same, where_sharded_init_, ": [zero] sharded_init cut a "
                    "unit's weights as the model was built, but its trainable weights changed "
                    "afterwards (a plugin replaced, froze or added some in model_built); set "
                    "[zero] sharded_init = false");
    }
    largest_unit_elements_ = sharded_init_observer_->largest_unit_elements();
    options_.built_chunks = sharded_init_observer_->take_chunks();
    sharded_init_observer_.reset();
  }

  // What the start cost at stage 3: the memory tracker's peak from setup (reset then) to
  // params_ready, against what the rank holds at params_ready (its shard: weight chunks and
  // whole-kept weights, gradient chunks, optimizer state) and the largest unit as built (fp32):
  // Note [Sharded initialization] keeps the peak within the shard plus two units.
  void report_start_peak(loom::Engine& engine) {
    if (stage_ != 3 || !driver_) return;
    const auto stats = loom::memory::device_stats(engine.device());
    std::string units;
    if (largest_unit_elements_ > 0)
      units = loom::detail::cat("; built a unit at a time (sharded initialization), the largest "
                                "unit ", largest_unit_elements_ * 4, " B");
    loom::log::info("zero: stage 3 start-up peak ", stats.peak_bytes, " B (",
                    loom::memory::format_bytes(stats.peak_bytes), ", memory tracker, setup to "
                    "params_ready), this rank's shard ", stats.current_bytes, " B (",
                    loom::memory::format_bytes(stats.current_bytes), "), peak RSS so far ",
                    loom::memory::peak_rss_bytes(), " B", units);
  }

  // Stage 3's units: each unit of every UnitList, with its trainable parameters of at least
  // the persistence threshold.
  void find_units(loom::Engine& engine, const loom::StepDriverOptions& options) {
    auto lists = engine.unit_lists();
    LOOM_CHECK_AS(ConfigError, !lists.empty(), where_stage_,
                  ": [zero] stage = 3 shards the weights of a model's repeated units, but model '",
                  engine.section("train").get_string("model"),
                  "' has no loom::nn::UnitList; build its layers as a UnitList (see "
                  "loom/nn.h), or use stage = 2");
    std::unordered_map<const void*, size_t> index_of;
    for (size_t i = 0; i < options.params.size(); ++i)
      index_of[options.params[i].tensor.unsafeGetTensorImpl()] = i;
    options_.units.clear();
    for (auto* list : lists)
      for (size_t u = 0; u < list->size(); ++u) {
        std::vector<size_t> indices;
        for (const auto& member :
             loom::sharding::unit_group_params((*list)[u], persistence_threshold_)) {
          auto found = index_of.find(member.tensor.unsafeGetTensorImpl());
          LOOM_INTERNAL_ASSERT(found != index_of.end(), "unit weight '", member.name, "' "
                               "requires grad but is not among the engine's trainable "
                               "parameters");
          indices.push_back(found->second);
        }
        options_.units.emplace_back(&(*list)[u], std::move(indices));
      }
    // Note [Offloaded parameters]: offload_param moves the units' shards; with none, the job
    // would run with every weight in memory while saying it offloads them.
    if (offloads_params(engine.device().is_cuda())) {
      size_t sharded = 0;
      for (const auto& unit : options_.units) sharded += unit.second.size();
      LOOM_CHECK_AS(ConfigError, sharded > 0, where_offload_param_, ": [zero] offload_param "
                    "offloads the weight shards of model '",
                    engine.section("train").get_string("model"), "''s units, but none of its ",
                    options_.units.size(), " units has a trainable weight of at least "
                    "stage3_param_persistence_threshold = ", persistence_threshold_,
                    " elements (smaller ones stay whole in memory): nothing would be offloaded; "
                    "lower stage3_param_persistence_threshold (0 shards every weight of a unit) "
                    "or leave offload_param out");
    }
  }

  // The ZeRO paper's per-rank model state (Rajbhandari et al. 2020, section 3: weights 2Psi,
  // gradients 2Psi, optimizer state K Psi in mixed precision with Adam, K = 12 with the fp32
  // masters), with this run's bytes per element: weights and gradients in the weights' dtype,
  // the masters (4 B, only for non-fp32 weights: fp32 weights are updated in place) and the
  // rule's state (adamw: 8 B; another rule: what its state takes) sharded over N; stage 3's
  // weights sharded except the declared whole-kept ones (outside units, below the threshold).
  std::pair<int64_t, std::string> formula_bytes(loom::Engine& e) const {
    const auto ms = e.model_state();
    const double psi = static_cast<double>(ms.trainable_count);
    // Note [Hybrid sharding]: the sharded terms are divided by the shard group's size.
    const double n = driver_ ? driver_->shard_group_size() : e.comm().world_size();
    const auto& params = e.params();
    const double w = params.empty() ? 4.0 : static_cast<double>(params.front().tensor.element_size());
    // fp32 masters beside half weights, unless bf16 weights are their own (Note [ZeRO without
    // masters] in loom/sharding/zero_driver.h).
    const auto& optimizer = e.section("optimizer");
    const double m = w == 4.0 || bf16_own_masters(optimizer, params) ? 0.0 : 4.0;
    // The rule's state per element over all ranks (stage 0: every rank holds it all): AdamW's
    // two moments in fp32 or bf16 ([optimizer] state_dtype), any other rule's as it measures.
    const double k = optimizer.get_string("name") == "adamw"
                         ? (optimizer.get_string("state_dtype") == "bf16" ? 4.0 : 8.0)
                         : static_cast<double>(e.step_driver().state_bytes()) *
                               (stage_ == 0 ? 1.0 : n) / psi;
    double whole = 0;  // stage 3: elements kept whole
    if (stage_ == 3 && driver_) {
      std::set<std::string> sharded;
      for (const auto& name : driver_->sharded_weights()) sharded.insert(name);
      for (const auto& p : params)
        if (!sharded.count(p.name)) whole += static_cast<double>(p.tensor.numel());
    }
    // Frozen tensors as held: some may be in half under autocast (Note [Frozen weights in half]).
    double frozen = 0;
    for (const auto& p : e.model().parameters(/*recurse=*/true))
      if (!p.requires_grad()) frozen += static_cast<double>(p.numel() * p.element_size());
    double bytes = 0;
    std::ostringstream text;
    text.precision(3);
    text << "(stage " << stage_ << ", N = " << n << ", " << w << " B weights and grads, K = "
         << m + k << " B: ";
    // Note [ZeRO's model states] (loom/memory.h): the formula `loom estimate` uses too.
    const loom::memory::ZeroModelStates states =
        loom::memory::zero_model_states(stage_, n, psi, psi - whole, w, m, k);
    bytes = states.total();
    // Note [Optimizer in backward]: each gradient (stages 1-2: each chunk, and stage 1's whole
    // .grad) was freed once its update ran, so after the update none is held: the formula
    // without its gradients is what the tracker can see.
    // And stage 1 releases .grad once packed and its chunk after the update (Note [Stage 1's
    // gradient once packed] in loom/sharding/zero_driver.h).
    const bool in_backward = e.section("train").get_bool("optimizer_in_backward");
    const bool grads_freed = in_backward || (stage_ == 1 && driver_);
    if (grads_freed) bytes -= states.grads;
    if (stage_ == 0) {
      // Declared buffers: the gradient buckets, a second fp32 copy of the gradients.
      const double buckets = buckets_ ? static_cast<double>(buckets_->buffer_bytes()) : 0.0;
      bytes += buckets;
      text << 2 * w + m + k << " Psi, replicated, plus "
           << loom::memory::format_bytes(static_cast<int64_t>(buckets)) << " gradient buckets";
    } else if (stage_ == 1) {
      text << 2 * w << " Psi + " << m + k << " Psi/N";
    } else if (stage_ == 2) {
      text << w << " Psi + " << w + m + k << " Psi/N";
    } else {
      text << 2 * w + m + k << " Psi/N, plus " << whole / psi * 100 << " % of the weights kept whole";
    }
    if (frozen > 0) text << ", plus " << loom::memory::format_bytes(static_cast<int64_t>(frozen)) << " frozen";
    if (grads_freed)
      text << ", less the " << loom::memory::format_bytes(static_cast<int64_t>(states.grads))
           << (in_backward ? " of gradients [train] optimizer_in_backward freed as it updated"
                           : " of gradients stage 1 released once packed and once updated");
    text << ")";
    return {static_cast<int64_t>(bytes + frozen), text.str()};
  }

  // Note [ZeRO without masters]: whether the job's bf16 weights are their own masters.
  static bool bf16_own_masters(const loom::ConfigSection& optimizer,
                               const std::vector<loom::Param>& params) {
    return optimizer.get_string("master_dtype") == "bf16" && !params.empty() &&
           params.front().tensor.scalar_type() == at::kBFloat16;
  }
  // Whether offload_optimizer moves the optimizer state: "nvme" always; "cpu" on a GPU, and on
  // a CPU run under LOOM_OFFLOAD_CPU_STORE=1 (Note [Host store]: its CPU twin).
  bool offloads_state(bool on_gpu) const {
    return offload_.device == "nvme" || (offload_.device == "cpu" && (on_gpu || cpu_twin()));
  }
  // Whether offload_param moves the units' shards: "nvme" always; "cpu" on a GPU, and on a CPU
  // run under LOOM_OFFLOAD_CPU_STORE=1 (Note [Parameter offload twin] in shard_file.h).
  bool offloads_params(bool on_gpu) const {
    return offload_param_.device == "nvme" ||
           (offload_param_.device == "cpu" && (on_gpu || cpu_twin()));
  }
  static bool cpu_twin() {
    const char* twin = std::getenv("LOOM_OFFLOAD_CPU_STORE");
    return twin && std::string(twin) == "1";
  }

  // [zero] offload_optimizer and offload_param = { device, nvme_path, buffer_count, pin_memory,
  // block_size, queue_depth, checksum_threads }: every key checked here, before anything runs.
  void parse_offload(const loom::ConfigSection& t) {
    where_offload_ = t.where("offload_optimizer");
    where_offload_param_ = t.where("offload_param");
    parse_offload_table(t, "offload_optimizer", "optimizer state", offload_);
    parse_offload_table(t, "offload_param", "weight shards", offload_param_);
  }
  static void parse_offload_table(const loom::ConfigSection& t, const std::string& name,
                                  const char* what, loom::offload::OffloadOptions& into) {
    const auto* table = t.get(name);
    if (!table) return;
    LOOM_CHECK_AS(ConfigError, table->is_table(), t.where(name), ": [zero] ", name,
                  " must be a table, e.g. { device = \"nvme\", nvme_path = \"/local_nvme\" }");
    into.nvme.what = what;
    for (const auto& [key, value] : std::get<loom::ConfigTable>(table->value)) {
      auto integer = [&, &key = key, &value = value]() -> int64_t {
        const auto* i = std::get_if<int64_t>(&value.value);
        LOOM_CHECK_AS(ConfigError, i, value.where, ": [zero] ", name, ".", key,
                      " must be an integer, not ", value.to_text());
        return *i;
      };
      // A true/false key; `optimizer_only`: the offloaded optimizer's (`what`), refused in
      // offload_param.
      auto flag = [&, &key = key, &value = value](bool optimizer_only, const char* what) {
        const auto* b = std::get_if<bool>(&value.value);
        LOOM_CHECK_AS(ConfigError, b, value.where, ": [zero] ", name, ".", key,
                      " must be true or false");
        LOOM_CHECK_AS(ConfigError, !optimizer_only || name == "offload_optimizer", value.where,
                      ": [zero] ", name, ".", key, ": ", what,
                      " is the offloaded optimizer's; set it in offload_optimizer");
        return *b;
      };
      if (key == "device") {
        const auto* text = std::get_if<std::string>(&value.value);
        LOOM_CHECK_AS(ConfigError, text && (*text == "none" || *text == "cpu" || *text == "nvme"),
                      value.where, ": [zero] ", name, ".device must be \"none\", "
                      "\"cpu\" or \"nvme\", not ", value.to_text());
        into.device = *text;
      } else if (key == "nvme_path") {
        const auto* text = std::get_if<std::string>(&value.value);
        LOOM_CHECK_AS(ConfigError, text, value.where, ": [zero] ", name,
                      ".nvme_path must be a folder path (a string)");
        into.nvme.path = *text;
      } else if (key == "buffer_count") {
        into.buffer_count = static_cast<int>(integer());
        LOOM_CHECK_AS(ConfigError, into.buffer_count >= 3 && into.buffer_count <= 64,
                      value.where, ": [zero] ", name, ".buffer_count must be 3 to 64 "
                      "(one segment read, one updated, one written), got ", into.buffer_count);
      } else if (key == "pin_memory") {
        into.pin_memory = flag(false, "");
      } else if (key == "delayed_update") {
        into.delayed_update = flag(true, "the delayed update");
      } else if (key == "overlap_update") {  // Note [Overlapped update]
        into.overlap_update = flag(true, "the overlapped update");
      } else if (key == "block_size") {
        into.nvme.block_size = integer();
      } else if (key == "queue_depth") {
        into.nvme.queue_depth = static_cast<int>(integer());
      } else if (key == "checksum_threads") {  // Note [Checksums beside the ring]
        into.nvme.checksum_threads = static_cast<int>(integer());
      } else {
        throw loom::ConfigError(loom::detail::cat(
            value.where, ": [zero] ", name, " has no key '", key, "'; it takes device, "
            "nvme_path, buffer_count, pin_memory, block_size, queue_depth, checksum_threads",
            name == "offload_optimizer" ? ", delayed_update, overlap_update" : ""));
      }
    }
    LOOM_CHECK_AS(ConfigError, into.device != "nvme" || !into.nvme.path.empty(), t.where(name),
                  ": [zero] ", name, ".device = \"nvme\" needs nvme_path, a folder on a fast "
                  "local disk");
    if (into.device == "nvme")
      loom::offload::check_nvme_options(into.nvme, t.where(name) + ": [zero] " + name + ".");
  }

  loom::offload::OffloadOptions offload_, offload_param_;
  loom::offload::OffloadedStepDriver* offloaded_ = nullptr;  // owned by the engine
  bool clips_ = false;  // [train] max_grad_norm > 0

  // Note [Overlapped update] (loom/offload/offloaded_driver.h): a final gradient to the host
  // store, its update started at once unless clipping or a loss scale must see every gradient
  // first.
  void hand_to_offloaded(loom::Engine& engine, const at::Tensor& param) {
    const loom::TrainState& state = engine.state();
    offloaded_->grad_final(param, !clips_ && !state.grads_scaled, state.step + 1, state.lr);
  }
  std::string where_offload_, where_offload_param_;
  bool offload_active_ = false;  // the optimizer state is in a SegmentSwap (nvme, or cpu on a GPU)
  int64_t baseline_bytes_ = 0;
  bool measured_ = false;
  int stage_ = 2;
  int64_t persistence_threshold_ = 100000;
  std::string where_stage_, where_group_;
  loom::sharding::ZeroOptions options_;
  bool broadcast_buffers_ = true, gather_at_end_ = true;
  // [zero] sharded_init as the table says it, then as the job resolves it: validate(), the one
  // place that sees the whole job, turns the default off where a plugin needs the whole model
  // (built_whole_for_ says which, for setup's log line), so every later reader sees the
  // resolved value.
  mutable bool sharded_init_ = true;
  bool return_freed_memory_ = true;
  mutable std::string built_whole_for_;
  bool sharded_init_set_ = false;
  std::string where_sharded_init_;
  std::unique_ptr<loom::sharding::ShardedInit> sharded_init_observer_;
  int64_t largest_unit_elements_ = 0;
  std::unique_ptr<loom::sharding::GradBuckets> buckets_;
  loom::sharding::ZeroDriver* driver_ = nullptr;  // owned by the engine
};

}  // namespace

LOOM_DEFINE_PLUGIN(Zero, "zero", "0.1.0")
