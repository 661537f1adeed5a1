// ZeRO stage 3's sharded initialization: see loom/sharding/sharded_init.h and Note [Sharded
// initialization] in loom/nn.h.
#include "loom/sharding/sharded_init.h"

#include <ATen/ATen.h>

#include "loom/error.h"

namespace loom::sharding {

std::vector<UnitGroupParam> unit_group_params(nn::Unit& unit, int64_t persistence_threshold) {
  std::vector<UnitGroupParam> group;
  for (const auto& item : unit.named_parameters(/*recurse=*/true))
    if (item.value().requires_grad() && item.value().numel() >= persistence_threshold)
      group.push_back({item.key(), item.value()});
  return group;
}

ShardedInit::ShardedInit(const ShardedInitOptions& options) : options_(options) {
  LOOM_INTERNAL_ASSERT(options_.comm, "sharded initialization needs the world's Comm");
  const int world = options_.comm->world_size();
  group_size_ = options_.shard_group_size > 0 ? options_.shard_group_size : world;
  LOOM_INTERNAL_ASSERT(world % group_size_ == 0, "shard group size ", group_size_,
                       " does not divide ", world);
  // The shard group's Comm orders its ranks by world rank (zero_driver.cpp's split).
  rank_ = options_.comm->rank() % group_size_;
}

void ShardedInit::unit_constructed(nn::Unit&) { ++constructed_; }

void ShardedInit::unit_initialised(nn::Unit& unit) {
  ++initialised_;
  at::NoGradGuard no_grad;
  // The unit's group (unit_group_params: the driver's for it, in the same order).
  Cut cut;
  std::vector<TensorInfo> infos;
  int64_t whole = 0;
  for (const auto& t : unit.parameters(/*recurse=*/true)) whole += t.numel();
  for (auto& member : unit_group_params(unit, options_.persistence_threshold)) {
    const at::Tensor& t = member.tensor;
    LOOM_CHECK_AS(ConfigError,
                  t.storage_offset() == 0 && t.storage().allocator() &&
                      t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size(),
                  "[zero] stage 3 frees the bytes of parameter '", member.name, "' between uses, "
                  "but it shares its storage with other tensors; give it a storage of its own, "
                  "or raise stage3_param_persistence_threshold past its ", t.numel(), " elements");
    LOOM_CHECK_AS(ConfigError, cut.tensors.empty() || t.scalar_type() == cut.tensors[0].scalar_type(),
                  "[zero] sharded_init: unit weight '", member.name, "' is ",
                  c10::toString(t.scalar_type()), " but '",
                  infos.front().name, "' is ", c10::toString(cut.tensors[0].scalar_type()),
                  "; build the model's weights in one dtype, or set [zero] sharded_init = false");
    cut.tensors.push_back(t);
    infos.push_back({std::move(member.name), t.sizes().vec()});
  }
  largest_unit_ = std::max(largest_unit_, whole);
  if (cut.tensors.empty()) return;
  // Every replica starts from rank 0's values, as start_from_rank0 gives the whole-built model.
  if (options_.comm->world_size() > 1)
    for (const at::Tensor& t : cut.tensors) {
      at::Tensor values = t.detach();
      options_.comm->broadcast(values, 0)->wait();
    }
  std::vector<size_t> members(infos.size());
  for (size_t i = 0; i < members.size(); ++i) members[i] = i;
  cut.plan = plan_group(infos, members, options_.partitioning, group_size_);
  cut.chunk = at::zeros({cut.plan.chunk}, cut.tensors[0].options());
  for (const Piece& piece : cut.plan.ranks[rank_])
    cut.chunk.narrow(0, piece.chunk_offset, piece.numel)
        .copy_(cut.tensors[piece.tensor].detach().view(-1).narrow(0, piece.offset, piece.numel));
  for (size_t i = 0; i < cut.tensors.size(); ++i) {
    nn::release_storage(cut.tensors[i]);
    of_[cut.tensors[i].unsafeGetTensorImpl()] = {&unit, i};
  }
  cuts_[&unit] = std::move(cut);
}

bool ShardedInit::assign(const at::Tensor& target, const at::Tensor& source) {
  auto found = of_.find(target.unsafeGetTensorImpl());
  if (found == of_.end()) return false;
  Cut& cut = cuts_.at(found->second.first);
  LOOM_INTERNAL_ASSERT(source.sizes() == target.sizes(), "assign: shapes differ");
  at::NoGradGuard no_grad;
  for (const Piece& piece : cut.plan.ranks[rank_])
    if (piece.tensor == found->second.second)
      copy_flat_range(source, piece.offset, piece.numel,
                      cut.chunk.narrow(0, piece.chunk_offset, piece.numel));
  return true;
}

const std::vector<at::Tensor>* ShardedInit::kept_tensors(const void* unit) const {
  auto found = cuts_.find(unit);
  return found == cuts_.end() ? nullptr : &found->second.tensors;
}

std::unordered_map<const void*, at::Tensor> ShardedInit::take_chunks() {
  std::unordered_map<const void*, at::Tensor> out;
  for (auto& [unit, cut] : cuts_) out[unit] = std::move(cut.chunk);
  cuts_.clear();
  of_.clear();
  return out;
}

void copy_flat_range(const at::Tensor& source, int64_t offset, int64_t numel, at::Tensor out) {
  if (numel == 0) return;
  if (source.is_contiguous() || source.dim() < 2) {
    out.copy_(source.dim() == 0 ? source.view(-1) : source.reshape(-1).narrow(0, offset, numel));
    return;
  }
  // Rows of the last dimension: at most two partial ones and whole ones between.
  const at::Tensor rows = source.dim() == 2 ? source : source.flatten(0, -2);
  const int64_t width = rows.size(1);
  int64_t row = offset / width, column = offset % width, done = 0;
  while (done < numel) {
    const int64_t take = std::min(width - column, numel - done);
    out.narrow(0, done, take).copy_(rows.select(0, row).narrow(0, column, take));
    done += take;
    ++row;
    column = 0;
  }
}

}  // namespace loom::sharding
