// ZeRO stages 1 and 2. See zero_driver.h.
#include "loom/sharding/zero_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

#include "loom/error.h"
#include "loom/memory.h"
#include "loom/nn.h"

namespace loom::sharding {

using Clock = std::chrono::steady_clock;

namespace {

// Note [Diverged ranks]: the element after a stage-3 chunk carries its unit's position (half
// types: the element's bits as int16, exact to 32767 units).
void set_tag(at::Tensor& shard, int64_t chunk, int64_t position) {
  if (shard.element_size() == 2) shard.view(at::kShort)[chunk] = position;
  else shard[chunk] = position;
}

// A CPU tensor on memory aligned for O_DIRECT (the parameter swap file reads and writes it).
at::Tensor aligned_tensor(int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = offload::align_up(std::max<int64_t>(1, numel) * c10::elementSize(dtype));
  void* memory = nullptr;
  LOOM_CHECK(posix_memalign(&memory, offload::kAlignment, static_cast<size_t>(bytes)) == 0,
             "cannot allocate ", bytes, " bytes for a weight shard read from NVMe");
  return at::from_blob(memory, {numel}, [](void* p) { std::free(p); },
                       at::TensorOptions().dtype(dtype));
}

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
  separate_master_ = weight_dtype_ != at::kFloat;
  if (options_.offload_param.device == "nvme") {  // Note [Offloaded parameters]
    LOOM_CHECK_AS(ConfigError, options_.stage == 3, "[zero] offload_param offloads stage 3's "
                  "weight shards; set [zero] stage = 3");
    LOOM_CHECK_AS(ConfigError, separate_master_, "[zero] offload_param keeps half-precision "
                  "weight shards on NVMe and rebuilds them from the fp32 masters, but these "
                  "weights are ", c10::toString(weight_dtype_), "; use [precision] mode = "
                  "\"full_bf16\" (or \"full_fp16\")");
    LOOM_CHECK_AS(ConfigError, device_.is_cpu(), "[zero] offload_param on ", device_.str(),
                  " is not implemented yet (the shards would travel through pinned host "
                  "buffers); train on the CPU, or leave offload_param out");
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
  // nvme: the swap file; cpu: host memory (Note [Host store]), a GPU run's ZeRO-Offload.
  const bool offloaded = options_.offload.device == "nvme" || options_.offload.device == "cpu";
  std::vector<offload::SwapSegment> swap_segments;
  for (size_t m = 0; m < members.size(); ++m) {
    const auto& list = members[m];
    Group group;
    group.plan = plan_group(tensors_, list, rule_.partitioning(), world_);
    group.sharded = member_unit[m] != nullptr;
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
    if (options_.stage >= 2)
      group.grad = at::zeros({group.plan.chunk}, fp32.dtype(weight_dtype_));
    // Stage 3: the chunk, then one element that travels with every gather: the unit's position,
    // so a rank that gathered another unit is caught (Note [Diverged ranks]).
    if (group.sharded) {
      group.shard = at::zeros({group.plan.chunk + 1}, fp32.dtype(weight_dtype_));
      group.position = static_cast<int64_t>(unit_order_.size() - 1);
      set_tag(group.shard, group.plan.chunk, group.position);
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
      if (group.sharded) group.shard.narrow(0, piece.chunk_offset, piece.numel).copy_(flat);
      if (offloaded) {  // Note [Offloaded ZeRO]: the swap file holds its master and state
        if (group.values.defined())
          group.values.narrow(0, piece.chunk_offset, piece.numel).copy_(flat);
        offload::SwapSegment swapped;
        swapped.name = segment.name;
        swapped.shape = segment.shape;
        swapped.offset = segment.offset;
        swapped.numel = piece.numel;
        swapped.group = segment.group;
        if (!separate_master_ && device_.is_cpu())
          swapped.in_place = group.sharded ? group.shard.narrow(0, piece.chunk_offset, piece.numel)
                                           : flat;
        swap_segments.push_back(std::move(swapped));
        swapped_.emplace_back(groups_.size(), group.segments.size());
        group.segments.push_back(std::move(segment));
        continue;
      }
      if (separate_master_) {
        segment.param = group.master.narrow(0, piece.chunk_offset, piece.numel);
        segment.param.copy_(flat);
      } else if (group.sharded) {
        segment.param = group.shard.narrow(0, piece.chunk_offset, piece.numel);  // in place
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
      release(g);
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
  if (options_.offload_param.device == "nvme") {
    // Note [Offloaded parameters]: every shard to the file, one at a time, and out of memory.
    const int64_t element = static_cast<int64_t>(c10::elementSize(weight_dtype_));
    int64_t capacity = 0;
    for (const auto& group : groups_)
      if (group.sharded) capacity += offload::align_up((group.plan.chunk + 1) * element);
    if (capacity > 0) {
      param_file_ = std::make_unique<offload::SwapFile>(options_.offload_param.nvme, capacity);
      for (auto& group : groups_) {
        if (!group.sharded) continue;
        group.shard_region = param_file_->allocate((group.plan.chunk + 1) * element);
        at::Tensor aligned = aligned_tensor(group.plan.chunk + 1, weight_dtype_);
        aligned.copy_(group.shard);
        group.shard = aligned;
        flush(group);
      }
      for (auto& group : groups_) settle(group);
    }
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
      << " %)" << (separate_master_ ? ", fp32 masters sharded" : "");
  if (swap_)
    out << "; masters and state " << (swap_->in_host_memory() ? "in host memory" : "on NVMe")
        << ": " << swap_->describe();
  if (options_.stage == 3)
    out << "; weights sharded in " << unit_order_.size() << " unit(s), "
        << groups_.size() - unit_order_.size() << " group(s) kept whole";
  if (param_file_)
    out << "; the units' weight shards on NVMe (" << param_file_->file() << ")";
  return out.str();
}

// ---- gradients ----

void ZeroDriver::pack(Group& group, size_t index, const at::Tensor& grad) {
  const int64_t chunk = group.plan.chunk;
  if (!group.send.defined())
    group.send = at::zeros({chunk * world_}, at::TensorOptions().dtype(at::kFloat).device(device_));
  if (!grad.defined()) return;  // unused this backward: its elements stay zero
  at::Tensor flat = grad.reshape(-1);
  for (const Placement& where : placements_[index])
    group.send.narrow(0, where.rank * chunk + where.piece.chunk_offset, where.piece.numel)
        .copy_(flat.narrow(0, where.piece.offset, where.piece.numel));
}

void ZeroDriver::grad_ready(const Param& param) {
  auto found = index_of_.find(param.tensor.unsafeGetTensorImpl());
  LOOM_INTERNAL_ASSERT(found != index_of_.end(), "grad_ready for unknown parameter ", param.name);
  const size_t index = found->second;
  if (ready_[index]) return;
  ready_[index] = true;
  if (!backward_open_) {  // this backward's first gradient: its statistics start here
    backward_open_ = true;
    stats_.comm_seconds = stats_.exposed_seconds = 0.0;
  }
  Group& group = groups_[group_of_[index]];
  at::NoGradGuard no_grad;
  pack(group, index, param.tensor.grad());
  // Stages 2 and 3 hold no whole gradient: once in its bucket, .grad goes.
  if (options_.stage >= 2) at::Tensor(param.tensor).mutable_grad() = at::Tensor();
  if (--group.pending == 0) {
    if (options_.overlap) launch(group_of_[index]);
    if (group.sharded) release(group_of_[index]);  // backward is done with this unit
  }
}

void ZeroDriver::launch(size_t g) {
  Group& group = groups_[g];
  group.received = at::empty({group.plan.chunk}, group.send.options());
  group.launched = Clock::now();
  group.work = comm_.reduce_scatter(group.received, group.send, ReduceOp::sum);
  group.launched_this_backward = true;
  stats_.elements += group.send.numel();
  flying_.push_back(g);
  flying_bytes_ += bucket_bytes(group);
  land_finished();
}

// Note [Bucket memory]: a launched group holds its send buffer (world x chunk fp32: the
// group's whole gradient) and its received chunk until it lands. Landing them all after
// backward would hold the model's whole fp32 gradient at backward's end, which is what stages
// 2 and 3 exist to avoid. So groups land in launch order as they go: any that finished, and,
// past kBucketsInFlight reduce buckets in flight (send and received counted), the oldest even
// if it has not (backward then waits on it, which the exposed-communication metric shows).
// Two buckets starved gloo on 2 CPU cores (16 % of the reduction hidden, against 66 % with no
// cap; docs/BENCHMARKS.md); four is DeepSpeed's order too (its overlap_comm documents about
// 4.5 x reduce_bucket_size).
constexpr int64_t kBucketsInFlight = 4;

int64_t ZeroDriver::bucket_bytes(const Group& group) {
  return group.send.nbytes() + group.received.nbytes();
}

void ZeroDriver::land_finished() {
  while (!flying_.empty()) {
    Group& oldest = groups_[flying_.front()];
    const bool over =
        flying_bytes_ > kBucketsInFlight * options_.reduce_bucket_bytes && flying_.size() > 1;
    if (!over && !oldest.work->completed()) break;
    flying_bytes_ -= bucket_bytes(oldest);
    flying_.pop_front();
    land(oldest);
  }
}

void ZeroDriver::land(Group& group) {
  const auto waited = Clock::now();
  group.work->wait();
  const auto done = Clock::now();
  stats_.exposed_seconds += std::chrono::duration<double>(done - waited).count();
  stats_.comm_seconds += std::chrono::duration<double>(done - group.launched).count();
  // The engine scaled each rank's loss by world / global targets: the average is the gradient
  // (over every rank, the other shard groups' part added by reduce_across_replicas).
  group.received.div_(world_comm_.world_size());
  const size_t g = static_cast<size_t>(&group - groups_.data());
  if (replica_comm_ && window_end_) {
    // Note [Hybrid sharding]: the window's chunk so far plus this one, in fp32, across groups.
    at::Tensor sum = group.received;
    if (options_.stage >= 2) sum = group.grad.to(at::kFloat).add_(group.received);
    launch_across_replicas(g, std::move(sum));
  } else if (options_.stage >= 2) {
    group.grad.add_(group.received);
  } else {
    // Stage 1: the window's whole gradient arrives at once, kept in the weights' dtype as the
    // unsharded driver keeps .grad (so both update from the same values).
    group.grad = weight_dtype_ == at::kFloat ? group.received : group.received.to(weight_dtype_);
  }
  group.work.reset();
  group.send = at::Tensor();
  group.received = at::Tensor();
  group.pending = group.plan.tensors.size();
}

void ZeroDriver::finish_backward(bool window_end) {
  at::NoGradGuard no_grad;
  if (!backward_open_) stats_.comm_seconds = stats_.exposed_seconds = 0.0;
  backward_open_ = false;
  // Every rank launches every group, in the same order: parameters without a gradient this
  // backward count as zeros.
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& group = groups_[g];
    if (group.launched_this_backward) continue;
    for (size_t index : group.plan.tensors)
      if (!ready_[index]) {
        pack(group, index, at::Tensor());
        if (options_.stage >= 2) at::Tensor(params_[index].tensor).mutable_grad() = at::Tensor();
      }
    launch(g);
  }
  for (size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].sharded) release(g);
  in_backward_ = false;
  for (; !flying_.empty(); flying_.pop_front()) land(groups_[flying_.front()]);
  flying_bytes_ = 0;
  for (auto& group : groups_) group.launched_this_backward = false;
  std::fill(ready_.begin(), ready_.end(), false);
  LOOM_INTERNAL_ASSERT(!replica_comm_ || window_end == window_end_, "hybrid sharding: the zero "
                       "plugin's begin_backward and finish_backward disagree on the window's end");
  if (window_end) reduce_across_replicas();
}

// Note [Hybrid sharding]: `sum` (fp32; for fp32 stage-2 chunks, the chunk itself) is summed
// over the replica Comm in flight; past kBucketsInFlight reduce buckets of them, the oldest
// lands first (Note [Bucket memory]).
void ZeroDriver::launch_across_replicas(size_t g, at::Tensor sum) {
  Group& group = groups_[g];
  LOOM_INTERNAL_ASSERT(!group.across_work, "a chunk sent across groups twice in one backward");
  group.across = sum.to(replica_comm_->device());
  group.across_work = replica_comm_->all_reduce(group.across, ReduceOp::sum);
  stats_.elements += group.across.numel();
  stats_.cross_group_elements += group.across.numel();
  across_flying_.push_back(g);
  across_bytes_ += group.across.nbytes();
  while (across_bytes_ > kBucketsInFlight * options_.reduce_bucket_bytes &&
         across_flying_.size() > 1) {
    land_across(across_flying_.front());
    across_flying_.pop_front();
  }
}

void ZeroDriver::land_across(size_t g) {
  Group& group = groups_[g];
  const auto waited = Clock::now();
  group.across_work->wait();
  stats_.exposed_seconds += std::chrono::duration<double>(Clock::now() - waited).count();
  at::Tensor sum = group.across.to(device_);
  if (options_.stage == 1) {
    group.grad = sum.to(weight_dtype_);  // the dtype the update reads, as without groups
  } else if (!sum.is_same(group.grad)) {
    group.grad.copy_(sum);
  }
  across_bytes_ -= group.across.nbytes();
  group.across = at::Tensor();
  group.across_work.reset();
}

void ZeroDriver::reduce_across_replicas() {
  for (; !across_flying_.empty(); across_flying_.pop_front()) land_across(across_flying_.front());
  across_bytes_ = 0;
}

void ZeroDriver::zero_grad() {
  at::NoGradGuard no_grad;
  stats_.elements = 0;
  stats_.cross_group_elements = 0;
  stats_.shard_reads_ahead = 0;
  stats_.shard_wait_seconds = 0.0;
  if (options_.stage == 1) {
    std::vector<at::Tensor> grads;
    for (auto& p : params_)
      if (p.tensor.grad().defined()) grads.push_back(p.tensor.grad());
    if (!grads.empty()) at::_foreach_zero_(grads);
    for (auto& group : groups_) group.grad = at::Tensor();
  } else {
    for (auto& p : params_) at::Tensor(p.tensor).mutable_grad() = at::Tensor();
    for (auto& group : groups_) group.grad.zero_();
  }
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
  at::Tensor total;
  if (grads.empty()) {
    total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  } else {
    total = squared_norm(grads);  // the default driver's sum, so every cut sums alike
  }
  if (world_ > 1) {
    total = total.reshape({1}).to(comm_.device());
    comm_.all_reduce(total, ReduceOp::sum)->wait();
  }
  return total.to(device_).reshape({});
}

void ZeroDriver::scale_grads(double factor) {
  at::NoGradGuard no_grad;
  auto all = grads();
  if (!all.empty()) at::_foreach_mul_(all, factor);
}

// ---- stage 3: whole weights around a unit's forward and backward ----

// Note [Releasing a weight]: a released parameter keeps its shape, its autograd identity and
// its storage object; only the storage's bytes go (FSDP's resize-to-zero). Autograd's saved
// tensors of the unit (the weight, or views of it such as w.t()) share that storage, so the
// forward's saved views hold no copy of the weights, and see them again once the backward
// hook has gathered them into the same storage; gradient accumulators, built from the
// parameter's shape, never see a shape of 0. A read of a released weight finds no bytes.
namespace {

void free_storage(const at::Tensor& tensor) { nn::release_storage(tensor); }
void restore_storage(const at::Tensor& tensor) { nn::restore_storage(tensor); }

}  // namespace

void ZeroDriver::start_gather(Group& group) {
  if (param_file_) {  // Note [Offloaded parameters]
    const auto waited = Clock::now();
    make_resident(group, /*read=*/true);
    stats_.shard_wait_seconds += std::chrono::duration<double>(Clock::now() - waited).count();
  }
  // Half types travel as bytes: every backend moves those bit for bit (gloo has no int16).
  const at::Tensor values = group.shard.element_size() == 2 ? group.shard.view(at::kByte)
                                                             : group.shard;
  group.gathering = at::empty({values.numel() * world_}, values.options());
  group.gather_work = comm_.all_gather(group.gathering, values);
  stats_.elements += group.shard.numel() * world_;
}

void ZeroDriver::gather(size_t g) {
  Group& group = groups_[g];
  if (group.live) return;
  at::NoGradGuard no_grad;
  if (!group.gather_work) start_gather(group);
  try {
    group.gather_work->wait();
  } catch (const Error& error) {
    throw Error(detail::cat(
        "rank ", rank_, ": ZeRO stage 3 could not gather the weights of unit ",
        unit_position_[g], " (", params_[group.plan.tensors.front()].name, "...): ", error.what(),
        "; every rank must run the same units in the same order (did one rank skip a forward?)"));
  }
  const bool half = c10::elementSize(weight_dtype_) == 2;
  const at::Tensor values = half ? group.gathering.view(weight_dtype_) : group.gathering;
  const int64_t chunk = group.plan.chunk;
  // Note [Diverged ranks]: every rank's chunk ends with the position of the unit it sent. A
  // rank that skipped a unit's forward (or ran units in another order) sends another unit's
  // chunk in this collective; same-sized units would otherwise mix silently.
  const at::Tensor sent = (half ? group.gathering.view(at::kShort) : group.gathering)
                             .view({world_, chunk + 1})
                             .select(1, chunk)
                             .to(at::kLong)
                             .cpu();
  for (int r = 0; r < world_; ++r) {
    const int64_t unit = sent[r].item<int64_t>();
    LOOM_CHECK(unit == static_cast<int64_t>(unit_position_[g]), "rank ", rank_,
               ": ZeRO stage 3 gathered the weights of unit ", unit_position_[g],
               " but rank ", r, " sent those of unit ", unit,
               ": the ranks diverged (did one rank skip a forward, or run its units in another "
               "order?); every rank must run the same units in the same order");
  }
  for (size_t index : group.plan.tensors) {
    const at::Tensor& param = params_[index].tensor;
    restore_storage(param);
    // A view of the bytes with a version counter of its own: filling them is no in-place
    // change that autograd's saved tensors of this weight should notice (they wait for it).
    at::Tensor flat = at::from_blob(param.data_ptr(), {param.numel()}, param.options());
    for (const Placement& where : placements_[index])
      flat.narrow(0, where.piece.offset, where.piece.numel)
          .copy_(values.narrow(0, where.rank * (chunk + 1) + where.piece.chunk_offset,
                               where.piece.numel));
  }
  group.gathering = at::Tensor();
  group.gather_work.reset();
  if (param_file_) group.shard = at::Tensor();  // unchanged: nothing to write back
  group.live = true;
  live_elements_ += group.plan.numel();
}

void ZeroDriver::release(size_t g) {
  Group& group = groups_[g];
  if (!group.live) return;
  for (size_t index : group.plan.tensors) free_storage(params_[index].tensor);
  group.live = false;
  live_elements_ -= group.plan.numel();
}

void ZeroDriver::gather_unit(const void* unit, bool forward) {
  auto found = unit_group_.find(unit);
  if (found == unit_group_.end()) return;
  const size_t g = found->second;
  if (!forward) in_backward_ = true;
  gather(g);
  // Prefetch the unit that runs next (forward) or whose backward comes next. A forward during
  // backward is activation checkpointing's recompute: the next unit's backward came before.
  const size_t position = unit_position_[g];
  if (options_.prefetch_elements <= 0 || (forward && in_backward_)) return;
  const bool has_next = forward ? position + 1 < unit_order_.size() : position > 0;
  if (!has_next) return;
  Group& next = groups_[unit_order_[forward ? position + 1 : position - 1]];
  if (next.live || next.gather_work || next.shard_ticket >= 0 ||
      next.plan.numel() > options_.prefetch_elements ||
      live_elements_ + next.plan.numel() > options_.max_live_elements)
    return;
  at::NoGradGuard no_grad;
  if (param_file_) read_ahead(next);  // Note [Offloaded parameters]
  else start_gather(next);
}

void ZeroDriver::gather_all_weights() {
  for (size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].sharded) gather(g);
}

void ZeroDriver::release_unit(const void* unit) {
  auto found = unit_group_.find(unit);
  if (found == unit_group_.end()) return;
  const size_t g = found->second;
  release(g);
  // Note [Offloaded parameters]: backward starts with the last unit, just released; its shard
  // is read while the loss and the head run.
  if (param_file_ && options_.prefetch_elements > 0 && !in_backward_ &&
      at::GradMode::is_enabled() && unit_position_[g] + 1 == unit_order_.size())
    read_ahead(groups_[g]);
}

// ---- update ----

void ZeroDriver::run_rule(int64_t step, double lr) {
  struct Held {
    Segment* segment;
    size_t param;
  };
  std::vector<Held> held;
  std::vector<at::Tensor> fp32_grads;  // keep the converted chunks alive during the update
  for (auto& group : groups_) {
    LOOM_INTERNAL_ASSERT(group.grad.defined(), "ZeRO update without a reduced gradient");
    at::Tensor grad = group.grad.scalar_type() == at::kFloat ? group.grad : group.grad.to(at::kFloat);
    fp32_grads.push_back(grad);
    for (size_t k = 0; k < group.segments.size(); ++k) {
      // Segment k is this rank's piece k (the constructor made them in that order).
      const Piece& piece = group.plan.ranks[rank_][k];
      Segment& segment = group.segments[k];
      segment.grad = grad.narrow(0, piece.chunk_offset, piece.numel);
      held.push_back({&segment, piece.tensor});
    }
  }
  auto context_of = [&](size_t index) {
    return update_context(params_[index], step, lr, weight_decay_);
  };
  const int rounds = rule_.reduction_rounds();
  if (rounds == 0) {
    // As the default driver: segments sharing lr and weight decay go to the rule together.
    std::map<std::pair<double, double>, std::vector<Segment*>> batches;
    for (const Held& h : held) {
      const auto context = context_of(h.param);
      batches[{context.lr, context.weight_decay}].push_back(h.segment);
    }
    for (auto& [key, segments] : batches) {
      UpdateContext context;
      context.step = step;
      context.lr = key.first;
      context.weight_decay = key.second;
      rule_.update_many(segments, context);
    }
  } else {
    // Whole-tensor statistics: every rank folds its pieces into a zero accumulator per tensor,
    // the accumulators of all tensors go into one all-reduce per round, and each piece is then
    // updated with its tensor's totals (UpdateRule::reduction_rounds).
    std::vector<Segment*> mine(params_.size(), nullptr);
    for (const Held& h : held) mine[h.param] = h.segment;
    std::vector<UpdateContext> contexts;
    for (size_t i = 0; i < params_.size(); ++i) contexts.push_back(context_of(i));
    for (int round = 0; round < rounds; ++round) {
      std::vector<at::Tensor> accumulators;
      for (size_t i = 0; i < params_.size(); ++i) {
        at::Tensor accumulator =
            mine[i] ? rule_.make_accumulator(*mine[i], round) : empty_accumulator(i, round);
        if (mine[i]) rule_.accumulate(*mine[i], contexts[i], round, accumulator);
        accumulators.push_back(accumulator);
      }
      reduce_accumulators(accumulators);
      for (size_t i = 0; i < params_.size(); ++i) contexts[i].totals.push_back(accumulators[i]);
    }
    for (const Held& h : held) rule_.update(*h.segment, contexts[h.param]);
  }
  for (const Held& h : held) h.segment->grad = at::Tensor();
}

at::Tensor ZeroDriver::empty_accumulator(size_t index, int round) const {
  Segment stand_in;  // no piece of the tensor here: the accumulator's shape, nothing to add
  stand_in.name = params_[index].name;
  stand_in.shape = tensors_[index].shape;
  stand_in.group = params_[index].group;
  // Where the rank's own pieces are: offloaded ones in the swap file's (CPU) buffers.
  const c10::Device on = swap_ ? c10::Device(c10::kCPU) : device_;
  stand_in.param = at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(on));
  stand_in.grad = at::empty({0}, stand_in.param.options());
  return rule_.make_accumulator(stand_in, round);
}

void ZeroDriver::reduce_accumulators(std::vector<at::Tensor>& accumulators) {
  if (world_ == 1) return;
  std::vector<at::Tensor> flat;
  for (const auto& a : accumulators) flat.push_back(a.reshape(-1).to(comm_.device()));
  at::Tensor all = at::cat(flat);
  comm_.all_reduce(all, ReduceOp::sum)->wait();
  int64_t at = 0;
  for (auto& a : accumulators) {
    a.copy_(all.narrow(0, at, a.numel()).view(a.sizes()));
    at += a.numel();
  }
}

at::Tensor ZeroDriver::values_of(size_t i) const {
  const auto [g, k] = swapped_[i];
  const Group& group = groups_[g];
  const Piece& piece = group.plan.ranks[rank_][k];
  if (group.sharded) return group.shard.narrow(0, piece.chunk_offset, piece.numel);
  if (group.values.defined()) return group.values.narrow(0, piece.chunk_offset, piece.numel);
  return params_[piece.tensor].tensor.detach().view(-1).narrow(0, piece.offset, piece.numel);
}

at::Tensor ZeroDriver::read_shard(const Group& group) const {
  at::Tensor shard = aligned_tensor(group.plan.chunk + 1, weight_dtype_);
  param_file_->wait(param_file_->read(group.shard_region, shard.data_ptr()));
  return shard;
}

void ZeroDriver::read_ahead(Group& group) {
  if (!param_file_ || group.shard.defined()) return;
  group.shard = aligned_tensor(group.plan.chunk + 1, weight_dtype_);
  group.shard_ticket = param_file_->read(group.shard_region, group.shard.data_ptr());
  group.shard_writing = false;
  stats_.shard_reads_ahead += 1;
}

void ZeroDriver::settle(Group& group) {
  if (group.shard_ticket < 0) return;
  const int64_t ticket = group.shard_ticket;
  const bool writing = group.shard_writing;
  group.shard_ticket = -1;
  group.shard_writing = false;
  if (writing) std::erase(shard_writes_, static_cast<size_t>(&group - groups_.data()));
  try {
    param_file_->wait(ticket);
  } catch (...) {
    group.shard = at::Tensor();  // half read (nobody may use it) or not written
    throw;
  }
  if (writing) group.shard = at::Tensor();  // the file holds it now
}

void ZeroDriver::make_resident(Group& group, bool read) {
  if (!param_file_) return;
  settle(group);
  if (group.shard.defined()) return;
  if (read) {
    group.shard = read_shard(group);
  } else {
    group.shard = aligned_tensor(group.plan.chunk + 1, weight_dtype_);
    group.shard.zero_();
    set_tag(group.shard, group.plan.chunk, group.position);
  }
}

// Note [Offloaded parameters]: a few writes fly at once, so the walk goes on while they land
// without every unit's shard piling up in memory when the disk is slower than the walk.
constexpr size_t kShardWritesInFlight = 2;

void ZeroDriver::flush(Group& group) {
  if (!param_file_ || !group.shard.defined() || group.shard_writing) return;
  settle(group);  // a read ahead still landing (its bytes are the file's: rewriting is harmless)
  while (shard_writes_.size() >= kShardWritesInFlight) settle(groups_[shard_writes_.front()]);
  group.shard_ticket = param_file_->write(group.shard_region, group.shard.data_ptr());
  group.shard_writing = true;
  shard_writes_.push_back(static_cast<size_t>(&group - groups_.data()));
}

void ZeroDriver::flush_resident() {
  // With offload_param a prefetch reads ahead instead of gathering: no gather is in flight here.
  for (auto& group : groups_)
    if (group.sharded) flush(group);
  for (auto& group : groups_) settle(group);
}

// Note [Offloaded ZeRO]: the same rule calls as run_rule, one segment at a time as the walk
// brings them in (the rules are elementwise or blockwise within a segment, so the result does
// not depend on how segments are batched).
void ZeroDriver::run_rule_offloaded(int64_t step, double lr) {
  std::vector<at::Tensor> grads(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const at::Tensor& grad = groups_[g].grad;
    LOOM_INTERNAL_ASSERT(grad.defined(), "ZeRO update without a reduced gradient");
    grads[g] = grad.scalar_type() == at::kFloat && grad.is_cpu() ? grad : grad.to(at::kCPU, at::kFloat);
  }
  auto piece_of = [&](size_t i) -> const Piece& {
    return groups_[swapped_[i].first].plan.ranks[rank_][swapped_[i].second];
  };
  auto with_grad = [&](size_t i, Segment& segment) {
    const Piece& piece = piece_of(i);
    segment.grad = grads[swapped_[i].first].narrow(0, piece.chunk_offset, piece.numel);
  };
  size_t open_group = groups_.size();  // offload_param: the group whose shard is being filled
  auto store = [&](size_t i, const Segment& segment) {
    if (!swap_->separate_master(i)) return;
    const size_t g = swapped_[i].first;
    if (param_file_ && groups_[g].sharded) {
      // Note [Offloaded parameters]: the shard is rebuilt whole from the masters; the last
      // unit's goes to the file as soon as the walk leaves it.
      if (open_group != g && open_group < groups_.size()) flush(groups_[open_group]);
      open_group = g;
      make_resident(groups_[g], /*read=*/false);
    }
    values_of(i).copy_(segment.param);
  };
  std::vector<UpdateContext> contexts;
  for (size_t i = 0; i < params_.size(); ++i)
    contexts.push_back(update_context(params_[i], step, lr, weight_decay_));
  if (rule_.reduction_rounds() == 0) {
    swap_->walk([&](size_t i, Segment& segment) {
      with_grad(i, segment);
      const UpdateContext& context = contexts[piece_of(i).tensor];
      rule_.update_many({&segment}, context);
      store(i, segment);
      return true;
    });
    return;
  }
  for (int round = 0; round < rule_.reduction_rounds(); ++round) {
    std::vector<at::Tensor> accumulators(params_.size());
    swap_->walk([&](size_t i, Segment& segment) {  // reading only
      with_grad(i, segment);
      const size_t index = piece_of(i).tensor;
      accumulators[index] = rule_.make_accumulator(segment, round);
      rule_.accumulate(segment, contexts[index], round, accumulators[index]);
      return false;
    });
    for (size_t i = 0; i < params_.size(); ++i)
      if (!accumulators[i].defined()) accumulators[i] = empty_accumulator(i, round);
    reduce_accumulators(accumulators);
    for (size_t i = 0; i < params_.size(); ++i) contexts[i].totals.push_back(accumulators[i]);
  }
  swap_->walk([&](size_t i, Segment& segment) {
    with_grad(i, segment);
    rule_.update(segment, contexts[piece_of(i).tensor]);
    store(i, segment);
    return true;
  });
}

at::Tensor ZeroDriver::chunk_values(const Group& group) const {
  if (group.values.defined()) return group.values;
  if (separate_master_) return group.master.to(weight_dtype_);
  at::Tensor out =
      at::zeros({group.plan.chunk}, at::TensorOptions().dtype(weight_dtype_).device(device_));
  for (const Piece& piece : group.plan.ranks[rank_])
    out.narrow(0, piece.chunk_offset, piece.numel)
        .copy_(params_[piece.tensor].tensor.detach().view(-1).narrow(0, piece.offset, piece.numel));
  return out;
}

void ZeroDriver::all_gather_params() {
  at::NoGradGuard no_grad;
  struct InFlight {
    size_t group;
    at::Tensor gathered;
    std::shared_ptr<Work> work;
    int64_t bytes;
  };
  std::deque<InFlight> flying;
  int64_t bytes_in_flight = 0;
  const bool half = c10::elementSize(weight_dtype_) == 2;
  auto finish = [&](InFlight& f) {
    f.work->wait();
    const Group& group = groups_[f.group];
    at::Tensor values = half ? f.gathered.view(weight_dtype_) : f.gathered;
    for (size_t index : group.plan.tensors) {
      at::Tensor flat = params_[index].tensor.detach().view(-1);
      for (const Placement& where : placements_[index])
        flat.narrow(0, where.piece.offset, where.piece.numel)
            .copy_(values.narrow(0, where.rank * group.plan.chunk + where.piece.chunk_offset,
                                 where.piece.numel));
    }
    bytes_in_flight -= f.bytes;
  };
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].sharded) {  // stage 3: the chunk is the weights; gathered at the next use
      if (groups_[g].master.defined()) {  // offloaded masters wrote their shard already
        make_resident(groups_[g], /*read=*/false);
        groups_[g].shard.narrow(0, 0, groups_[g].plan.chunk).copy_(groups_[g].master);
        flush(groups_[g]);
      }
      continue;
    }
    at::Tensor values = chunk_values(groups_[g]);
    stats_.elements += values.numel() * world_;
    // Half types travel as bytes: every backend moves those bit for bit (gloo has no int16).
    if (half) values = values.view(at::kByte);
    InFlight f{g, at::empty({values.numel() * world_}, values.options()), nullptr,
               values.numel() * world_ * static_cast<int64_t>(values.element_size())};
    f.work = comm_.all_gather(f.gathered, values);
    bytes_in_flight += f.bytes;
    flying.push_back(std::move(f));
    while (bytes_in_flight > options_.allgather_bucket_bytes && flying.size() > 1) {
      finish(flying.front());
      flying.pop_front();
    }
  }
  for (auto& f : flying) finish(f);
}

