// ZeRO stages 1-3: construction, the gradient norm and scaling, and the update's order. The
// parts the driver runs live beside it (the list in zero_driver.h).
#include "loom/sharding/zero_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <sstream>

#include "loom/error.h"
#include "loom/memory.h"

namespace loom::sharding {

namespace {

// Note [Hybrid sharding]: the checked group size; 0 (the default) is every rank.
int group_size(const Comm& world, int requested) {
  const int n = world.world_size();
  if (requested == 0) return n;
  LOOM_CHECK_AS(ConfigError, requested >= 1 && requested <= n && n % requested == 0,
                "[zero] shard_group_size = ", requested, " must divide the world size ", n,
                " (groups of consecutive ranks that each hold one copy of the sharded state); "
                "use a divisor of ", n, " such as the ranks per node, or leave it out to shard "
                "over every rank");
  return requested;
}

// The world cut into groups of G consecutive ranks (shards), or one rank of each group (replicas).
// Both splits are made by every rank in this order, as collectives must be.
std::unique_ptr<Comm> split_shards(Comm& world, int requested) {
  const int g = group_size(world, requested);
  if (g == world.world_size()) return nullptr;
  return world.split(world.rank() / g, world.rank());
}
std::unique_ptr<Comm> split_replicas(Comm& world, int requested) {
  const int g = group_size(world, requested);
  if (g == world.world_size()) return nullptr;
  return world.split(world.rank() % g, world.rank());
}

}  // namespace

ZeroDriver::ZeroDriver(const StepDriverOptions& options, ZeroOptions zero)
    : params_(options.params),
      rule_(*options.rule),
      weight_decay_(options.weight_decay),
      world_comm_(*options.comm),
      shard_comm_(split_shards(world_comm_, zero.shard_group_size)),
      replica_comm_(split_replicas(world_comm_, zero.shard_group_size)),
      comm_(shard_comm_ ? *shard_comm_ : world_comm_),
      options_(std::move(zero)),
      rank_(comm_.rank()),
      world_(comm_.world_size()),
      replicas_(world_comm_.world_size() / world_) {
  LOOM_CHECK_AS(ConfigError, options_.stage >= 1 && options_.stage <= 3,
                "the ZeRO driver runs stages 1 to 3, not ", options_.stage);
  LOOM_INTERNAL_ASSERT(!params_.empty(), "ZeRO needs trainable parameters");
  weight_dtype_ = params_.front().tensor.scalar_type();
  device_ = params_.front().tensor.device();
  for (const auto& p : params_) {
    LOOM_CHECK_AS(ConfigError, p.tensor.scalar_type() == weight_dtype_ && p.tensor.device() == device_,
                  "[zero] needs every trainable parameter in one dtype on one device, but '",
                  p.name, "' is ", c10::toString(p.tensor.scalar_type()), " on ",
                  p.tensor.device().str(), " and '", params_.front().name, "' is ",
                  c10::toString(weight_dtype_), " on ", device_.str());
    LOOM_INTERNAL_ASSERT(p.tensor.is_contiguous(), "parameter ", p.name, " is not contiguous");
    // The zero plugin gives placed parameters to a driver beside this one (Note [ZeRO with
    // placed parameters]).
    LOOM_INTERNAL_ASSERT(!p.placed(), "ZeroDriver shards parameters over every rank, but '",
                         p.name, "' is placed on some ranks only");
    tensors_.push_back({p.name, p.tensor.sizes().vec()});
  }
  // Note [ZeRO without masters].
  rounded_ = options.master_dtype == "bf16" && weight_dtype_ == at::kBFloat16;
  separate_master_ = weight_dtype_ != at::kFloat && !rounded_;
  seed_ = options.seed;
  fused_rule_ = rounded_ && rule_takes_bf16_weights(rule_, seed_);
  reads_bf16_grads_ = rule_reads_bf16_gradients(rule_);
  // nvme: the swap file; cpu: host memory (Note [Host store]), a GPU run's ZeRO-Offload.
  const bool offloaded = options_.offload.device == "nvme" || options_.offload.device == "cpu";
  if (options_.offload_param.device != "none") {  // Note [Offloaded parameters]
    LOOM_CHECK_AS(ConfigError, options_.stage == 3, "[zero] offload_param offloads stage 3's "
                  "weight shards; set [zero] stage = 3");
    // Note [ZeRO without masters]: without masters the walk over the offloaded state updates
    // each shard where it lives; with the state in memory nothing would bring it there.
    LOOM_CHECK_AS(ConfigError, !rounded_ || offloaded, "[zero] offload_param with [optimizer] "
                  "master_dtype = \"bf16\" updates each weight shard where it lives, in the walk "
                  "over the offloaded optimizer state, but offload_optimizer is not set; set "
                  "offload_optimizer = { device = \"cpu\" } (or \"nvme\") too, or remove "
                  "master_dtype");
    LOOM_CHECK_AS(ConfigError, separate_master_ || rounded_, "[zero] offload_param keeps "
                  "half-precision weight shards off the device and rebuilds them from the fp32 "
                  "masters, but these weights are ", c10::toString(weight_dtype_), "; use "
                  "[precision] mode = \"full_bf16\" (or \"full_fp16\")");
    LOOM_CHECK_AS(ConfigError, device_.is_cpu() || device_.is_cuda(), "[zero] offload_param on ",
                  device_.str(), " is not built (the shards travel to a CUDA device or stay on "
                  "the CPU); train on a CUDA device or the CPU, or leave offload_param out");
  }
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  // Stage 3: one group per unit, weights sharded; every other parameter in gradient buckets.
  std::vector<std::vector<size_t>> members;
  std::vector<const void*> member_unit;
  std::vector<bool> in_unit(params_.size(), false);
  if (options_.stage == 3)
    for (const auto& [unit, indices] : options_.units) {
      if (indices.empty()) continue;
      std::vector<size_t> sorted = indices;
      std::sort(sorted.begin(), sorted.end());
      for (size_t index : sorted) in_unit.at(index) = true;
      members.push_back(sorted);
      member_unit.push_back(unit);
    }
  std::vector<size_t> rest;
  std::vector<TensorInfo> rest_tensors;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!in_unit[i]) {
      rest.push_back(i);
      rest_tensors.push_back(tensors_[i]);
    }
  if (!rest.empty())
    for (auto list : bucket_groups(rest_tensors, options_.reduce_bucket_bytes, 4)) {
      for (auto& index : list) index = rest[index];
      members.push_back(list);
      member_unit.push_back(nullptr);
    }
  placements_.resize(params_.size());
  group_of_.resize(params_.size());
  ready_.assign(params_.size(), false);
  at::NoGradGuard no_grad;
  std::vector<offload::SwapSegment> swap_segments;
  for (size_t m = 0; m < members.size(); ++m) {
    const auto& list = members[m];
    Group group;
    group.plan = plan_group(tensors_, list, rule_.partitioning(), world_);
    group.sharded = member_unit[m] != nullptr;
    group.unit.chunk = group.plan.chunk;
    const size_t g = groups_.size();
    if (group.sharded) {
      unit_group_[member_unit[m]] = g;
      unit_order_.push_back(g);
    }
    for (int r = 0; r < world_; ++r)
      for (const Piece& piece : group.plan.ranks[r]) placements_[piece.tensor].push_back({g, r, piece});
    for (size_t index : list) group_of_[index] = g;
    group.pending = list.size();
    // Note [Sharded initialization]: the unit was cut as it was built; its chunk, in the
    // weights' dtype now (the same rounding a cast of the whole weights gives), is the source.
    at::Tensor built;
    if (group.sharded) {
      auto found = options_.built_chunks.find(member_unit[m]);
      if (found != options_.built_chunks.end()) {
        LOOM_INTERNAL_ASSERT(found->second.numel() == group.plan.chunk, "sharded init cut ",
                             found->second.numel(), " elements for unit ", unit_order_.size() - 1,
                             ", the driver's plan ", group.plan.chunk);
        built = found->second.to(device_, weight_dtype_);
        options_.built_chunks.erase(found);
      }
    }
    if (separate_master_ && offloaded) {
      if (!group.sharded) group.values = at::zeros({group.plan.chunk}, fp32.dtype(weight_dtype_));
    } else if (separate_master_) {
      group.master = at::zeros({group.plan.chunk}, fp32);
    }
    // Stages 2-3: the gradient shard is made when the group first lands (zero_reduce.cpp), so
    // no step before it holds it (Note [Updating chunks in backward] frees it after each update).
    // Stage 3: the chunk, then one element that travels with every gather: the unit's position,
    // so a rank that gathered another unit is caught (Note [Diverged ranks]).
    if (group.sharded) {
      group.unit.shard = at::zeros({group.plan.chunk + 1}, fp32.dtype(weight_dtype_));
      group.unit.position = static_cast<int64_t>(unit_order_.size() - 1);
      set_tag(group.unit);
    }
    for (const Piece& piece : group.plan.ranks[rank_]) {
      const Param& p = params_[piece.tensor];
      at::Tensor flat = built.defined()
                            ? built.narrow(0, piece.chunk_offset, piece.numel)
                            : p.tensor.detach().view(-1).narrow(0, piece.offset, piece.numel);
      Segment segment;
      segment.name = p.name;
      segment.shape = tensors_[piece.tensor].shape;
      segment.offset = piece.offset;
      segment.group = p.group;
      if (group.sharded) group.unit.shard.narrow(0, piece.chunk_offset, piece.numel).copy_(flat);
      if (offloaded) {  // Note [Offloaded ZeRO]: the swap file holds its master and state
        if (group.values.defined())
          group.values.narrow(0, piece.chunk_offset, piece.numel).copy_(flat);
        offload::SwapSegment swapped;
        swapped.name = segment.name;
        swapped.shape = segment.shape;
        swapped.offset = segment.offset;
        swapped.numel = piece.numel;
        swapped.group = segment.group;
        if (!separate_master_ && !rounded_ && device_.is_cpu())
          swapped.in_place =
              group.sharded ? group.unit.shard.narrow(0, piece.chunk_offset, piece.numel) : flat;
        // Note [ZeRO without masters]: the file holds the state alone; the walk widens the
        // weights where they are (the shard, or the parameter) and rounds them back there.
        swapped.no_master = rounded_;
        swap_segments.push_back(std::move(swapped));
        swapped_.emplace_back(groups_.size(), group.segments.size());
        group.segments.push_back(std::move(segment));
        continue;
      }
      if (separate_master_) {
        segment.param = group.master.narrow(0, piece.chunk_offset, piece.numel);
        segment.param.copy_(flat);
      } else if (rounded_) {
        // Note [ZeRO without masters]: the rule makes its state from an fp32 copy that goes at
        // once; the piece's fp32 weights exist only during its update.
        segment.param = flat.to(at::kFloat);
        segment.state = rule_.init_state(segment);
        segment.param = at::Tensor();
        group.segments.push_back(std::move(segment));
        continue;
      } else if (group.sharded) {
        segment.param = group.unit.shard.narrow(0, piece.chunk_offset, piece.numel);  // in place
      } else {
        segment.param = flat;  // fp32 weights: the rank's piece is updated in place
      }
      segment.state = rule_.init_state(segment);
      group.segments.push_back(std::move(segment));
    }
    groups_.push_back(std::move(group));
    if (groups_.back().sharded && !built.defined()) {
      for (size_t index : groups_.back().plan.tensors) {
        const at::Tensor& t = params_[index].tensor;
        LOOM_CHECK_AS(ConfigError,
                      t.storage_offset() == 0 && t.storage().allocator() &&
                          t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size(),
                      "[zero] stage 3 frees the bytes of parameter '", params_[index].name,
                      "' between uses, but it shares its storage with other tensors; give it a "
                      "storage of its own, or raise stage3_param_persistence_threshold past its ",
                      t.numel(), " elements");
      }
      // Build-then-shard, a unit at a time: the unit's whole weights go as soon as its chunk
      // is taken, so the peak is the whole model plus one unit's chunk state, not both whole.
      // From here on a unit's weights exist whole only around its forward and backward.
      groups_.back().live = true;
      live_elements_ += groups_.back().plan.numel();
      release(g);  // Note [Releasing a weight], in zero_gather.cpp
    }
  }
  if (offloaded) {
    // Every piece's first master from the values kept in memory (the shard, the values chunk,
    // or the weights themselves), written one at a time.
    offload::OffloadOptions store = options_.offload;
    store.pin_memory = store.pin_memory && device_.is_cuda();
    swap_ = std::make_unique<offload::SegmentSwap>(rule_, std::move(swap_segments), store);
    for (size_t i = 0; i < swapped_.size(); ++i) swap_->initialise(i, values_of(i));
  }
  if (options_.offload_param.device != "none") {
    // Note [Offloaded parameters]: every shard to its home (the file, one at a time, or the
    // host arena) and off the device; a GPU run, or its twin, gathers from fetched copies.
    std::vector<UnitShard*> units;
    for (auto& group : groups_)
      if (group.sharded) units.push_back(&group.unit);
    if (!units.empty())
      param_file_ = std::make_unique<ShardFile>(
          options_.offload_param, weight_dtype_, device_,
          device_.is_cuda() || options_.offload_param_twin, units);
  }
  unit_position_.assign(groups_.size(), 0);
  for (size_t k = 0; k < unit_order_.size(); ++k) unit_position_[unit_order_[k]] = k;
  for (size_t i = 0; i < params_.size(); ++i) {
    index_of_[params_[i].tensor.unsafeGetTensorImpl()] = i;
    whole_state_.push_back(
        whole_tensor_state_shapes(rule_, params_[i].name, tensors_[i].shape, params_[i].group));
  }
}

