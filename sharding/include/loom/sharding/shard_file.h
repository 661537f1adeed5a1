// loom/sharding/shard_file.h — stage 3's parameter swap file: each unit's weight shard on NVMe
// between uses, read back into aligned memory and written out again (ZeRO-Infinity's parameter
// offload). Not a scheduler: ZeroDriver decides when a shard is read, written or dropped; this
// keeps the file, the shards' buffers and the writes in flight.
//
// Note [Offloaded parameters]: with offload_param on NVMe (stage 3, half-precision weights), a
// unit's shard (the rank's chunk of its weights and the tag of Note [Diverged ranks]) lives in
// the rank's parameter swap file between uses, ZeRO-Infinity's parameter offload. A gather
// reads it into an aligned buffer, all-gathers from there, and frees it once the gather lands.
// The read is issued a unit ahead: where a prefetch would start the next unit's all-gather, it
// starts the next unit's read instead (the I/O thread moves it while this unit computes; the
// first unit's when the step starts, the last unit's for backward as its forward ends), and
// the unit's own gather waits for it and then all-gathers; collectives stay at the points every
// rank reaches in the same order. The update writes each unit's new shard from its fp32 masters
// (they are the truth: nothing is read) as soon as the walk leaves the unit, without waiting
// for the write unless kShardWritesInFlight are already flying, and frees each shard once its
// write lands. Memory holds the shards of the units being read, gathered or written only; whole
// weights exist around a unit's forward and backward as without offload.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "loom/offload/nvme_store.h"

#pragma GCC visibility push(default)

namespace loom::sharding {

// One stage-3 unit's shard as this rank holds it: (chunk + 1) elements in the weights' dtype,
// the rank's chunk of the unit's weights and then the unit's position (Note [Diverged ranks]).
// Without offload_param the shard is always in memory; with it, only between a read and the
// gather that uses it, or an update and the write that lands it.
struct UnitShard {
  at::Tensor shard;        // undefined while the file alone holds it
  int64_t chunk = 0;       // the unit's chunk: the shard's elements before the tag
  int64_t position = -1;   // the unit's place in forward order, the tag's value
  int64_t region = -1;     // offload_param: the shard's region in the file
  int64_t ticket = -1;     // offload_param: the shard's read or write in flight
  bool writing = false;    // ... a write (the shard is freed when it lands)
};

// Writes `shard`'s tag (its position) after its chunk (Note [Diverged ranks]).
void set_tag(UnitShard& unit);

class ShardFile {
 public:
  // A file with a region for each of `units` (in dtype), each shard written to it and freed
  // (one at a time, a few writes in flight). The units stay the caller's and must not move.
  ShardFile(const offload::NvmeOptions& nvme, at::ScalarType dtype,
            const std::vector<UnitShard*>& units);
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  // A copy of the unit's shard from the file, aligned (the file is not touched otherwise).
  at::Tensor read(const UnitShard& unit) const;
  // Starts reading the unit's shard unless it is in memory already; false then.
  bool read_ahead(UnitShard& unit);
  // The unit's shard in memory: a read in flight landed, or read now (`read`), or fresh with
  // its tag and zeros, to be filled whole.
  void make_resident(UnitShard& unit, bool read);
  // Starts writing the unit's shard, in memory, to the file; settle lands it and frees it.
  void flush(UnitShard& unit);
  // Waits for the unit's read or write in flight, if any.
  void settle(UnitShard& unit);
  const std::string& file() const;

 private:
  std::unique_ptr<offload::SwapFile> file_;
  at::ScalarType dtype_;
  std::deque<UnitShard*> writes_;  // shards being written, oldest first
};

}  // namespace loom::sharding

#pragma GCC visibility pop