void ZeroDriver::update(int64_t step, double lr) {
  at::NoGradGuard no_grad;
  // A prefetch nobody used (a unit a step did not reach) holds the old weights: drop it.
  for (auto& group : groups_) {
    if (group.gather_work) {
      group.gather_work->wait();
      group.gather_work.reset();
      group.gathering = at::Tensor();
    }
    if (group.shard_ticket >= 0) {  // a read ahead nobody gathered
      settle(group);
      group.shard = at::Tensor();
    }
  }
  if (swap_) run_rule_offloaded(step, lr);
  else run_rule(step, lr);
  all_gather_params();
  flush_resident();
  if (options_.stage == 1)
    for (auto& group : groups_) group.grad = at::Tensor();
}

// ---- checkpoints and bytes ----

void ZeroDriver::add_pieces(size_t g, size_t k, const Segment& segment, StatePieces& out) const {
  const size_t index = groups_[g].plan.ranks[rank_][k].tensor;
  const int64_t n = segment.param.numel(), numel = tensors_[index].numel();
  for (const auto& [key, tensor] : segment.state) {
    const at::Tensor* whole = nullptr;
    for (const auto& [wkey, wtensor] : whole_state_[index])
      if (wkey == key) whole = &wtensor;
    LOOM_INTERNAL_ASSERT(whole, "rule ", rule_.name(), " made state '", key,
                         "' for a piece but not for the whole tensor");
    out.push_back(state_piece("state/" + segment.name + "/" + key, tensor, *whole, segment.offset,
                              n, numel));
  }
  if (separate_master_)
    out.push_back({"master/" + segment.name, segment.param, {numel}, segment.offset});
}