ZeroDriver::~ZeroDriver() = default;

std::string ZeroDriver::name() const { return "zero-" + std::to_string(options_.stage); }

std::string ZeroDriver::describe() const {
  int64_t numel = 0, padded = 0;
  for (const auto& group : groups_) {
    numel += group.plan.numel();
    padded += group.plan.chunk * world_;
  }
  std::ostringstream out;
  out.precision(3);
  out << "ZeRO stage " << options_.stage << " over " << world_ << " rank(s)";
  if (replica_comm_)  // Note [Hybrid sharding]
    out << " (shard group " << world_comm_.rank() / world_ << " of " << replicas_
        << " replicas; " << padded / world_ << " gradient elements all-reduced across them per step)";
  out << ": " << groups_.size()
      << " flat group(s) cut at " << rule_.name() << "'s granularity, " << numel
      << " trainable elements, " << padded / world_ << " per rank (padding "
      << 100.0 * static_cast<double>(padded - numel) / static_cast<double>(std::max<int64_t>(1, numel))
      << " %)"
      << (separate_master_ ? ", fp32 masters sharded"
          : rounded_       ? ", no masters (bf16 weights rounded stochastically)"
                           : "");
  if (swap_)
    out << (separate_master_ ? "; masters and state " : "; state ")
        << (swap_->in_host_memory() ? "in host memory" : "on NVMe")
        << ": " << swap_->describe();
  if (options_.stage == 3)
    out << "; weights sharded in " << unit_order_.size() << " unit(s), "
        << groups_.size() - unit_order_.size() << " group(s) kept whole";
  if (param_file_)
    out << "; the units' weight shards " << param_file_->describe();
  return out.str();
}

