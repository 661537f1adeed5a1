// run_checkpoint.h (core-internal) — what a run's checkpoint holds and how a run is put back
// from one: the engine's side of save and load (the folder format is checkpoint_io.h's). The
// engine fires the save/load events around these; everything else is here.
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "checkpoint_io.h"
#include "loom/engine.h"
#include "loom/step_driver.h"

namespace loom {

class Model;
class DataSource;
class Comm;

// The run's pieces a checkpoint reads or restores (references into the engine).
struct RunParts {
  Model& model;
  const std::string& model_name;
  StepDriver& driver;
  DataSource& data;
  TrainState& state;
  Comm& comm;
  c10::Device device;
  uint64_t seed;
  std::string config_hash, update_rule;
  std::string job_text, job_dir;  // saved in the manifest, for `loom export`
  std::vector<std::string> label_names;  // the data's label map (manifest "labels")
};

// The model's parameters and buffers by name; without_sharded leaves out the weights the
// driver keeps as shards (ZeRO stage 3 saves and loads those itself).
NamedTensors model_tensors(Model& model, const StepDriver* driver, bool without_sharded);

// This rank's contents of a checkpoint of the run now (plugin: what the save event gathered).
CheckpointContents checkpoint_contents(const RunParts& run, CheckpointData plugin);

// Puts the run back from `read` (model, driver state, RNG, data position, counters): a
// checkpoint of another world size is resharded (Note [Resharding a run]); another update rule,
// model or shape is a CheckpointError naming the file and tensor. Returns the plugin data for
// the load event.
CheckpointData restore_run(const RunParts& run, ReadCheckpoint& read, const std::string& folder);

// The run resumed from the checkpoint in `folder`: read, then restore_run. A checkpoint of a job
// with another configuration hash is said in a warning (the run goes on with its own job).
// `data_at` is set to where the data stands in it, for the engine's log line.
CheckpointData resume_run(const RunParts& run, const std::string& folder, DataPosition& data_at);

}  // namespace loom
