// loom/sharding/flat_layout.h — how ZeRO cuts the trainable parameters across ranks.
//
// The parameters are split into groups of whole tensors (stages 1-2: gradient buckets of about
// reduce_bucket_size bytes, in the order backward produces them). Each group is one logical flat
// vector (its tensors flattened, one after another) cut into `world` consecutive ranges, one per
// rank, at positions the update rule allows (UpdateRule::partitioning: any element, a multiple
// of the block, a row boundary, a tensor boundary). Every rank's range is padded to the same
// `chunk` elements, so a group's gradient is one equal-chunk reduce-scatter and its updated
// values one all-gather. The chunk is the smallest that fits the cuts (then rounded up to
// kChunkAlign elements), so padding is at most one partitioning unit per rank and group.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/update_rule.h"

#pragma GCC visibility push(default)

namespace loom::sharding {

inline constexpr int64_t kChunkAlign = 16;  // 64 bytes of fp32: vector loads stay aligned

// A contiguous part of one tensor held by one rank.
struct Piece {
  size_t tensor = 0;         // index into the layout's tensor list
  int64_t offset = 0;        // first element in the flattened tensor
  int64_t numel = 0;
  int64_t chunk_offset = 0;  // where it sits in the rank's chunk of its group
};

struct FlatGroup {
  std::vector<size_t> tensors;            // indices into the layout's tensor list, in flat order
  int64_t chunk = 0;                      // elements per rank, padding included
  std::vector<std::vector<Piece>> ranks;  // per rank: its pieces, in flat order
  int64_t numel() const;                  // unpadded elements of the group
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// The unit at which a tensor may be cut under `partitioning` (1 = anywhere; numel = never).
int64_t cut_unit(const std::vector<int64_t>& shape, const Partitioning& partitioning);

// Cuts one group of tensors (given in flat order) across `world` ranks.
FlatGroup plan_group(const std::vector<TensorInfo>& tensors, const std::vector<size_t>& members,
                     const Partitioning& partitioning, int world);

// Groups of whole tensors of at most bucket_bytes (at `bytes_per_element`), formed in reverse
// tensor order (backward's), each at least one tensor; members within a group in tensor order.
std::vector<std::vector<size_t>> bucket_groups(const std::vector<TensorInfo>& tensors,
                                               int64_t bucket_bytes, int64_t bytes_per_element);

}  // namespace loom::sharding

#pragma GCC visibility pop