// ---- gradients ----

void ZeroDriver::zero_grad() {
  at::NoGradGuard no_grad;
  stats_.elements = 0;
  stats_.cross_group_elements = 0;
  stats_.shard_reads_ahead = 0;
  stats_.shard_wait_seconds = 0.0;
  // Every stage releases .grad and its gradient chunks (Note [Gradients released, not zeroed]
  // in core/src/step_driver.cpp): backward makes them again, so forward holds none. A stage-2/3
  // shard is made (zeros, then the first chunk added: the bits of the zeroed shard it was) when
  // its group first lands, as after Note [Updating chunks in backward] freed it.
  for (auto& p : params_) at::Tensor(p.tensor).mutable_grad() = at::Tensor();
  for (auto& group : groups_) group.grad = at::Tensor();
  // Note [Offloaded parameters]: the step's first unit is read while the step starts.
  if (param_file_ && options_.prefetch_elements > 0 && !unit_order_.empty())
    read_ahead(groups_[unit_order_.front()]);
}

std::vector<at::Tensor> ZeroDriver::grads() {
  std::vector<at::Tensor> out;
  for (auto& group : groups_)
    if (group.grad.defined()) out.push_back(group.grad);
  return out;
}

at::Tensor ZeroDriver::grad_norm_squared() {
  at::Tensor total;
  if (backward_update_.armed) {
    // Note [Updating chunks in backward]: the pieces' sums kept before their chunks were freed,
    // totalled as squared_norm totals them (stacked in parameter order, then summed).
    std::vector<at::Tensor> squares;
    for (const at::Tensor& square : backward_update_.squares)
      if (square.defined()) squares.push_back(square);
    total = squares.empty() ? at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_))
                            : at::stack(squares).sum();
  } else {
    // Per piece, in parameter order, as the default driver sums per tensor, so one rank
    // reproduces it bit for bit; then the sum over ranks.
    std::vector<std::pair<size_t, at::Tensor>> pieces;
    for (const auto& group : groups_) {
      if (!group.grad.defined()) continue;
      for (const Piece& piece : group.plan.ranks[rank_])
        pieces.emplace_back(piece.tensor, group.grad.narrow(0, piece.chunk_offset, piece.numel));
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<at::Tensor> grads;
    for (auto& [index, grad] : pieces) grads.push_back(grad);
    if (grads.empty()) {
      total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
    } else {
      total = squared_norm(grads);  // the default driver's sum, so every cut sums alike
    }
  }
  if (world_ > 1) {
    total = total.reshape({1}).to(comm_.device());
    comm_.all_reduce(total, ReduceOp::sum)->wait();
  }
  return total.to(device_).reshape({});
}

