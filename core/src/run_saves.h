// run_saves.h (core-internal) — when a run writes its checkpoints, and how: every save_steps,
// when asked, at the end; in the step's pause, or in the background with [train] async_save
// (Note [Asynchronous checkpoints], async_checkpoint.h: this is where its moments are kept).
// What a checkpoint holds is run_checkpoint.h's, the folder's format checkpoint_io.h's; the
// engine fires the save event through `gather` and decides the end of run's saves.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "async_checkpoint.h"
#include "evaluation/best_model.h"
#include "loom/config.h"
#include "loom/engine.h"
#include "run_checkpoint.h"

namespace loom {

class Comm;

class RunSaves {
 public:
  // What a save asks of the engine, at the save.
  struct Sources {
    std::function<RunParts()> parts;          // the run's pieces now
    std::function<CheckpointData&()> gather;  // a fresh CheckpointData filled by the save event
  };
  // From [train]: save_steps, save_total_limit and async_save. `best` (Note [Best model]) is
  // told of every save and protects its checkpoint from rotation. `state`, `comm` and `best`
  // must outlive this object, which must go before `comm`.
  RunSaves(const ConfigSection& train, std::string output_dir, Comm& comm,
           const TrainState& state, BestModel& best, Sources sources);

  // Every rank together: the checkpoint of the step now, written before this returns (after
  // the background save in flight, if any, is committed: one save at a time, in order).
  // Returns its folder; a failed write is a CheckpointError.
  std::string save();
  // Whether a background save is uncommitted, and whether this rank's writer of it is still
  // writing (never blocks). The step's all-reduce carries the latter to every rank.
  bool in_flight() const { return async_ && async_->in_flight(); }
  bool writer_busy() const { return in_flight() && !async_->written_here(); }
  // After the step's evaluation, on every rank together: commits the background save when
  // `writes_done` (every rank's writer was done at this step's all-reduce), makes the
  // background copy's host buffers once the first update has made the optimizer state, and
  // saves when the step is a save_steps multiple short of max_steps.
  void step_end(bool writes_done);
  // Every rank together: waits for the background save in flight, if any, and commits it.
  void finish();
  // At the end of the run, after finish(), on every rank together: the checkpoint the run
  // leaves, "" for none. The one save_steps wrote at this step; else, after a stop signal
  // (Note [Graceful stop]), one written now with save_on_signal when the job saves at all
  // (save_steps or save_final), said with how to resume; else one written now with save_final
  // when the run took a step (`first_step`: the step it started from).
  std::string final_checkpoint(bool stopped, int64_t first_step);
  // After an error: see the Note. Never throws.
  void abandon() noexcept {
    if (async_) async_->abandon();
  }
  // The step of the newest checkpoint this run wrote (-1: none yet), and its folder.
  int64_t saved_step() const { return saved_step_; }
  const std::string& saved_folder() const { return saved_folder_; }

 private:
  void start_async();

  std::string output_dir_;
  Comm& comm_;
  const TrainState& state_;
  BestModel& best_;
  Sources sources_;
  int64_t every_ = 0, keep_ = 0;  // save_steps (0: none), save_total_limit
  bool save_final_ = false, save_on_signal_ = false;
  std::unique_ptr<AsyncCheckpointer> async_;  // [train] async_save only
  bool said_wait_ = false;  // the "training waits for the previous save" line, once per run
  int64_t saved_step_ = -1;
  std::string saved_folder_;
};

}  // namespace loom