StatePieces ZeroDriver::state_pieces() const {
  StatePieces out;
  // Note [Hybrid sharding]: the other groups hold copies of group 0's pieces.
  if (world_comm_.rank() >= world_) return out;
  if (swap_) {
    // Note [Offloaded ZeRO]: streamed, each piece read from the file when the checkpoint writer
    // reaches it (add_pieces makes the state pieces in the segment's order, then the master).
    const offload::SegmentSwap* swap = swap_.get();
    for (size_t i = 0; i < swapped_.size(); ++i) {
      const Segment meta = swap->meta_segment(i);
      StatePieces pieces;
      add_pieces(swapped_[i].first, swapped_[i].second, meta, pieces);
      size_t at = 0;
      for (const auto& [key, tensor] : meta.state)
        pieces.at(at++).load = [swap, i, key = key] { return swap->read(i, key); };
      if (separate_master_) pieces.at(at++).load = [swap, i] { return swap->read(i, ""); };
      LOOM_INTERNAL_ASSERT(at == pieces.size(), "offloaded pieces out of step");
      for (auto& piece : pieces) out.push_back(std::move(piece));
    }
  } else {
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t k = 0; k < groups_[g].segments.size(); ++k)
        add_pieces(g, k, groups_[g].segments[k], out);
  }
  // Stage 3: the weights exist only as chunks (with offload_param, in the file: streamed).
  for (const auto& group : groups_) {
    if (!group.sharded) continue;
    for (const Piece& piece : group.plan.ranks[rank_]) {
      StatePiece out_piece{"weight/" + params_[piece.tensor].name, at::Tensor(),
                           {tensors_[piece.tensor].numel()}, piece.offset,
                           tensors_[piece.tensor].shape};
      if (param_file_ && !group.shard.defined()) {
        out_piece.tensor = at::empty({piece.numel}, at::TensorOptions().dtype(weight_dtype_).device(c10::kMeta));
        out_piece.load = [this, from = &group, piece] {
          return read_shard(*from).narrow(0, piece.chunk_offset, piece.numel).clone();
        };
      } else {
        out_piece.tensor = group.shard.narrow(0, piece.chunk_offset, piece.numel);
      }
      out.push_back(std::move(out_piece));
    }
  }
  return out;
}

