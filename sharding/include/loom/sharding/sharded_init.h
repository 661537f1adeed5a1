// loom/sharding/sharded_init.h — ZeRO stage 3's sharded initialization: the unit build
// observer (loom/nn.h) that cuts each unit of the model to this rank's chunk of its flat group
// the moment the unit is initialised, so the model is never whole on any rank (Note [Sharded
// initialization] in loom/nn.h). Not the driver: ZeroDriver (zero_driver.h) starts from the
// chunks it keeps (ZeroOptions::built_chunks) instead of slicing whole weights.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "loom/comm.h"
#include "loom/nn.h"
#include "loom/sharding/flat_layout.h"

#pragma GCC visibility push(default)

namespace loom::sharding {

// Stage 3's rule for a unit's group, the tensors it shards: the unit's trainable tensors
// (requires_grad) of at least `persistence_threshold` elements, in parameter order (the
// engine's order, so the driver's too). Smaller and frozen ones stay whole on every rank. The
// one statement of the rule: ShardedInit cuts these as the model is built, and the zero plugin
// gives the driver these as the unit's group.
struct UnitGroupParam {
  std::string name;  // within the unit
  at::Tensor tensor;
};
std::vector<UnitGroupParam> unit_group_params(nn::Unit& unit, int64_t persistence_threshold);

struct ShardedInitOptions {
  Partitioning partitioning;          // the update rule's: the driver cuts with the same
  int64_t persistence_threshold = 0;  // smaller trainable tensors stay whole (and unobserved)
  Comm* comm = nullptr;               // the world: rank 0's values are broadcast before the cut
  int shard_group_size = 0;           // Note [Hybrid sharding]; 0: every rank
};

class ShardedInit final : public nn::UnitBuildObserver {
 public:
  explicit ShardedInit(const ShardedInitOptions& options);

  void unit_constructed(nn::Unit& unit) override;
  // The unit's trainable tensors of at least the threshold (the driver's group for it, in the
  // same order) broadcast from rank 0, this rank's chunk kept, their bytes released.
  void unit_initialised(nn::Unit& unit) override;
  // A pretrained weight: only this rank's pieces of `source` are read.
  bool assign(const at::Tensor& target, const at::Tensor& source) override;

  // Units seen constructed but not (yet) initialised: their weights hold no values.
  int64_t uninitialised_units() const { return constructed_ - initialised_; }
  // The unit's kept tensors (nullptr: a unit it did not cut), to check the driver's group.
  const std::vector<at::Tensor>* kept_tensors(const void* unit) const;
  // Every cut unit's chunk, handed to the driver (ZeroOptions::built_chunks).
  std::unordered_map<const void*, at::Tensor> take_chunks();
  // The most elements one unit held whole.
  int64_t largest_unit_elements() const { return largest_unit_; }

 private:
  struct Cut {
    std::vector<at::Tensor> tensors;
    FlatGroup plan;
    at::Tensor chunk;  // (plan.chunk) in the build's dtype
  };
  ShardedInitOptions options_;
  int rank_ = 0, group_size_ = 1;  // in the shard group
  std::unordered_map<const void*, Cut> cuts_;                           // by unit
  std::unordered_map<const void*, std::pair<const void*, size_t>> of_;  // TensorImpl -> unit, index
  int64_t constructed_ = 0, initialised_ = 0, largest_unit_ = 0;
};

// Copies elements [offset, offset + numel) of `source` in row-major order (any strides: a
// transposed view of a mapped file is read row by row, nothing else copied) into `out` (numel).
void copy_flat_range(const at::Tensor& source, int64_t offset, int64_t numel, at::Tensor out);

}  // namespace loom::sharding

#pragma GCC visibility pop
