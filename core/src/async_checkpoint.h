// async_checkpoint.h (core-internal) — checkpoints written by a thread of their own while
// training goes on ([train] async_save). Not a second format or writer: the phases of
// CheckpointWriter (checkpoint_io.h) over a host copy of the contents.
//
// Note [Asynchronous checkpoints]: at a save step the run's checkpoint contents (model, this
// rank's optimizer pieces, RNG, the plugins' files) are copied into host buffers, kept from one
// save to the next (page-locked when the tensors live on a GPU, so the device-to-host copies run
// at full speed; on CPU a plain copy, the same code), and the step loop goes on; that copy is
// the whole pause. A writer thread runs phase 2 (this rank's files into `.checkpoint-N.tmp`);
// it makes no collective call, so no backend (NCCL's ordering rule included) ever sees two
// threads' collectives. Phase 1 (the temporary folder made and agreed) runs at the save step,
// phase 3 (sizes and crc32 exchanged, manifest written, folder renamed, then rotation) at the
// first point every rank reaches together after every rank's writer is done: each step's loss
// all-reduce carries "my writer is still busy" beside the stop flag (Note [Graceful stop]), and
// the step that finds every writer done commits at its end, so the checkpoint is whole one step
// after the slowest rank's last byte. Consequences:
// - At most one save in flight: a save step that finds the previous one uncommitted waits for
//   it (said once per run, with what to do), then starts its own. The next save's manifest, the
//   best checkpoint (Note [Best model]) and save_total_limit's rotation only ever see
//   committed checkpoints.
// - The end of training, a stop signal, Trainer::save_checkpoint and load_best_model_at_end
//   first wait for the in-flight save and commit it; the final and the signal's checkpoints are
//   then written synchronously (the run waits for them anyway).
// - An error (or a Trainer destroyed mid-save): the writer is waited for; one process commits
//   what it wrote (no peer is needed, and the state of the save step is valid whatever failed
//   after it), several ranks leave it (rank 0 removes the temporary folder, or the next run's
//   claim of output_dir does, Note [One run per output_dir]). A kill at any moment leaves the
//   last committed checkpoint, since only the rename makes a folder a checkpoint.
// - The host buffers are made and touched by a thread after the first step (prepare()), so
//   even the first save's pause is a copy into mapped pages; they are kept for the run.
// - A writer's failure (disk full, a non-finite tensor) surfaces at the commit, as the same
//   CheckpointError a synchronous save throws, on every rank.
// - The cost is host memory for one copy of the rank's checkpoint, from the first step on, and
//   the writer's CPU time beside training's (crc32, the copy into the page cache); state
//   offloaded to NVMe (StatePiece::load) is read into the copy at the save step, which then
//   pauses for that read.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_io.h"

namespace loom {

class Comm;

// `live` copied into host tensors (streamed pieces read), reusing `buffers` where a tensor of
// the same shape and dtype sits at the same place (they are the previous copy's: it must be
// written by now). A tensor on a GPU goes to page-locked memory without blocking, and the
// current stream is synchronised once at the end; on CPU the copies are plain. The copy's
// tensors share nothing with `live`.
CheckpointContents host_copy(const CheckpointContents& live, std::vector<at::Tensor>& buffers);

class AsyncCheckpointer {
 public:
  AsyncCheckpointer(std::string output_dir, Comm& comm);
  ~AsyncCheckpointer();  // abandon()
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Once, before the first save (any step after the optimizer state exists): the host buffers
  // for contents of these shapes are made and touched by a thread of their own, so the first
  // save's pause is a copy, not page faults. Only shapes are read from `shapes`.
  void prepare(CheckpointContents shapes);
  bool prepared() const { return prepared_; }
  // At a save step, on every rank: the host copy, phase 1 (collective), the writer started.
  // None may be in flight (finish() first). keep / protect_step as write_checkpoint's.
  void start(const CheckpointContents& live, int64_t keep, int64_t protect_step);
  bool in_flight() const { return writer_ != nullptr; }
  int64_t step() const;
  // Whether this rank's writer is done (never blocks).
  bool written_here() const { return written_.load(std::memory_order_acquire); }
  // On every rank together: waits for this rank's writer, then phase 3. Returns the folder;
  // a CheckpointError as write_checkpoint's.
  std::string finish();
  // See the Note: after an error, or at destruction. Never throws.
  void abandon() noexcept;
  // What the in-flight (or just finished) save cost the step loop: the host copy, the commit,
  // and apart from those the time finish() waited for a writer not yet done.
  double copy_seconds() const { return copy_seconds_; }
  double commit_seconds() const { return commit_seconds_; }
  double wait_seconds() const { return wait_seconds_; }
  // How long the writer took over this rank's files (valid after finish()).
  double write_seconds() const { return write_seconds_; }

 private:
  void join();
  std::string output_dir_;
  Comm& comm_;
  std::vector<at::Tensor> buffers_;  // the host copy's tensors, reused by the next save
  bool prepared_ = false;
  CheckpointContents copy_;
  std::unique_ptr<CheckpointWriter> writer_;
  std::thread thread_;
  std::atomic<bool> written_{false};
  int64_t keep_ = 0, protect_step_ = -1;
  double copy_seconds_ = 0, commit_seconds_ = 0, wait_seconds_ = 0;
  double write_seconds_ = 0;  // set by the writer thread, read after joining it
};

}  // namespace loom
