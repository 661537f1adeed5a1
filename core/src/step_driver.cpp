// The unsharded step driver. See step_driver.h.
#include "step_driver.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "loom/comm.h"
#include "loom/error.h"
#include "loom/log.h"
#include "adamw.h"
#include "resolve.h"
#include "stochastic_rounding.h"
#include "grad_scale.h"
#include "sum_of_squares.h"

namespace loom {

// Note [bf16 weights as their own masters]: [optimizer] master_dtype = "bf16" keeps no fp32
// master for a bf16 parameter ([precision] mode = "full_bf16"). Its update widens the weights to
// fp32 (exact), runs the rule on them as on a master, and writes the result back into the bf16
// weights rounded stochastically (llm.c's and torchao's way to train pure bf16): up with
// probability equal to the distance from the bf16 below, so E[weight] is the fp32 update and an
// update smaller than half a bf16 ulp (2^-9 of the weight: Adam's lr-sized step at lr 1e-4 on a
// weight of 0.1) moves the weight sometimes instead of never, as nearest rounding would. 4 B per
// parameter less than with masters (2 + 2 + the rule's state: 8 B with bf16 moments, where
// DeepSpeed's mixed precision holds 16), and no master to copy back.
// The random bits are those of Note [Stochastic rounding of the state] (adamw.cpp) with the
// parameter's own stream, weight_rounding_key(seed, name): the [train] seed, the step, the name
// and each element's index in the whole tensor decide them, so a run, its resume and its ranks
// agree bitwise. The core's adamw does all of it in one pass of its own (takes_bf16_weights:
// widening in registers, reading the bf16 gradient as it is; 22 B per parameter with fp32
// moments where widen, update and round moved 46), with the same bits; any other rule, or a
// GPU, gets the widened copy. A checkpoint holds no masters; a resume from one that does drops
// them (its weights are their rounding to nearest), and a job with masters resumed from one
// without starts them from the weights, each said in a warning.
DefaultStepDriver::DefaultStepDriver(const StepDriverOptions& options)
    : rule_(*options.rule),
      weight_decay_(options.weight_decay),
      comm_(options.comm),
      fused_rule_(options.master_dtype == "bf16" &&
                  takes_bf16_weights(*options.rule, options.seed)),
      reads_bf16_grads_(takes_bf16_gradients(*options.rule)) {
  const bool bf16_masters = options.master_dtype == "bf16";
  LOOM_INTERNAL_ASSERT(options.master_dtype == "fp32" || bf16_masters, "master_dtype '",
                       options.master_dtype, "'");
  at::NoGradGuard no_grad;
  for (auto& param : options.params) {
    Entry entry;
    entry.param = param;
    at::Tensor data = param.tensor.detach();
    LOOM_INTERNAL_ASSERT(data.is_contiguous(), "parameter ", param.name, " is not contiguous");
    entry.rounded = bf16_masters && data.scalar_type() == at::kBFloat16;
    entry.separate_master = data.scalar_type() != at::kFloat && !entry.rounded;
    if (entry.rounded) entry.rounding_key = weight_rounding_key(options.seed, param.name);
    entry.master = entry.separate_master ? data.to(at::kFloat).view(-1)
                   : entry.rounded       ? at::Tensor()
                                         : data.view(-1);
    entry.segment.name = param.name;
    // A rounded entry's fp32 weights exist only during its update; the rule makes its state
    // from a copy that goes at once.
    entry.segment.param = entry.rounded ? data.to(at::kFloat).view(-1) : entry.master;
    entry.segment.shape = data.sizes().vec();
    entry.segment.offset = 0;
    entry.segment.group = param.group;
    entry.segment.state = rule_.init_state(entry.segment);
    if (entry.rounded) entry.segment.param = at::Tensor();
    if (!param.global_shape.empty()) {
      LOOM_INTERNAL_ASSERT(comm_, "parameter ", param.name, " is placed, but the driver has no Comm");
      any_rows_placed_ = true;
    }
    entry_of_[param.tensor.unsafeGetTensorImpl()] = entries_.size();
    entries_.push_back(std::move(entry));
  }
}

bool DefaultStepDriver::writes(const Param& param) const {
  if (!any_rows_placed_) return true;  // rank 0 alone writes (state_is_sharded() is false)
  if (param.global_shape.empty()) return comm_->rank() == 0;
  return !param.replicas || param.replicas->rank() == 0;
}

std::vector<std::string> DefaultStepDriver::sharded_weights() const {
  std::vector<std::string> out;
  for (const auto& entry : entries_)
    if (!entry.param.global_shape.empty()) out.push_back(entry.param.name);
  return out;
}

int64_t DefaultStepDriver::sharded_weight_bytes() const {
  int64_t bytes = 0;
  for (const auto& entry : entries_)
    if (!entry.param.global_shape.empty())
      bytes += entry.param.tensor.numel() * entry.param.tensor.element_size();
  return bytes;
}

std::vector<at::Tensor> DefaultStepDriver::defined_grads() const {
  std::vector<at::Tensor> out;
  for (const auto& entry : entries_) {
    const at::Tensor& grad = entry.param.tensor.grad();
    if (grad.defined()) out.push_back(grad);
  }
  return out;
}

// Note [Gradients released, not zeroed]: each step starts with no gradient tensors at all
// (PyTorch's zero_grad(set_to_none=True), its default since 2.0), not with zeroed ones. Zeroed
// gradients live through forward, so the step's peak held the activations and every gradient
// at once, and backward then added each new gradient into its zeros (one more pass over every
// gradient, and the zeroing pass before it). Released, a gradient is made by the backward that
// computes it, as the activations it came from are freed. GPT-2 124M fp32, batch 4 x 256: peak
// 2682 -> 2207 MiB, the model's 475 MiB of gradients (docs/BENCHMARKS.md). The values are the
// same: the first micro-batch's gradient is taken as it is, later ones are added to it. A
// parameter that gets no gradient in a step (an expert no token chose, a branch not taken)
// has none and its update is skipped, as PyTorch's optimizers skip a None grad; it was updated
// with a zero gradient before (its moments decayed, weight decay applied).
void DefaultStepDriver::zero_grad() {
  for (auto& entry : entries_) at::Tensor(entry.param.tensor).mutable_grad() = at::Tensor();
}

at::Tensor squared_norm(const std::vector<at::Tensor>& grads) {
  // One fp32 sum of squares per tensor, then their fp64 total: all on the grads' device, so a
  // GPU run pays one host sync per step (when the caller reads it), not one per tensor.
  if (grads.empty()) return at::zeros({}, at::kDouble);
  if (grads.front().is_cuda()) {
    // One multi-tensor norm kernel (what clip_grad_norm_ runs), squared in fp64.
    return at::stack(at::_foreach_norm(grads, 2)).to(at::kDouble).pow(2).sum();
  }
  // fp32 squares summed in fp64 (Note [Sum of squares in one pass]): the total hardly depends on
  // where a sharded driver cuts a tensor, so the clipping factor (applied in fp32) comes out the
  // same for every cut.
  std::vector<at::Tensor> squares;
  for (const at::Tensor& grad : grads)
    squares.push_back(sum_of_squares(grad));
  return at::stack(squares).sum();
}

at::Tensor DefaultStepDriver::grad_norm_squared() {
  if (!any_rows_placed_) return squared_norm(defined_grads());
  // Rows placed on some ranks only: their squares are summed over every rank, each set of rows
  // counted once (divided by its replica count); the rest is the same on every rank. The sums
  // stay on the parameters' device until the one all-reduce.
  const c10::Device device = entries_.front().param.tensor.device();
  const auto fp64 = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor whole = at::zeros({}, fp64), placed = at::zeros({}, fp64);
  for (const auto& entry : entries_) {
    const at::Tensor& grad = entry.param.tensor.grad();
    if (!grad.defined()) continue;
    const at::Tensor square = sum_of_squares(grad);
    if (entry.param.global_shape.empty()) {
      whole += square;
    } else {
      const int replicas = entry.param.replicas ? entry.param.replicas->world_size()
                                                : comm_->world_size();
      placed += square / replicas;
    }
  }
  at::Tensor total = placed.reshape({1}).to(comm_->device());
  comm_->all_reduce(total, ReduceOp::sum)->wait();
  return total.to(device).reshape({}) + whole;
}

std::vector<at::Tensor> DefaultStepDriver::grads() { return defined_grads(); }

void DefaultStepDriver::scale_grads(double factor) {
  at::NoGradGuard no_grad;
  scale_gradients(defined_grads(), factor);
}

void scale_gradients(const std::vector<at::Tensor>& grads, double factor) {
  scale_in_place(grads, factor);
}

UpdateContext update_context(const Param& param, int64_t step, double lr,
                             double default_weight_decay) {
  UpdateContext context;
  context.step = step;
  context.lr = lr * param.lr_scale;
  context.weight_decay = param.weight_decay >= 0.0 ? param.weight_decay
                         : param.group == 0        ? default_weight_decay
                                                   : 0.0;
  return context;
}

void DefaultStepDriver::update(int64_t step, double lr) {
  // Tensors that share a learning rate and weight decay go to the rule together (update_many),
  // in parameter order within each group.
  std::vector<std::pair<const Param*, at::Tensor>> items;
  for (const auto& entry : entries_) {
    const at::Tensor& grad = entry.param.tensor.grad();
    if (grad.defined()) items.emplace_back(&entry.param, grad);  // else unused this step
  }
  update_params(items, step, lr);
}

void DefaultStepDriver::choose_path(Entry& entry, const at::Tensor& grad) const {
  // The rule's kernels take a bf16 gradient as it is only on the CPU and contiguous.
  const bool as_is = entry.param.tensor.is_cpu() && grad.is_cpu() &&
                     grad.scalar_type() == at::kBFloat16 && grad.is_contiguous();
  entry.fused = as_is && entry.rounded && fused_rule_;
  entry.bf16_grad = as_is && !entry.rounded && reads_bf16_grads_;
}

void DefaultStepDriver::prepare(Entry& entry, const at::Tensor& grad) {
  if (entry.fused) {  // the rule widens and rounds in its own pass (takes_bf16_weights)
    entry.segment.param = entry.param.tensor.detach().view(-1);
    entry.segment.grad = grad.view(-1);
    return;
  }
  if (entry.bf16_grad) {  // Note [bf16 gradients read as they are] (adamw.cpp)
    entry.segment.grad = grad.view(-1);
    return;
  }
  entry.segment.grad =
      grad.scalar_type() == at::kFloat ? grad.reshape(-1) : grad.to(at::kFloat).reshape(-1);
  if (entry.rounded) entry.segment.param = entry.param.tensor.detach().to(at::kFloat).view(-1);
}

void DefaultStepDriver::write_back(Entry& entry, int64_t step) {
  if (entry.separate_master) {
    entry.param.tensor.detach().copy_(entry.master.view(entry.param.tensor.sizes()));
  } else if (entry.rounded) {
    if (!entry.fused) {
      at::Tensor weights = entry.param.tensor.detach().view(-1);
      round_to_bf16_stochastic(entry.segment.param, weights, entry.rounding_key, step,
                               entry.segment.offset);
    }
    entry.segment.param = at::Tensor();
    entry.fused = false;
  }
  entry.segment.grad = at::Tensor();
  entry.bf16_grad = false;
}

void DefaultStepDriver::update_param(const Param& param, const at::Tensor& grad, int64_t step,
                                     double lr) {
  update_params({{&param, grad}}, step, lr);
}

void DefaultStepDriver::update_params(const std::vector<std::pair<const Param*, at::Tensor>>& items,
                                      int64_t step, double lr) {
  at::NoGradGuard no_grad;
  // update()'s conversion, context and grouping, and the rule's update_many on each group: a
  // batch's results do not depend on its batching (UpdateRule::update_many), so these are its
  // bits.
  std::map<std::pair<double, double>, std::vector<std::pair<Entry*, at::Tensor>>> groups;
  for (const auto& [param, grad] : items) {
    auto found = entry_of_.find(param->tensor.unsafeGetTensorImpl());
    LOOM_INTERNAL_ASSERT(found != entry_of_.end(), "update_param for ", param->name,
                         ", which is not a parameter of this driver");
    Entry& entry = entries_[found->second];
    const UpdateContext context = update_context(entry.param, step, lr, weight_decay_);
    groups[{context.lr, context.weight_decay}].emplace_back(&entry, grad);
  }
  // Note [Update copies bounded]: a half gradient is widened to fp32 for the rule, and a
  // rounded entry's weights too (Note [bf16 weights as their own masters]); made for a whole
  // group at once, those copies were 4 B (8 B) per parameter of the model beside its state at
  // the update: 28 GB more for a 7 B model in full_bf16, where the masters' 4 B/param were meant
  // to be the only fp32 copy. A group goes to the rule in batches whose copies stay under
  // kUpdateCopyBytes (a larger tensor alone), each batch's released before the next is made.
  // fp32 gradients of fp32 weights need no copy: their group is one batch, as before.
  constexpr int64_t kUpdateCopyBytes = int64_t{128} << 20;
  for (auto& [key, group] : groups) {
    UpdateContext context;
    context.step = step;
    context.lr = key.first;
    context.weight_decay = key.second;
    std::vector<std::pair<Entry*, at::Tensor>> batch;
    int64_t copy_bytes = 0;
    const auto run = [&] {
      std::vector<Segment*> segments;
      for (auto& [entry, grad] : batch) {
        prepare(*entry, grad);
        segments.push_back(&entry->segment);
      }
      rule_.update_many(segments, context);
      for (auto& [entry, grad] : batch) write_back(*entry, step);
      batch.clear();
      copy_bytes = 0;
    };
    for (auto& [entry, grad] : group) {
      choose_path(*entry, grad);
      const int64_t bytes = entry->fused || entry->bf16_grad ? 0
                                         : entry->param.tensor.numel() * 4 *
                                               ((grad.scalar_type() != at::kFloat) + entry->rounded);
      if (!batch.empty() && copy_bytes + bytes > kUpdateCopyBytes) run();
      batch.emplace_back(entry, grad);
      copy_bytes += bytes;
    }
    if (!batch.empty()) run();
  }
}

// The checkpoint pieces of one parameter, aliasing its state, masters and (placed) weights, so
// load_state reads into them in place. A placed parameter's are pieces of the global tensors
// (offsets from its row offset) and include its weights; an unplaced one's are whole.
StatePieces DefaultStepDriver::pieces_of(const Entry& entry) const {
  const Param& param = entry.param;
  const std::string state = "state/" + param.name + "/";
  StatePieces out;
  if (param.global_shape.empty()) {
    for (const auto& [key, tensor] : entry.segment.state)
      out.push_back({state + key, tensor, tensor.sizes().vec(), 0});
    if (entry.separate_master)
      out.push_back({"master/" + param.name, entry.master, {entry.master.numel()}, 0});
    return out;
  }
  const int64_t global_numel = c10::multiply_integers(param.global_shape);
  const int64_t offset = param.row_offset * (param.tensor.numel() / param.tensor.size(0));
  const NamedTensors whole =
      whole_tensor_state_shapes(rule_, param.name, param.global_shape, param.group);
  for (const auto& [key, tensor] : entry.segment.state) {
    at::Tensor shape_of;
    for (const auto& [whole_key, whole_tensor] : whole)
      if (whole_key == key) shape_of = whole_tensor;
    LOOM_INTERNAL_ASSERT(shape_of.defined(), "no whole-tensor state '", key, "' for ", param.name);
    out.push_back(state_piece(state + key, tensor, shape_of, offset, param.tensor.numel(),
                              global_numel));
  }
  out.push_back({"weight/" + param.name, param.tensor.detach().view(-1), {global_numel}, offset,
                 param.global_shape});
  if (entry.separate_master)
    out.push_back({"master/" + param.name, entry.master, {global_numel}, offset});
  return out;
}

StatePieces DefaultStepDriver::state_pieces() const {
  StatePieces out;
  for (const auto& entry : entries_)
    if (writes(entry.param))
      for (auto& piece : pieces_of(entry)) out.push_back(std::move(piece));
  return out;
}

void DefaultStepDriver::load_state(StateReader& reader) {
  at::NoGradGuard no_grad;
  // Note [bf16 weights as their own masters]: masters saved by a run that kept them, or none
  // by one that did not.
  std::string dropped, widened;
  for (auto& entry : entries_) {
    const std::string master = "master/" + entry.param.name;
    const bool master_saved = reader.holds(master);
    for (auto& piece : pieces_of(entry)) {
      if (piece.name == master && !master_saved) continue;  // made from the weights below
      reader.read(piece.name, piece.global_shape, piece.offset, piece.tensor);
    }
    if (entry.separate_master && !master_saved) {
      entry.master.copy_(entry.param.tensor.detach().view(-1));  // exact: bf16 into fp32
      if (widened.empty()) widened = master;
    } else if (entry.separate_master && entry.param.global_shape.empty()) {
      // An unplaced parameter's weights are its masters' (a placed one read its own weights).
      entry.param.tensor.detach().copy_(entry.master.view(entry.param.tensor.sizes()));
    }
    if (entry.rounded && master_saved) {
      // Read (so nothing is left unread) and dropped: the weights go on from their bf16 values.
      const Param& param = entry.param;
      const int64_t numel = param.tensor.numel();
      at::Tensor into = at::empty({numel}, param.tensor.options().dtype(at::kFloat));
      if (param.global_shape.empty()) {
        reader.read(master, {numel}, 0, into);
      } else {
        reader.read(master, {c10::multiply_integers(param.global_shape)},
                    param.row_offset * (numel / param.tensor.size(0)), into);
      }
      if (dropped.empty()) dropped = master;
    }
  }
  warn_master_dtype_switch(reader, dropped, widened);
  check_nothing_unread(reader);
}

int64_t DefaultStepDriver::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& entry : entries_)
    for (const auto& [key, tensor] : entry.segment.state)
      bytes += tensor.numel() * tensor.element_size();
  return bytes;
}

