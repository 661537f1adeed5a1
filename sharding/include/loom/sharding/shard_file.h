// loom/sharding/shard_file.h — stage 3's offloaded weight shards: each unit's shard in the
// parameter swap file (NVMe) or in host memory (device = "cpu") between uses, brought to the
// compute device for its gather and sent back after the update (ZeRO-Infinity's parameter
// offload). Not a scheduler: ZeroDriver decides when a shard is fetched, stored or dropped;
// this keeps the file or the host arena, the shards' buffers and the moves in flight.
//
// Note [Offloaded parameters]: with offload_param (stage 3, half-precision weights), a unit's
// shard (the rank's chunk of its weights and the tag of Note [Diverged ranks]) lives between
// uses in the rank's parameter swap file (device = "nvme") or in one host arena, page-locked
// on a GPU run (device = "cpu"). Its home is the *host form* (`UnitShard::shard`, what the
// update and the checkpoint read and write); a gather sends from the *fetched form*: the host
// form itself on a CPU run with NVMe, or (a CUDA device: "staged") a copy on the device.
// The fetch is issued a unit ahead: where a prefetch would start the next unit's all-gather,
// it starts the next unit's fetch instead (it moves while this unit computes; the first unit's
// when the step starts, the last unit's for backward as its forward ends), and the unit's own
// gather waits for it and then all-gathers; collectives stay at the points every rank reaches
// in the same order. The fetched form is freed once the gather lands.
//   unstaged (a CPU run, "nvme"): the fetch is the file's read into an aligned buffer, on the
//     swap file's I/O thread; the gather waits for its ticket.
//   staged (a CUDA device, "cpu" or "nvme"): the fetch is a task on the offload's worker
//     thread: ("nvme") read the file into a page-locked staging buffer and wait for it, then
//     queue the host-to-device copy on the copy stream (Note [One code for the GPU and its
//     twin], loom/offload/copy_stream.h). The gather waits for the task on the host (it only
//     queues the copy: for "cpu" at once, for "nvme" once the read landed) and makes its
//     stream wait for the copy's event on the device, no device-wide sync; the gather's read
//     of the ranks' tags (a host read of its stream) is what tells the host the copy is done,
//     so the device copy and the staging buffer are freed after it.
// The update rebuilds each unit's shard from its fp32 masters (they are the truth: nothing is
// read); without masters (Note [ZeRO without masters] in zero_driver.h) the shard is the truth,
// made resident from its home and rounded into by the offloaded state's walk. Masters on the host (offload_optimizer) fill the host form directly; masters on the
// device (staged, no offload_optimizer) are cast to the weights' dtype there and copied
// device-to-host on the copy stream into the host form ("nvme": a staging buffer that the
// worker then writes to the file), the worker landing them in order while the next unit's
// cast goes on. Either way nothing waits for a shard's way home unless kShardWritesInFlight
// are already moving, and update() ends with every shard home. Memory holds, besides the
// "cpu" arena, the shards being fetched, gathered or stored only; whole weights exist around a
// unit's forward and backward as without offload.
//
// Note [Parameter offload twin]: a CPU run with LOOM_OFFLOAD_CPU_STORE=1 stages too, its
// "device" the CPU: the fetch and the store are the same tasks on the same worker, the copies
// memcpy made on the worker (CopyStream on the CPU), the host arena a store of its own apart
// from the fetched copies, so the tests exercise staging, fetches ahead of use, the gather
// waiting for the worker, the stores' landing and the freeing, bit for bit. Without it a CPU
// run's device = "cpu" changes nothing (the weights are in host memory already: the zero
// plugin says so once), and "nvme" runs unstaged. The staged path passes its GPU test on an H200.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "loom/offload/copy_stream.h"
#include "loom/offload/nvme_store.h"
#include "loom/offload/segment_swap.h"

#pragma GCC visibility push(default)

