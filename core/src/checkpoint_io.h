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
  StatePieces optimizer;   // this rank's pieces; written by every rank when optimizer_sharded
  bool optimizer_sharded = false;
  at::Tensor rng_cpu;      // trainer.safetensors
  at::Tensor rng_device;   // trainer.safetensors "rng.cuda": the GPU's generator (CUDA jobs)
  CheckpointData plugin;   // <stem>.safetensors files and manifest values
};

class Comm;

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