int64_t DefaultStepDriver::master_bytes() const {
  int64_t bytes = 0;
  for (const auto& entry : entries_)
    if (entry.separate_master) bytes += entry.master.numel() * 4;
  return bytes;
}

StepDriver::~StepDriver() = default;

void StepDriver::update_param(const Param& param, const at::Tensor&, int64_t, double) {
  LOOM_INTERNAL_ASSERT(false, "step driver ", name(), " cannot update ", param.name,
                       " in backward (updates_in_backward() is false)");
}
void StepDriver::begin_update_in_backward(int64_t, double) {
  LOOM_INTERNAL_ASSERT(false, "step driver ", name(), " cannot update its pieces in backward "
                       "(updates_pieces_in_backward() is false)");
}
StateReader::~StateReader() = default;
bool StateReader::holds(const std::string&) const { return true; }

StatePiece state_piece(const std::string& name, const at::Tensor& piece, const at::Tensor& whole,
                       int64_t segment_offset, int64_t segment_numel, int64_t tensor_numel) {
  StatePiece out{name, piece, whole.sizes().vec(), 0};
  if (segment_numel == tensor_numel || whole.dim() == 0) return out;
  const int64_t rows = whole.size(0);
  if (piece.dim() > 0 && piece.size(0) == rows) return out;  // kept whole on every holder
  LOOM_INTERNAL_ASSERT((segment_offset * rows) % tensor_numel == 0, "state '", name,
                       "' of ", rows, " rows cannot start at element ", segment_offset, " of ",
                       tensor_numel);
  out.offset = segment_offset * rows / tensor_numel;
  return out;
}

