// When and how a run writes its checkpoints. See run_saves.h.
#include "run_saves.h"

#include <chrono>

#include "loom/comm.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom {

RunSaves::RunSaves(const ConfigSection& train, std::string output_dir, Comm& comm,
                   const TrainState& state, BestModel& best, Sources sources)
    : output_dir_(std::move(output_dir)), comm_(comm), state_(state), best_(best),
      sources_(std::move(sources)), every_(train.get_int("save_steps")),
      keep_(train.get_int("save_total_limit")), save_final_(train.get_bool("save_final")),
      save_on_signal_(train.get_bool("save_on_signal")) {
  if (train.get_bool("async_save")) async_ = std::make_unique<AsyncCheckpointer>(output_dir_, comm_);
}

std::string RunSaves::save() {
  finish();  // Note [Asynchronous checkpoints]: one save at a time, in order
  const auto start = std::chrono::steady_clock::now();
  CheckpointData& plugin = sources_.gather();
  best_.saving(state_.step);  // Note [Best model]: this one may hold the best evaluation
  best_.save(plugin.values);
  const CheckpointContents contents = checkpoint_contents(sources_.parts(), plugin);
  // Every rank takes part: sharded optimizer state is written by the ranks that hold it.
  const std::string folder =
      write_checkpoint(output_dir_, contents, keep_, comm_, best_.best_checkpoint_step());
  log::info("saved checkpoint ", folder, " (training paused ",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
            " s for it)");
  saved_step_ = state_.step;
  saved_folder_ = folder;
  return folder;
}

void RunSaves::step_end(bool writes_done) {
  if (writes_done) finish();
  // Note [Asynchronous checkpoints]: the host buffers made while training goes on, once the
  // first update has made the optimizer state (the first save's pause is then a copy).
  if (async_ && every_ > 0 && !async_->prepared())
    async_->prepare(checkpoint_contents(sources_.parts(), CheckpointData{}));
  if (every_ > 0 && state_.step % every_ == 0 && state_.step < state_.max_steps) {
    if (async_) start_async();
    else save();
  }
}

// Note [Asynchronous checkpoints]: the host copy and the writer started; at most one in flight.
void RunSaves::start_async() {
  if (async_->in_flight()) {
    if (!said_wait_)
      log::warn("step ", state_.step, ": checkpoint-", async_->step(),
                " is still being written in the background; training waits for it (one "
                "asynchronous save at a time: raise [train] save_steps, or write to faster "
                "storage). Said once per run");
    said_wait_ = true;
    finish();
  }
  CheckpointData& plugin = sources_.gather();
  best_.saving(state_.step);  // Note [Best model]: this one may hold the best evaluation
  best_.save(plugin.values);
  async_->start(checkpoint_contents(sources_.parts(), plugin), keep_,
                best_.best_checkpoint_step());
  log::debug("checkpoint-", state_.step, ": copied in ", async_->copy_seconds(),
             " s, being written in the background");
}

std::string RunSaves::final_checkpoint(bool stopped, int64_t first_step) {
  const bool saved_now = saved_step_ == state_.step;  // save_steps wrote this step already
  if (stopped) {
    if (!(every_ > 0 || save_final_) || !save_on_signal_) return "";
    const std::string folder = saved_now ? saved_folder_ : save();
    log::info("resume with [train] resume = \"latest\" (or \"", folder, "\")");
    return folder;
  }
  if (saved_now) return saved_folder_;
  return save_final_ && state_.step > first_step ? save() : "";
}

void RunSaves::finish() {
  if (!in_flight()) return;
  const int64_t step = async_->step();
  const std::string folder = async_->finish();
  const AsyncCheckpointer& saves = *async_;
  log::info("saved checkpoint ", folder, " (in the background: written in ",
            saves.write_seconds(), " s; training paused ",
            saves.copy_seconds() + saves.commit_seconds(), " s for it: ", saves.copy_seconds(),
            " s copying, ", saves.commit_seconds(), " s committing",
            saves.wait_seconds() > 0.001
                ? detail::cat("; and ", saves.wait_seconds(), " s waiting for the writer")
                : std::string(),
            ")");
  saved_step_ = step;
  saved_folder_ = folder;
}

}  // namespace loom
