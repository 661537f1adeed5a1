// ZeRO's checkpoint state: the rank's pieces of masters, optimizer state and (stage 3) weights,
// written as pieces of the whole tensors and read back at any cut (Note [Resharding a run]);
// and the bytes the driver holds, for the memory report. Part of ZeroDriver (zero_driver.h).
#include "loom/sharding/zero_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <set>

#include "loom/error.h"

namespace loom::sharding {

void ZeroDriver::add_pieces(size_t g, size_t k, const Segment& segment, StatePieces& out) const {
  const Piece& piece = groups_[g].plan.ranks[rank_][k];
  const size_t index = piece.tensor;
  const int64_t n = piece.numel, numel = tensors_[index].numel();
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
      if (param_file_ && !group.unit.shard.defined()) {
        out_piece.tensor = at::empty({piece.numel}, at::TensorOptions().dtype(weight_dtype_).device(c10::kMeta));
        out_piece.load = [file = param_file_.get(), from = &group.unit, piece] {
          return file->read(*from).narrow(0, piece.chunk_offset, piece.numel).clone();
        };
      } else {
        out_piece.tensor = group.unit.shard.narrow(0, piece.chunk_offset, piece.numel);
      }
      out.push_back(std::move(out_piece));
    }
  }
  return out;
}

void ZeroDriver::load_state(StateReader& reader) {
  at::NoGradGuard no_grad;
  std::string dropped, widened;  // the first master dropped, or made from the weights
  auto read = [&](const StatePiece& piece) {
    at::Tensor into = piece.tensor;
    reader.read(piece.name, piece.global_shape, piece.offset, into);
  };
  // Note [ZeRO without masters]: a job with masters resumed from a checkpoint without them
  // starts each master from its piece's weights (stage 3's shard was read above; the engine
  // loaded the other parameters before this call): exact, bf16 into fp32.
  auto read_or_widen = [&](const StatePiece& piece, const at::Tensor& weights) {
    if (piece.name.rfind("master/", 0) == 0 && !reader.holds(piece.name)) {
      at::Tensor master = piece.tensor;
      master.copy_(weights);
      if (widened.empty()) widened = piece.name;
      return;
    }
    read(piece);
  };
  // Stage 3's weight pieces first (into shards read back from the file with offload_param):
  // the masters, where the weights have them, then overwrite the shards with their own values,
  // as all_gather_params does.
  for (auto& group : groups_)
    if (group.sharded) {
      if (param_file_) param_file_->make_resident(group.unit, /*read=*/true);
      for (const Piece& piece : group.plan.ranks[rank_])
        read({"weight/" + params_[piece.tensor].name,
              group.unit.shard.narrow(0, piece.chunk_offset, piece.numel),
              {tensors_[piece.tensor].numel()}, piece.offset});
    }
  if (swap_) {
    // Streams: each segment read into a buffer, filled from the checkpoint, written back.
    swap_->each([&](size_t i, Segment& segment) {
      StatePieces pieces;
      add_pieces(swapped_[i].first, swapped_[i].second, segment, pieces);
      const at::Tensor weights = values_of(i);
      for (const auto& piece : pieces) read_or_widen(piece, weights);
      if (swap_->separate_master(i)) values_of(i).copy_(segment.param);
      return true;
    });
  } else {
    for (size_t g = 0; g < groups_.size(); ++g)
      for (size_t k = 0; k < groups_[g].segments.size(); ++k) {
        StatePieces pieces;
        add_pieces(g, k, groups_[g].segments[k], pieces);
        const at::Tensor weights = piece_weights(g, k);
        for (const auto& piece : pieces) read_or_widen(piece, weights);
      }
  }
  // Pieces other ranks hold are theirs to read; anything no rank of this job has a place for
  // is an error on every rank.
  std::set<std::string> expected;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& [key, tensor] : whole_state_[i])
      expected.insert("state/" + params_[i].name + "/" + key);
    const std::string master = "master/" + params_[i].name;
    if (separate_master_) expected.insert(master);
    // Note [ZeRO without masters]: masters saved by a run that kept them are left unread: the
    // weights go on from their bf16 values.
    if (rounded_ && reader.holds(master)) {
      expected.insert(master);
      if (dropped.empty()) dropped = master;
    }
  }
  for (const auto& name : reader.unread())
    LOOM_CHECK_AS(CheckpointError, expected.count(name), reader.where(),
                  " holds optimizer state '", name,
                  "' that this job has no place for; it belongs to another model or optimizer");
  warn_master_dtype_switch(reader, dropped, widened);
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
    // offload_param: only the shards on the device now (between steps, none).
    if (group.sharded && param_file_) bytes += param_file_->device_bytes(group.unit);
    else if (group.sharded) bytes += group.unit.shard.nbytes();
  return bytes;
}

int64_t ZeroDriver::grad_bytes() const {
  if (options_.stage == 1) return -1;  // whole gradients in .grad, as without ZeRO
  // The shards' size, whether or not an update in backward freed them (Note [Updating chunks
  // in backward]).
  int64_t bytes = 0;
  for (const auto& group : groups_)
    bytes += group.plan.chunk * static_cast<int64_t>(c10::elementSize(weight_dtype_));
  return bytes;
}

}  // namespace loom::sharding