NamedTensors whole_tensor_state_shapes(const UpdateRule& rule, const std::string& name,
                                       const std::vector<int64_t>& shape, int group) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  Segment segment;
  segment.name = name;
  segment.param = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(c10::kMeta));
  segment.shape = shape;
  segment.group = group;
  return rule.init_state(segment);
}

void round_weights_to_bf16(const at::Tensor& from, at::Tensor& into, uint64_t seed,
                           const std::string& name, int64_t step, int64_t offset) {
  round_to_bf16_stochastic(from, into, weight_rounding_key(seed, name), step, offset);
}

void warn_master_dtype_switch(const StateReader& reader, const std::string& dropped,
                              const std::string& widened) {
  if (!dropped.empty())
    log::warn("resume: ", reader.where(), " holds fp32 masters ('", dropped, "', ...), and this "
              "job keeps none ([optimizer] master_dtype = \"bf16\"): the weights go on from "
              "their bf16 values, the masters' extra bits dropped");
  if (!widened.empty())
    log::warn("resume: ", reader.where(), " holds no fp32 masters (saved with [optimizer] "
              "master_dtype = \"bf16\"; first missing: '", widened, "'): this job's masters "
              "start from the bf16 weights");
}

bool rule_takes_bf16_weights(const UpdateRule& rule, uint64_t seed) {
  return takes_bf16_weights(rule, seed);
}