void ZeroDriver::scale_grads(double factor) {
  at::NoGradGuard no_grad;
  scale_gradients(grads(), factor);
}

// ---- update ----

void ZeroDriver::update(int64_t step, double lr) {
  at::NoGradGuard no_grad;
  if (backward_update_.armed) {  // Note [Updating chunks in backward]: the chunks are updated
    LOOM_INTERNAL_ASSERT(backward_update_.step == step && backward_update_.lr == lr &&
                             backward_update_.groups_updated == groups_.size(),
                         "ZeRO's update in backward: ", backward_update_.groups_updated, " of ",
                         groups_.size(), " groups updated at step ", backward_update_.step,
                         ", completed at step ", step);
    finish_values_gathers();
    backward_update_ = BackwardUpdate{};
    return;
  }
  // A prefetch nobody used (a unit a step did not reach) holds the old weights: drop it.
  for (auto& group : groups_) {
    if (group.gather_work) {
      group.gather_work->wait();
      group.gather_work.reset();
      group.gathering = at::Tensor();
    }
    if (param_file_) param_file_->drop_fetch(group.unit);  // a read ahead nobody gathered
  }
  if (swap_) run_rule_offloaded(step, lr);
  else run_rule(step, lr);
  all_gather_params();
  flush_resident();
  if (options_.stage == 1)
    for (auto& group : groups_) group.grad = at::Tensor();
}

}  // namespace loom::sharding
