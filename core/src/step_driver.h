// step_driver.h (core-internal) — the default step driver (ZeRO stage 0; loom/step_driver.h is
// the contract): one segment per trainable tensor, fp32 master copies for parameters stored in
// another dtype, gradient norm and clipping, and the update rule over whole tensors. Sharded
// drivers (ZeRO 1-3) cut the same segments at the rule's granularity. Also which driver a job
// gets (make_step_driver), and the step's update around any driver (update_step).
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "loom/engine.h"
#include "loom/step_driver.h"
#include "loom/update_rule.h"

namespace loom {

struct ResolvedJob;

// The job's step driver over `params` with `rule` and [optimizer] weight_decay (>= 0, else a
// ConfigError naming the key): the one the plugin filling Slot::step_driver makes (said in the
// log), else the default one below.
std::unique_ptr<StepDriver> make_step_driver(const ResolvedJob& job, std::vector<Param> params,
                                             const UpdateRule& rule, Comm* comm, Engine& engine);

// The update of a step, which the engine runs between before_update and after_update: skipped
// when a plugin set state.skip_update (counted and said), else the loss and the gradient norm
// checked for divergence (an Error saying what to do), the gradients clipped to
// `max_grad_norm` (0: never) and the driver's update run with state.lr. `in_backward_norm`:
// defined when Note [Optimizer in backward] updated the parameters during backward already, the
// squared gradient norm it kept (a skip is then an error; a driver that updates its own pieces
// in backward still runs update(), which completes the step).
void update_step(StepDriver& driver, TrainState& state, const at::Tensor& in_backward_norm,
                 double max_grad_norm);

class DefaultStepDriver final : public StepDriver {
 public:
  // options.comm: the job's (needed only for placed parameters, Note [Placed parameters]).
  explicit DefaultStepDriver(const StepDriverOptions& options);
  std::string name() const override { return "default"; }

  void zero_grad() override;
  // Sum of squared gradient entries over this rank's segments (fp32 grads, summed in double):
  // a 0-d fp64 tensor on the parameters' device, so reading it is the caller's one sync.
  at::Tensor grad_norm_squared() override;
  void scale_grads(double factor) override;
  std::vector<at::Tensor> grads() override;
  // Runs the rule on every segment; step is the 1-based update count.
  void update(int64_t step, double lr) override;
  // Note [Optimizer in backward]: one tensor, as update() runs it.
  bool updates_in_backward() const override { return true; }
  void update_param(const Param& param, const at::Tensor& grad, int64_t step,
                    double lr) override;
  // Several parameters at once, as update() batches them (by learning rate and weight decay,
  // one update_many each): Note [Small gradients batched on a GPU] in optimizer_in_backward.cpp.
  void update_params(const std::vector<std::pair<const Param*, at::Tensor>>& items, int64_t step,
                     double lr);

  // "state/<param>/<key>" and "master/<param>" tensors, for checkpoints.
  StatePieces state_pieces() const override;
  // Restores them; a missing or misshapen tensor is a CheckpointError naming it and `file`.
  void load_state(StateReader& reader) override;
  int64_t state_bytes() const override;
  int64_t master_bytes() const override;
  // Placed parameters (rows of a global tensor, expert parallelism) are saved by every rank
  // that is the first of its replicas, as pieces of the global tensors.
  bool state_is_sharded() const override { return any_rows_placed_; }
  std::vector<std::string> sharded_weights() const override;
  int64_t sharded_weight_bytes() const override;

 private:
  // Whether this rank writes `param`'s pieces of a sharded checkpoint.
  bool writes(const Param& param) const;
  // The defined gradients, in parameter order.
  std::vector<at::Tensor> defined_grads() const;
  struct Entry {
    Param param;
    at::Tensor master;  // fp32 (n); aliases the parameter when it is fp32 already
    bool separate_master = false;
    // Note [bf16 weights as their own masters]: a bf16 parameter with no master; its segment's
    // param is an fp32 copy made for its update only, rounded back with `rounding_key`'s bits.
    bool rounded = false;
    uint64_t rounding_key = 0;
    // This update hands the rule the bf16 weights and gradient themselves (choose_path()).
    bool fused = false;
    // This update hands the rule the bf16 gradient as it is (its fp32 master stays the param).
    bool bf16_grad = false;
    Segment segment;
  };
  // One parameter's checkpoint pieces, aliasing its state, masters and (placed) weights.
  StatePieces pieces_of(const Entry& entry) const;
  // Sets entry.fused and entry.bf16_grad for this update: whether the rule gets a rounded
  // entry's bf16 weights and gradient themselves, or a masters entry's bf16 gradient as it is
  // (the core's adamw on the CPU, a contiguous bf16 gradient): no copies.
  void choose_path(Entry& entry, const at::Tensor& grad) const;
  // Before the rule runs on a batch: its fp32 gradient (a copy where the gradient is half) and,
  // for a rounded entry, its fp32 weights.
  static void prepare(Entry& entry, const at::Tensor& grad);
  // After: an updated master written back to its parameter (a separate master: copied; a
  // rounded entry: rounded stochastically), and the update's copies released.
  static void write_back(Entry& entry, int64_t step);
  std::vector<Entry> entries_;
  std::unordered_map<const void*, size_t> entry_of_;  // parameter's TensorImpl -> entries_ index
  const UpdateRule& rule_;
  double weight_decay_;
  Comm* comm_;
  bool fused_rule_;  // the rule takes bf16 weights itself (takes_bf16_weights)
  bool reads_bf16_grads_;  // the rule takes bf16 gradients (takes_bf16_gradients)
  bool any_rows_placed_ = false;
};

}  // namespace loom