bool rule_reads_bf16_gradients(const UpdateRule& rule) { return takes_bf16_gradients(rule); }

void check_nothing_unread(const StateReader& reader) {
  const auto left = reader.unread();
  LOOM_CHECK_AS(CheckpointError, left.empty(), reader.where(), " holds optimizer state '",
                left.empty() ? "" : left.front(),
                "' that this job has no place for; it belongs to another model or optimizer");
}

std::unique_ptr<StepDriver> make_default_step_driver(const StepDriverOptions& options) {
  LOOM_INTERNAL_ASSERT(options.rule, "make_default_step_driver needs the update rule");
  return std::make_unique<DefaultStepDriver>(options);
}

std::unique_ptr<StepDriver> make_step_driver(const ResolvedJob& job, std::vector<Param> params,
                                             const UpdateRule& rule, Comm* comm, Engine& engine) {
  const auto& opt = job.section("optimizer");
  const double weight_decay =
      opt.schema().find("weight_decay") ? opt.get_float("weight_decay") : 0.0;
  LOOM_CHECK_AS(ConfigError, weight_decay >= 0, opt.where("weight_decay"),
                ": [optimizer] weight_decay must be >= 0");
  StepDriverOptions options;
  options.params = std::move(params);
  options.rule = &rule;
  options.weight_decay = weight_decay;
  options.comm = comm;
  options.master_dtype = opt.get_string("master_dtype");
  options.seed = engine.seed();
  LoadedPlugin* plugin = job.table_plugin_in(Slot::step_driver);
  if (!plugin) return make_default_step_driver(options);
  auto driver = plugin->plugin->create_step_driver(options, engine);
  LOOM_INTERNAL_ASSERT(driver, "plugin ", plugin->name, " made no step driver");
  // Note [bf16 weights as their own masters]: a plugin's driver is given master_dtype; one that
  // keeps masters all the same is refused here, before the run writes anything.
  LOOM_CHECK_AS(ConfigError, options.master_dtype != "bf16" || driver->master_bytes() == 0,
                opt.where("master_dtype"), ": [optimizer] master_dtype = \"bf16\" keeps no fp32 "
                "masters, but the step driver ", driver->name(), " of [", plugin->name,
                "] keeps ", driver->master_bytes(), " bytes of them on this rank; remove "
                "master_dtype, or drop [", plugin->name, "] for the core's step driver");
  log::info("step driver ", driver->name(), " (plugin ", plugin->name, ")");
  return driver;
}

