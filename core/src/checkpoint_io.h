// checkpoint_io.h (core-internal) — the checkpoint folder: safetensors files plus manifest.json
// (step, seed, RNG, data position, config hash, per-file size and crc32). Written under a
// temporary name and renamed, so a crash never leaves a folder that looks complete.
//
// Note [Checkpoint format 2]: the optimizer state is written by the ranks that hold it, one
// file each, optimizer-RRRRR-of-NNNNN.safetensors; each file's metadata "layout" says, per
// tensor, the global shape and the dim-0 offset of the piece (a StatePiece), and "step" the
// step. Every writer reports its file's size and crc32 (an all-gather; a rank that failed says
// so there, and every rank throws), then rank 0 writes the rest and the manifest and renames
// the folder: the set appears whole or not at all. A reader assembles any cut from any other
// (resharding across world sizes and ZeRO stages). Format 1 (one optimizer.safetensors, whole
// tensors) is read too.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "loom/data.h"
#include "loom/engine.h"
#include "loom/step_driver.h"

namespace loom {

struct CheckpointContents {
  int64_t step = 0;
  uint64_t seed = 0;
  std::string config_hash, update_rule;
  std::string job_text, job_dir;  // the job's canonical text and folder (manifest "job")
  std::vector<std::string> label_names;  // classification data's names by id (manifest "labels")
  int world_size = 1;
  DataPosition data;
  int64_t skipped_updates = 0;
  double loss_scale = 1.0;
  NamedTensors model;      // model.safetensors (rank 0's)
  // Note [Partial model files]: empty when `model` is the whole model; else what the file
  // lacks and how to get the whole model, written as its "loom_partial" metadata.
  std::string model_partial;
  StatePieces optimizer;   // this rank's pieces; written by every rank when optimizer_sharded
  bool optimizer_sharded = false;
  at::Tensor rng_cpu;      // trainer.safetensors
  at::Tensor rng_device;   // trainer.safetensors "rng.cuda": the GPU's generator (CUDA jobs)
  CheckpointData plugin;   // <stem>.safetensors files and manifest values
};

class Comm;

// Note [Checkpoint write phases]: a save is three phases, and the folder appears at the end of
// the third or not at all (Note [Checkpoint format 2]).
//  1. begin (the constructor), collective: rank 0 clears what a crashed save of this step left
//     and makes the temporary folder `.checkpoint-<step>.tmp`; the ranks agree it exists.
//  2. write_files(), this rank alone, no collective: its optimizer shard (when it writes one)
//     and, on rank 0, model, trainer and the plugins' files, each with its size and crc32; every
//     floating tensor checked finite first (a diverged run leaves no checkpoint a resume would
//     trust). A failure is kept for phase 3, never thrown here.
//  3. commit(), collective: the ranks exchange (ok, size, crc32) of their shard; a failure
//     anywhere fails every rank; else rank 0 writes manifest.json, renames the folder into
//     place, fsyncs, and only then rotates (save_total_limit, Note [Best model]).
// write_checkpoint runs them back to back. An asynchronous save (Note [Asynchronous
// checkpoints], async_checkpoint.h) runs phase 2 on a writer thread over a host copy of the
// contents and phase 3 at a later point every rank reaches together: the same code, so the same
// bytes. A writer destroyed before its commit removes the temporary folder (rank 0).
class CheckpointWriter {
 public:
  // `contents` must outlive the writer.
  CheckpointWriter(std::string output_dir, const CheckpointContents& contents, Comm& comm);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  void write_files();
  // Returns the folder; a CheckpointError (on every rank) when any rank failed.
  std::string commit(int64_t keep, int64_t protect_step);
  int64_t step() const { return c_.step; }
  // This rank's phase-2 failure, "" when none.
  const std::string& error() const { return error_; }

 private:
  at::Tensor agree(const std::string& error, int64_t bytes, int64_t crc);
  struct WrittenFile {
    std::string name;
    uint64_t bytes = 0;
    uint32_t crc32 = 0;
  };
  std::string output_dir_;
  const CheckpointContents& c_;
  Comm& comm_;
  std::string error_;
  int64_t shard_bytes_ = 0, shard_crc_ = 0;
  std::vector<WrittenFile> rank0_files_;  // rank 0's files, in the manifest's order
  bool committed_ = false;
};

// Every rank calls it. Writes <output_dir>/checkpoint-<step>; keeps only the newest `keep`
// (0 = all), never deleting checkpoint-<protect_step> (Note [Best model]: the best checkpoint,
// which counts as one of them). Returns the folder (on every rank).
std::string write_checkpoint(const std::string& output_dir, const CheckpointContents& contents,
                             int64_t keep, Comm& comm, int64_t protect_step = -1);

struct ReadCheckpoint {
  CheckpointContents contents;  // all but `optimizer`, which `state` reads on demand
  std::unique_ptr<StateReader> state;
};
// Reads and verifies a checkpoint folder. Throws CheckpointError naming the file for a missing,
// truncated or corrupt one (optimizer shards: their sizes now, their crc32 when first read).
ReadCheckpoint read_checkpoint(const std::string& folder);
// The same, every file verified but none loaded: the manifest's numbers and job.
CheckpointContents read_checkpoint_info(const std::string& folder);
// Streams a checkpoint (sharded or not) into one safetensors file of the model's tensors,
// fp32 for floating ones (masters where the run kept them): see loom/trainer.h.
void consolidate_checkpoint_folder(const std::string& folder, const std::string& out_file);
// Note [One run per output_dir]: rank 0 holds an exclusive flock on <output_dir>/.loom.lock for
// its run (released by the kernel when the process dies, however it dies), so a second job on
// the same folder is refused instead of racing the first one's checkpoints. Holding the lock,
// it removes the temporary folders of saves that never finished (`.checkpoint-N.tmp`: a kill
// during a save). Several trainers of one process share the claim.
class OutputDirClaim {
 public:
  explicit OutputDirClaim(const std::string& output_dir);  // CheckpointError when taken
  ~OutputDirClaim();
  OutputDirClaim(const OutputDirClaim&) = delete;
  OutputDirClaim& operator=(const OutputDirClaim&) = delete;
  // Unfinished checkpoint folders this claim removed.
  const std::vector<std::string>& removed_temp_folders() const { return removed_; }

 private:
  std::string dir_;
  std::vector<std::string> removed_;
};

// The newest complete checkpoint folder in output_dir, or "".
std::string latest_checkpoint(const std::string& output_dir);

}  // namespace loom
