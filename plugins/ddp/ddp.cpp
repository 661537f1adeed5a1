// The `ddp` plugin: data parallelism (ZeRO stage 0) in the grad_sync slot. Parameters and
// buffers start as rank 0's; gradients are all-reduced in buckets launched during backward as
// they fill (overlapping the rest of backward), only on the last micro-step of an accumulation
// window, and averaged. Samples are already sharded by rank by the core's sampler.
#include <ATen/ATen.h>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/log.h"
#include "loom/model.h"
#include "loom/plugin.h"
#include "loom/sharding/grad_buckets.h"

namespace {

class Ddp final : public loom::Plugin {
 public:
  std::string name() const override { return "ddp"; }
  std::string description() const override {
    return "data parallelism: bucketed gradient all-reduce overlapped with backward";
  }
  std::vector<loom::Slot> slots() const override { return {loom::Slot::grad_sync}; }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("ddp");
    s.key_float("reduce_bucket_size", 25.0 * (1 << 20),
                "bytes of fp32 gradients per all-reduce bucket (DeepSpeed's name)")
        .key_bool("overlap_comm", true,
                  "launch each bucket as soon as its gradients are ready (false: after backward)")
        .key_bool("broadcast_buffers", true, "start every rank with rank 0's buffers too");
    return {s};
  }
  void configure(const loom::ConfigSection& t) override {
    bucket_bytes_ = static_cast<int64_t>(t.get_float("reduce_bucket_size"));
    LOOM_CHECK_AS(ConfigError, bucket_bytes_ > 0, t.where("reduce_bucket_size"),
                  ": [ddp] reduce_bucket_size must be positive, got ", bucket_bytes_);
    overlap_ = t.get_bool("overlap_comm");
    broadcast_buffers_ = t.get_bool("broadcast_buffers");
  }
  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::params_ready, [this](loom::Engine& e) { start(e); });
    engine.on_grad_ready([this](loom::Engine& e, const loom::Param& p) {
      if (buckets_ && e.state().sync_grads) buckets_->grad_ready(p);
    });
    engine.on(loom::Event::after_backward, [this](loom::Engine& e) {
      if (!buckets_ || !e.state().is_last_micro_step()) return;
      buckets_->finish();
      const auto& stats = buckets_->last_stats();
      // Launch-to-observed-completion summed over buckets: an upper bound of the all-reduce
      // time (an overlapped bucket is only observed done once backward ends).
      e.state().metrics.emplace_back("ddp_comm_s", stats.comm_seconds);
      e.state().metrics.emplace_back("ddp_exposed_comm_s", stats.exposed_seconds);
      e.state().metrics.emplace_back("ddp_buckets", static_cast<double>(stats.buckets));
    });
  }

 private:
  void start(loom::Engine& e) {
    auto& comm = e.comm();
    loom::sharding::start_from_rank0(e, broadcast_buffers_);
    buckets_ = std::make_unique<loom::sharding::GradBuckets>(e.params(), bucket_bytes_, comm,
                                                             overlap_);
    // Note [Optimizer in backward] (core/src/optimizer_in_backward.h).
    if (e.section("train").get_bool("optimizer_in_backward")) {
      e.will_hand_final_grads();
      buckets_->on_final_grad(
          loom::sharding::GradBuckets::FinalGrad::handed_over,
          [&e](const at::Tensor& param, const at::Tensor& grad) { e.grad_final(param, grad); });
    }
    loom::log::info("ddp: ", comm.world_size(), " ranks over ", comm.backend(), ", ",
                    buckets_->bucket_count(), " gradient bucket(s) of up to ",
                    loom::memory::format_bytes(bucket_bytes_), ", overlap ",
                    overlap_ ? "on" : "off");
  }

  int64_t bucket_bytes_ = 0;
  bool overlap_ = true, broadcast_buffers_ = true;
  std::unique_ptr<loom::sharding::GradBuckets> buckets_;
};

}  // namespace

LOOM_DEFINE_PLUGIN(Ddp, "ddp", "0.1.0")