void ZeroDriver::load_state(StateReader& reader) {
  at::NoGradGuard no_grad;
  auto read = [&](const StatePiece& piece) {
    at::Tensor into = piece.tensor;
    reader.read(piece.name, piece.global_shape, piece.offset, into);
  };
  // Stage 3's weight pieces first (into shards read back from the file with offload_param):
  // the masters, where the weights have them, then overwrite the shards with their own values,
  // as all_gather_params does.
  for (auto& group : groups_)
    if (group.sharded) {
      make_resident(group, /*read=*/true);
      for (const Piece& piece : group.plan.ranks[rank_])
        read({"weight/" + params_[piece.tensor].name,
              group.shard.narrow(0, piece.chunk_offset, piece.numel),
              {tensors_[piece.tensor].numel()}, piece.offset});
    }
  if (swap_) {
    // Streams: each segment read into a buffer, filled from the checkpoint, written back.
    swap_->each([&](size_t i, Segment& segment) {
      StatePieces pieces;
      add_pieces(swapped_[i].first, swapped_[i].second, segment, pieces);
      for (const auto& piece : pieces) read(piece);
      if (swap_->separate_master(i)) values_of(i).copy_(segment.param);
      return true;
    });
  } else {
    StatePieces pieces;
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t k = 0; k < groups_[g].segments.size(); ++k)
        add_pieces(g, k, groups_[g].segments[k], pieces);
    for (const auto& piece : pieces) read(piece);
  }
  // Pieces other ranks hold are theirs to read; anything no rank of this job has a place for
  // is an error on every rank.
  std::set<std::string> expected;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& [key, tensor] : whole_state_[i])
      expected.insert("state/" + params_[i].name + "/" + key);
    if (separate_master_) expected.insert("master/" + params_[i].name);
  }
  for (const auto& name : reader.unread())
    LOOM_CHECK_AS(CheckpointError, expected.count(name), reader.where(),
                  " holds optimizer state '", name,
                  "' that this job has no place for; it belongs to another model or optimizer");
  // The masters are the weights' truth: every rank's weights from the loaded chunks (stage 3's
  // chunks from the masters).
  if (separate_master_) all_gather_params();
  flush_resident();
}

