// The engine's side of checkpoints. See run_checkpoint.h.
#include "run_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <map>
#include <set>

#include "device.h"
#include "loom/comm.h"
#include "loom/data.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/model.h"

namespace loom {

NamedTensors model_tensors(Model& model, const StepDriver* driver, bool without_sharded) {
  std::set<std::string> sharded;
  if (without_sharded && driver)
    for (const auto& name : driver->sharded_weights()) sharded.insert(name);
  NamedTensors out;
  for (const auto& item : model.named_parameters(true))
    if (!sharded.count(item.key())) out.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers(true)) out.emplace_back(item.key(), item.value());
  return out;
}

// Note [Partial model files]: at ZeRO stage 3 the units' weights, and with expert parallelism
// the experts, are pieces in the ranks' optimizer-*.safetensors files ("weight/<name>"), so a
// checkpoint's model.safetensors then holds only part of the model. A file that looks like a
// model and is not one must say so: its safetensors metadata carries "loom_partial" (what it
// lacks, and `loom consolidate`/`loom export`, which join the pieces), which Python's reader
// shows, and which `from_pretrained` refuses by name. loom's own checkpoint reader serves the
// missing tensors from the pieces (Note [Checkpoint format 2]) and ignores the mark.
std::string partial_model_note(Model& model, const NamedTensors& held) {
  std::set<std::string> in_file;
  for (const auto& [name, tensor] : held) in_file.insert(name);
  std::vector<std::string> missing;
  int64_t total = 0;
  for (const auto& item : model.named_parameters(true)) {
    ++total;
    if (!in_file.count(item.key())) missing.push_back(item.key());
  }
  total += static_cast<int64_t>(model.named_buffers(true).size());
  if (missing.empty()) return "";
  return detail::cat("this file holds ", held.size(), " of the model's ", total, " tensors; the ",
                     missing.size(), " others (", missing.front(),
                     missing.size() > 1 ? ", ..." : "", ") are pieces in the checkpoint's "
                     "optimizer-*.safetensors files (ZeRO stage 3 or expert parallelism): "
                     "`loom consolidate CHECKPOINT OUT.safetensors` or `loom export CHECKPOINT "
                     "FOLDER` writes the whole model");
}

CheckpointContents checkpoint_contents(const RunParts& run, CheckpointData plugin) {
  CheckpointContents contents;
  contents.step = run.state.step;
  contents.seed = run.seed;
  contents.config_hash = run.config_hash;
  contents.job_text = run.job_text;
  contents.job_dir = run.job_dir;
  contents.label_names = run.label_names;
  contents.update_rule = run.update_rule;
  contents.world_size = run.comm.world_size();
  contents.data = run.data.position();
  contents.skipped_updates = run.state.skipped_updates;
  contents.loss_scale = run.state.loss_scale;
  contents.model = model_tensors(run.model, &run.driver, /*without_sharded=*/true);
  contents.model_partial = partial_model_note(run.model, contents.model);
  contents.optimizer = run.driver.state_pieces();
  contents.optimizer_sharded = run.driver.state_is_sharded();
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    contents.rng_cpu = generator.get_state();
  }
  contents.rng_device = device_rng_state(run.device);
  contents.plugin = std::move(plugin);
  return contents;
}

