// loom/offload/segment_swap.h — update-rule segments (loom/update_rule.h) whose fp32 masters and
// optimizer state live in an NVMe swap file (loom/offload/nvme_store.h) between updates, and a
// pipelined walk over them. The unsharded offloaded driver (offloaded_driver.h) keeps one segment
// per tensor here; ZeRO's driver (loom/sharding/zero_driver.h) keeps its rank's pieces here, so
// stages 1-3 offload on any number of ranks with the same code.
//
// Note [Pipelined update]: each segment's masters (when the weights are not fp32 CPU tensors)
// and state tensors are one region of the swap file. A walk visits the segments in order through
// buffer_count aligned buffers: while the visitor works on segment i in its buffer, segments
// i+1 .. i+buffer_count-2 are being read into the next buffers and segment i-1 written from the
// previous one (buffer_count >= 3; a buffer is reused only once its write is done). The rule runs
// on the buffer's bytes as tensors, exactly as the in-memory drivers run it on their own, so the
// updated weights are bitwise the same. Between walks only the buffers are in memory:
// buffer_count x the largest segment's region.
//
// Note [Host store]: with device = "cpu" (ZeRO-Offload: a GPU run's optimizer state in host
// RAM) the segments' regions are slices of one host arena instead (page-locked when
// pin_memory and the weights are on a GPU, so the gradients' and weights' copies run at full
// PCIe speed), and a walk visits them where they are: no buffers, no I/O, the same rule calls on
// the same bytes, so the twin of this path on a CPU run is bitwise the in-memory one too.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/offload/nvme_store.h"
#include "loom/update_rule.h"

#pragma GCC visibility push(default)

namespace loom::offload {

struct OffloadOptions {
  std::string device = "none";  // none | cpu | nvme (DeepSpeed's offload_optimizer.device)
  NvmeOptions nvme;             // path, block_size, queue_depth
  int buffer_count = 4;         // staging buffers (DeepSpeed's buffer_count), at least 3
  bool pin_memory = true;       // page-locked host arena (Note [Host store]); the drivers pass
                                // true only when the weights are on a GPU
  bool delayed_update = false;  // Note [Delayed update] (offloaded_driver.h); stage 0 only
  bool overlap_update = true;   // Note [Overlapped update] (offloaded_driver.h); the host store,
                                // stage 0, without delayed_update
};

// What the last walk did: its wall time, the part spent in the visitor (compute) and the part
// spent waiting for the swap file (I/O not hidden behind compute), and the bytes moved.
struct OffloadStats {
  double update_seconds = 0, compute_seconds = 0, io_wait_seconds = 0;
  int64_t bytes_read = 0, bytes_written = 0;
  // Note [Overlapped update]: segments updated during backward, before update() was called.
  int64_t updated_in_backward = 0;
};

// One segment as the rule sees it, and where its values are.
struct SwapSegment {
  std::string name;             // the parameter's
  std::vector<int64_t> shape;   // the whole tensor's
  int64_t offset = 0;           // of the segment in the flattened tensor
  int64_t numel = 0;
  int group = 0;
  // fp32 CPU values updated in place (they are their own master), or undefined: the segment's
  // fp32 master is kept in the swap file with its state.
  at::Tensor in_place;
  // bf16 weights that are their own masters (Note [ZeRO without masters] in
  // loom/sharding/zero_driver.h): the file holds the state alone, and a visited segment has no
  // param; the visitor gives it the widened weights and rounds them back itself.
  bool no_master = false;
};

class SegmentSwap {
 public:
  // Reserves the swap file for every segment's region (the rule's state shapes come from the
  // meta device: no memory) and allocates the buffers. Nothing is written yet: initialise each.
  SegmentSwap(const UpdateRule& rule, std::vector<SwapSegment> segments,
              const OffloadOptions& options);
  ~SegmentSwap();
  SegmentSwap(const SegmentSwap&) = delete;
  SegmentSwap& operator=(const SegmentSwap&) = delete;

  size_t size() const { return segments_.size(); }
  bool separate_master(size_t i) const {
    return !segments_[i].segment.in_place.defined() && !segments_[i].segment.no_master;
  }
  // Writes segment i's first master (from `values`, any dtype or device; ignored for in-place
  // segments, and read only for its shape for one without a master) and the rule's initial
  // state.
  void initialise(size_t i, const at::Tensor& values);

  // Note [Pipelined update]: visits every segment in order, its param and state views of a
  // buffer valid during the call; a segment is written back when the visitor returns true.
  void walk(const std::function<bool(size_t, Segment&)>& visit);
  // Note [Host store]: segment i where it lives in the host arena (the store must be one),
  // valid as long as the store; the overlapped update visits the segments this way one at a
  // time, in the order their gradients land (Note [Overlapped update], offloaded_driver.h).
  Segment host_segment(size_t i) const;
  // One segment at a time, nothing ahead (a checkpoint's load): read, visit, written back on
  // true.
  void each(const std::function<bool(size_t, Segment&)>& visit) const;
  // Segment i as the rule sees it, its master and state on the meta device: shapes and dtypes,
  // no memory (a checkpoint's streamed pieces, StatePiece::load).
  Segment meta_segment(size_t i) const;
  // A copy of segment i's state `key`, or of its master for key "": read from the file (the
  // segment last read stays in a buffer of its own, so a checkpoint reading a segment's
  // tensors in turn reads it once).
  at::Tensor read(size_t i, const std::string& key) const;

  const OffloadStats& last_stats() const { return stats_; }
  int64_t buffer_bytes() const;  // what stays in host memory (the buffers, or the host arena)
  int64_t file_bytes() const;    // 0 with the host store
  bool in_host_memory() const { return host_base_ != nullptr; }
  std::string describe() const;  // "3.1 GiB in FILE (O_DIRECT, io_uring); 4 buffers of ..."

 private:
  struct Layout {
    std::string key;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t offset, bytes;
  };
  struct Entry {
    SwapSegment segment;
    int64_t bytes = 0, region = -1;
    std::vector<Layout> state;
  };
  Segment segment_over(const Entry& e, void* base) const;

  const UpdateRule& rule_;
  std::vector<Entry> segments_;
  std::unique_ptr<SwapFile> file_;      // nvme
  AlignedBuffer host_;                  // Note [Host store], unpinned
  at::Tensor host_pinned_;              // ... or page-locked (CUDA)
  char* host_base_ = nullptr;           // the arena; Entry::region is then a byte offset
  mutable std::vector<AlignedBuffer> buffers_;
  mutable AlignedBuffer read_buffer_;    // read(): segment read_segment_ (-1: none)
  mutable int64_t read_segment_ = -1;
  int64_t total_ = 0, largest_ = 0;
  OffloadStats stats_;
};

}  // namespace loom::offload

#pragma GCC visibility pop