int64_t ZeroDriver::state_bytes() const {
  if (swap_) return swap_->buffer_bytes();  // what stays in host memory (buffers or the arena)
  int64_t bytes = 0;
  for (const auto& group : groups_)
    for (const auto& segment : group.segments)
      for (const auto& [key, tensor] : segment.state) bytes += tensor.numel() * tensor.element_size();
  return bytes;
}

int64_t ZeroDriver::master_bytes() const {
  int64_t bytes = 0;
  for (const auto& group : groups_)
    if (group.master.defined()) bytes += group.master.numel() * 4;
    else if (group.values.defined()) bytes += group.values.nbytes();  // offloaded masters' values
  return bytes;
}

std::vector<std::string> ZeroDriver::sharded_weights() const {
  std::vector<std::string> names;
  for (const auto& group : groups_)
    if (group.sharded)
      for (size_t index : group.plan.tensors) names.push_back(params_[index].name);
  return names;
}

int64_t ZeroDriver::sharded_weight_bytes() const {
  int64_t bytes = 0;
  for (const auto& group : groups_)
    // offload_param: only the shards in memory now (between steps, none).
    if (group.sharded && group.shard.defined()) bytes += group.shard.nbytes();
  return bytes;
}

int64_t ZeroDriver::grad_bytes() const {
  if (options_.stage == 1) return -1;  // whole gradients in .grad, as without ZeRO
  int64_t bytes = 0;
  for (const auto& group : groups_) bytes += group.grad.numel() * group.grad.element_size();
  return bytes;
}

}  // namespace loom::sharding