CheckpointData restore_run(const RunParts& run, ReadCheckpoint& read, const std::string& folder) {
  CheckpointContents& contents = read.contents;
  LOOM_CHECK_AS(CheckpointError, contents.update_rule == run.update_rule, "checkpoint ", folder,
                " holds optimizer state of '", contents.update_rule, "' but the job uses '",
                run.update_rule, "'; resume with the same [optimizer] name");
  LOOM_CHECK_AS(CheckpointError, contents.step <= run.state.max_steps, "checkpoint ", folder,
                " is at step ", contents.step, ", past this job's [train] max_steps ",
                run.state.max_steps, "; raise max_steps to train on from it");
  const int world = run.comm.world_size();
  if (contents.world_size != world) {
    // Note [Resharding a run]: the sampler's cursor counts each rank's samples; the samples
    // consumed by all ranks together (cursor x world) must split evenly over the new ranks.
    // The driver reads its own cut of the state from whatever cut was saved (StateReader).
    const int64_t consumed = contents.data.cursor * contents.world_size;
    LOOM_CHECK_AS(CheckpointError, consumed % world == 0, "checkpoint ", folder,
                  " was written by ", contents.world_size, " rank(s) after ", consumed,
                  " samples of epoch ", contents.data.epoch, ", which do not split over ", world,
                  " ranks; resume on a world size dividing ", consumed);
    contents.data.cursor = consumed / world;
    log::info("resuming a ", contents.world_size, "-rank checkpoint on ", world,
              " ranks: optimizer state and data position resharded");
  }
  {
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> by_name(contents.model.begin(), contents.model.end());
    const std::string file = folder + "/model.safetensors";
    for (auto& [name, tensor] : model_tensors(run.model, &run.driver, /*without_sharded=*/true)) {
      auto it = by_name.find(name);
      if (it == by_name.end() && tensor.requires_grad()) {
        // Written by a driver that sharded it (ZeRO stage 3): assembled from the shards.
        at::Tensor flat = tensor.detach().view(-1);
        read.state->read("weight/" + name, {flat.numel()}, 0, flat);
        continue;
      }
      LOOM_CHECK_AS(CheckpointError, it != by_name.end(), "'", file, "' has no tensor '", name,
                    "' that model '", run.model_name, "' needs; it belongs to another model");
      LOOM_CHECK_AS(CheckpointError, it->second.sizes() == tensor.sizes(), "'", file,
                    "': tensor '", name, "' is ", it->second.sizes(), " but the model needs ",
                    tensor.sizes(), "; the checkpoint belongs to another model shape");
      // A frozen tensor may be held in half by one run and in fp32 by another (Note [Frozen
      // weights in half]): it is not trained, and its values pass either way (copy_ casts).
      const bool frozen_float = !tensor.requires_grad() && tensor.is_floating_point() &&
                                it->second.is_floating_point();
      LOOM_CHECK_AS(CheckpointError, frozen_float || it->second.scalar_type() == tensor.scalar_type(), "'",
                    file, "': tensor '", name, "' is ", c10::toString(it->second.scalar_type()),
                    " but the model holds ", c10::toString(tensor.scalar_type()),
                    "; the file was changed, or the checkpoint comes from a run of another "
                    "precision (loom consolidate, then load the weights, to change precision)");
      at::Tensor target = tensor;
      target.detach().copy_(it->second);
      by_name.erase(it);
    }
    // Weights this run's driver keeps as shards (ZeRO stage 3) that the checkpoint holds whole
    // (written without stage 3): the driver reads its pieces of them as "weight/<name>", which
    // the reader serves from model.safetensors, checking shape and dtype.
    for (const auto& name : run.driver.sharded_weights()) by_name.erase(name);
    LOOM_CHECK_AS(CheckpointError, by_name.empty(), "'", file, "' holds tensor '",
                  by_name.empty() ? "" : by_name.begin()->first, "' that model '", run.model_name,
                  "' does not have");
  }
  run.driver.load_state(*read.state);
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(contents.rng_cpu);
  }
  if (run.device.is_cuda()) {
    if (contents.rng_device.defined())
      set_device_rng_state(run.device, contents.rng_device);
    else
      log::warn("checkpoint ", folder, " holds no ", run.device.str(), " RNG state (it was ",
                "written by a CPU run): dropout on the GPU will not repeat the original run's");
  }
  run.data.seek(contents.data);
  run.state.step = contents.step;
  run.state.skipped_updates = contents.skipped_updates;
  run.state.loss_scale = contents.loss_scale;
  return contents.plugin;
}

CheckpointData resume_run(const RunParts& run, const std::string& folder, DataPosition& data_at) {
  ReadCheckpoint read = read_checkpoint(folder);
  if (read.contents.config_hash != run.config_hash)
    log::warn("checkpoint ", folder, " was written by a job with another configuration (hash ",
              read.contents.config_hash, ", now ", run.config_hash, "); continuing with the new one");
  data_at = read.contents.data;
  return restore_run(run, read, folder);
}

}  // namespace loom