void update_step(StepDriver& driver, TrainState& state, const at::Tensor& in_backward_norm,
                 double max_grad_norm) {
  const bool in_backward = in_backward_norm.defined();
  if (state.skip_update) {
    LOOM_CHECK(!in_backward, "step ", state.step + 1, ": a plugin asked to skip this update "
               "in before_update, but [train] optimizer_in_backward applied it during "
               "backward; turn optimizer_in_backward off for this job");
    ++state.skipped_updates;
    log::warn("step ", state.step + 1, ": update skipped (", state.skipped_updates, " so far)");
    return;
  }
  // After the loss scaler had its say: an fp16 overflow it skips is not divergence.
  LOOM_CHECK(std::isfinite(state.loss), "step ", state.step + 1, ": the loss is ", state.loss,
             ": training diverged (or the model produced non-finite values); lower [train] "
             "learning_rate, check the data, or use [precision] with loss scaling for fp16; no "
             "checkpoint of this step is written");
  LOOM_INTERNAL_ASSERT(!state.grads_scaled,
                       "gradients are still scaled by the loss scale at update time; the "
                       "precision plugin must unscale them in before_update");
  state.grad_norm =
      std::sqrt((in_backward ? in_backward_norm : driver.grad_norm_squared()).item<double>());
  LOOM_CHECK(std::isfinite(state.grad_norm), "step ", state.step + 1, ": the gradient norm is ",
             state.grad_norm, " (loss ", state.loss, "): training diverged; lower [train] "
             "learning_rate, or use [precision] with loss scaling for fp16");
  if (max_grad_norm > 0) {
    const double coefficient = max_grad_norm / (state.grad_norm + 1e-6);
    if (coefficient < 1.0) driver.scale_grads(coefficient);
  }
  // Note [Optimizer in backward]: a driver that updated its own pieces completes the step here.
  if (!in_backward || driver.updates_pieces_in_backward()) driver.update(state.step + 1, state.lr);
}

}  // namespace loom
