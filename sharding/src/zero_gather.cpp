// ZeRO stage 3's units: a unit's weights all-gathered from the ranks' shards around its forward
// and backward (the next one prefetched) and released after; and, after every update, the new
// values of the groups kept whole all-gathered into the parameters. Part of ZeroDriver
// (zero_driver.h); the shards' swap file is ShardFile's (shard_file.h).
#include "loom/sharding/zero_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <deque>

#include "loom/error.h"
#include "loom/nn.h"

namespace loom::sharding {

using Clock = std::chrono::steady_clock;

// Note [Releasing a weight]: a released parameter keeps its shape, its autograd identity and
// its storage object; only the storage's bytes go (FSDP's resize-to-zero). Autograd's saved
// tensors of the unit (the weight, or views of it such as w.t()) share that storage, so the
// forward's saved views hold no copy of the weights, and see them again once the backward
// hook has gathered them into the same storage; gradient accumulators, built from the
// parameter's shape, never see a shape of 0. A read of a released weight finds no bytes.
namespace {

void free_storage(const at::Tensor& tensor) { nn::release_storage(tensor); }
void restore_storage(const at::Tensor& tensor) { nn::restore_storage(tensor); }

// Note [Gathering without gloo's copy]: LibTorch's gloo all-gather (_allgather_base) gathers
// into a flat tensor of its own, of the output's size, and copies it into the output when done:
// while a unit's gather is in flight (the prefetched one, all through the computing unit's
// forward or backward) a second copy of the whole unit exists. Measured on the 2-rank stand-in
// of docs/BENCHMARKS.md: the forward's tracked bytes were one whole unit above the unit
// computing + the one gathering, and fell by that unit at the last unit, which prefetches
// none. A gloo broadcast reads and writes the tensor it is given, and each rank's chunk lands
// in a contiguous slice of the output; so on gloo the gather is one broadcast per rank, from
// that rank's chunk into its slice. The bytes are the all-gather's, moved bit for bit (no
// arithmetic), and each rank receives the (world - 1) chunks an all-gather brings it. Other
// backends (nccl, mpi) gather in place and keep their all-gather.
class AllOf final : public Work {
 public:
  explicit AllOf(std::vector<std::shared_ptr<Work>> works) : works_(std::move(works)) {}
  void wait() override {
    for (auto& work : works_) work->wait();
  }
  bool completed() override {
    for (auto& work : works_)
      if (!work->completed()) return false;
    return true;
  }

 private:
  std::vector<std::shared_ptr<Work>> works_;
};

std::shared_ptr<Work> gather_chunks(Comm& comm, at::Tensor& output, const at::Tensor& chunk) {
  if (comm.backend() != "gloo" || comm.world_size() == 1) return comm.all_gather(output, chunk);
  const int64_t n = chunk.numel();
  output.narrow(0, comm.rank() * n, n).copy_(chunk);
  std::vector<std::shared_ptr<Work>> works;
  for (int root = 0; root < comm.world_size(); ++root) {
    at::Tensor slice = output.narrow(0, root * n, n);
    works.push_back(comm.broadcast(slice, root));
  }
  return std::make_shared<AllOf>(std::move(works));
}

}  // namespace

void ZeroDriver::start_gather(Group& group) {
  at::Tensor shard = group.unit.shard;
  if (param_file_) {  // Note [Offloaded parameters]: the fetched shard (a copy on a GPU)
    const auto waited = Clock::now();
    shard = param_file_->fetch(group.unit);
    stats_.shard_wait_seconds += std::chrono::duration<double>(Clock::now() - waited).count();
  }
  // Half types travel as bytes: every backend moves those bit for bit (gloo has no int16).
  const at::Tensor values = shard.element_size() == 2 ? shard.view(at::kByte) : shard;
  group.gathering = at::empty({values.numel() * world_}, values.options());
  // Note [Gathering without gloo's copy].
  group.gather_work = gather_chunks(comm_, group.gathering, values);
  stats_.elements += shard.numel() * world_;
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
  if (param_file_) param_file_->gathered(group.unit);  // the fetched copy freed
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
  if (next.live || next.gather_work || next.unit.ticket >= 0 ||
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

// Note [Offloaded parameters]: the read issued a unit ahead, counted for the step's metrics.
void ZeroDriver::read_ahead(Group& group) {
  if (param_file_ && param_file_->read_ahead(group.unit)) stats_.shard_reads_ahead += 1;
}

void ZeroDriver::flush_resident() {
  // With offload_param a prefetch reads ahead instead of gathering: no gather is in flight here.
  if (!param_file_) return;
  for (auto& group : groups_)
    if (group.sharded) param_file_->flush(group.unit);
  for (auto& group : groups_) param_file_->settle(group.unit);
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

void ZeroDriver::finish_values_gather(ValuesGather& gather) {
  gather.work->wait();
  const Group& group = groups_[gather.group];
  const bool half = c10::elementSize(weight_dtype_) == 2;
  at::Tensor values = half ? gather.gathered.view(weight_dtype_) : gather.gathered;
  for (size_t index : group.plan.tensors) {
    at::Tensor flat = params_[index].tensor.detach().view(-1);
    for (const Placement& where : placements_[index])
      flat.narrow(0, where.piece.offset, where.piece.numel)
          .copy_(values.narrow(0, where.rank * group.plan.chunk + where.piece.chunk_offset,
                               where.piece.numel));
  }
  values_gather_bytes_ -= gather.bytes;
}

void ZeroDriver::start_values_gather(size_t g, Comm& comm) {
  at::NoGradGuard no_grad;
  at::Tensor values = chunk_values(groups_[g]);
  stats_.elements += values.numel() * world_;
  // Half types travel as bytes: every backend moves those bit for bit (gloo has no int16).
  if (c10::elementSize(weight_dtype_) == 2) values = values.view(at::kByte);
  ValuesGather gather{g, at::empty({values.numel() * world_}, values.options()), nullptr,
                      values.numel() * world_ * static_cast<int64_t>(values.element_size())};
  gather.work = comm.all_gather(gather.gathered, values);
  values_gather_bytes_ += gather.bytes;
  values_gathers_.push_back(std::move(gather));
  while (values_gather_bytes_ > options_.allgather_bucket_bytes && values_gathers_.size() > 1) {
    finish_values_gather(values_gathers_.front());
    values_gathers_.pop_front();
  }
}

void ZeroDriver::finish_values_gathers() {
  at::NoGradGuard no_grad;
  for (; !values_gathers_.empty(); values_gathers_.pop_front())
    finish_values_gather(values_gathers_.front());
}

void ZeroDriver::all_gather_params() {
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].sharded) {  // stage 3: the chunk is the weights; gathered at the next use
      if (groups_[g].master.defined()) {  // offloaded masters wrote their shard already
        Group& group = groups_[g];
        if (param_file_) param_file_->store(group.unit, group.master);  // home, not waited for
        else group.unit.shard.narrow(0, 0, group.plan.chunk).copy_(group.master);
      }
      continue;
    }
    start_values_gather(g, comm_);
  }
  finish_values_gathers();
}

}  // namespace loom::sharding