namespace loom::sharding {

struct StagedMove;  // shard_file.cpp: a fetch or a store on the worker thread

// One stage-3 unit's shard as this rank holds it: (chunk + 1) elements in the weights' dtype,
// the rank's chunk of the unit's weights and then the unit's position (Note [Diverged ranks]).
// Without offload_param the shard is always in memory; with it, only between a read and the
// gather that uses it, or an update and the write that lands it.
struct UnitShard {
  at::Tensor shard;        // the host form: undefined while the file alone holds it
  int64_t chunk = 0;       // the unit's chunk: the shard's elements before the tag
  int64_t position = -1;   // the unit's place in forward order, the tag's value
  int64_t region = -1;     // offload_param "nvme": the shard's region in the file
  int64_t ticket = -1;     // offload_param: the shard's read or write in flight
  bool writing = false;    // ... a write (the shard is freed when it lands)
  // Staged offload_param: the copy on the compute device, from its fetch to its gather's end,
  // and the fetch or the store on the offload's worker thread.
  at::Tensor on_device;
  std::shared_ptr<StagedMove> moving;
};

// Writes `shard`'s tag (its position) after its chunk (Note [Diverged ranks]).
void set_tag(UnitShard& unit);

class ShardFile {
 public:
  // The units' shards moved to their home (options.device: "nvme", the swap file, one region
  // each, written one at a time with a few writes in flight; "cpu", one host arena, page-locked
  // when options.pin_memory and `device` is CUDA). `staged`: gathers send from a copy on
  // `device` (a CUDA device, or the CPU for the twin: Note [Parameter offload twin]); "cpu"
  // needs it. The units stay the caller's and must not move. An arena or a staging buffer that
  // cannot be allocated: a ConfigError naming its size and what to do.
  ShardFile(const offload::OffloadOptions& options, at::ScalarType dtype, c10::Device device,
            bool staged, const std::vector<UnitShard*>& units);
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  // A copy of the unit's shard from the file, aligned (the file is not touched otherwise); the
  // host form itself with device = "cpu".
  at::Tensor read(const UnitShard& unit) const;
  // Starts fetching the unit's shard unless it is fetched or being fetched already; false then.
  bool read_ahead(UnitShard& unit);
  // What the unit's gather sends: its fetch landed (started now if nobody read it ahead; on a
  // GPU the calling thread's stream waits for the copy, the host does not).
  at::Tensor fetch(UnitShard& unit);
  // The gather landed: the fetched form freed (the host form is unchanged: nothing to write).
  void gathered(UnitShard& unit);
  // A fetch nobody gathered (a unit the step did not reach) waited for and freed.
  void drop_fetch(UnitShard& unit);
  // The unit's host form in memory: a read or store in flight landed, or read now (`read`), or
  // fresh with its tag and zeros, to be filled whole.
  void make_resident(UnitShard& unit, bool read);
  // Starts writing the unit's host form, in memory, to the file; settle lands it and frees it.
  // Nothing with device = "cpu" (the arena is its home).
  void flush(UnitShard& unit);
  // The unit's new shard from its fp32 master (the update's result), home without waiting:
  // unstaged, into the host form and flushed; staged, cast on the device and copied back on
  // the copy stream, landed (and written, "nvme") by the worker (Note [Offloaded parameters]).
  void store(UnitShard& unit, const at::Tensor& master);
  // Waits for the unit's read, write or store in flight, if any.
  void settle(UnitShard& unit);
  // Bytes of the unit's shard on the compute device now (unstaged: the host form in memory).
  int64_t device_bytes(const UnitShard& unit) const;
  // "on NVMe (path)" or "in page-locked host memory (1.2 MiB)", for the log.
  std::string describe() const;
  // The swap file's path ("nvme").
  const std::string& file() const;

 private:
  // A page-locked (or, without pinning, plain) buffer of `numel` elements aligned for O_DIRECT.
  at::Tensor staging(int64_t numel) const;
  void start_fetch(UnitShard& unit);

  at::ScalarType dtype_;
  c10::Device device_;
  bool staged_;
  bool pin_;
  std::unique_ptr<offload::SwapFile> file_;    // "nvme"
  at::Tensor arena_;                           // "cpu": every unit's host form
  std::unique_ptr<offload::CopyStream> copies_;  // staged
  std::deque<UnitShard*> writes_;  // shards being written or stored, oldest first
  // Last: joined first, before the file and the copy stream its tasks use go.
  std::unique_ptr<offload::WorkerThread> worker_;  // staged
};
}  // namespace loom::sharding

#pragma GCC visibility pop
