// Checkpoint folders: layout, manifest, verification, rotation.
#include "checkpoint_io.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fsutil.h"
#include "loom/error.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"

namespace loom {
namespace {

constexpr const char* kFormat = "loom-checkpoint";
constexpr int kFormatVersion = 1;

int64_t step_of(const std::filesystem::path& folder) {
  const std::string name = folder.filename().string();
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  for (size_t i = prefix.size(); i < name.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
  return std::stoll(name.substr(prefix.size()));
}

std::vector<std::pair<int64_t, std::filesystem::path>> checkpoints_in(const std::string& dir) {
  std::vector<std::pair<int64_t, std::filesystem::path>> found;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return found;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = step_of(entry.path());
    if (step >= 0 && entry.is_directory() &&
        std::filesystem::exists(entry.path() / "manifest.json"))
      found.emplace_back(step, entry.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

std::string write_checkpoint(const std::string& output_dir, const CheckpointContents& c,
                             int64_t keep) {
  namespace fs = std::filesystem;
  const fs::path final_dir = fs::path(output_dir) / ("checkpoint-" + std::to_string(c.step));
  const fs::path temp_dir = fs::path(output_dir) / (".checkpoint-" + std::to_string(c.step) +
                                                    ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(temp_dir);
  fs::create_directories(temp_dir);
  try {
    std::map<std::string, NamedTensors> files = c.plugin.files;
    for (const char* reserved : {"model", "optimizer", "trainer"})
      LOOM_CHECK_AS(CheckpointError, !files.count(reserved), "a plugin tried to save a file '",
                    reserved, "' that belongs to the core");
    files["model"] = c.model;
    files["optimizer"] = c.optimizer;
    files["trainer"] = {{"rng.cpu", c.rng_cpu}};
    if (c.rng_device.defined()) files["trainer"].emplace_back("rng.cuda", c.rng_device);
    nlohmann::ordered_json manifest = {
        {"format", kFormat},
        {"format_version", kFormatVersion},
        {"loom_version", LOOM_VERSION},
        {"step", c.step},
        {"seed", c.seed},
        {"config_hash", c.config_hash},
        {"update_rule", c.update_rule},
        {"world_size", c.world_size},
        {"data", {{"epoch", c.data.epoch}, {"cursor", c.data.cursor}}},
        {"skipped_updates", c.skipped_updates},
        {"loss_scale", c.loss_scale},
        {"values", c.plugin.values}};
    nlohmann::ordered_json listing = nlohmann::ordered_json::object();
    for (const auto& [stem, tensors] : files) {
      const fs::path file = temp_dir / (stem + ".safetensors");
      safetensors::save(file, tensors, {{"format", "pt"}});
      const auto d = fsutil::digest(file);
      listing[stem + ".safetensors"] = {{"bytes", d.bytes}, {"crc32", d.crc32}};
    }
    manifest["files"] = listing;
    fsutil::write_file_atomic(temp_dir / "manifest.json", manifest.dump(2) + "\n");
    fsutil::fsync_dir(temp_dir);
    if (fs::exists(final_dir)) fs::remove_all(final_dir);
    fs::rename(temp_dir, final_dir);
    fsutil::fsync_dir(output_dir);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(temp_dir, ec);
    throw;
  }
  if (keep > 0) {
    auto all = checkpoints_in(output_dir);
    for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i].second);
  }
  return final_dir.string();
}

CheckpointContents read_checkpoint(const std::string& folder) {
  namespace fs = std::filesystem;
  const fs::path manifest_path = fs::path(folder) / "manifest.json";
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(folder), "checkpoint folder '", folder,
                "' does not exist; check [train] resume");
  std::ifstream in(manifest_path);
  LOOM_CHECK_AS(CheckpointError, in.good(), "'", manifest_path.string(),
                "' is missing: '", folder, "' is not a complete loom checkpoint");
  nlohmann::json manifest;
  CheckpointContents c;
  try {
    in >> manifest;
    LOOM_CHECK_AS(CheckpointError, manifest.value("format", "") == kFormat, "'",
                  manifest_path.string(), "' is not a loom checkpoint manifest");
    LOOM_CHECK_AS(CheckpointError, manifest.at("format_version").get<int>() == kFormatVersion,
                  "'", manifest_path.string(), "' has format version ",
                  manifest.at("format_version").dump(), "; this loom reads version ",
                  kFormatVersion);
    c.step = manifest.at("step").get<int64_t>();
    c.seed = manifest.at("seed").get<uint64_t>();
    c.config_hash = manifest.at("config_hash").get<std::string>();
    c.update_rule = manifest.at("update_rule").get<std::string>();
    c.world_size = manifest.at("world_size").get<int>();
    c.data.epoch = manifest.at("data").at("epoch").get<int64_t>();
    c.data.cursor = manifest.at("data").at("cursor").get<int64_t>();
    c.skipped_updates = manifest.at("skipped_updates").get<int64_t>();
    c.loss_scale = manifest.at("loss_scale").get<double>();
    c.plugin.values = manifest.at("values").get<std::map<std::string, std::string>>();
  } catch (const nlohmann::json::exception& error) {
    throw CheckpointError(detail::cat("'", manifest_path.string(), "' is corrupt: ", error.what(),
                                      "; resume from an earlier checkpoint or delete this one"));
  }
  for (const auto& [name, info] : manifest.at("files").items()) {
    const fs::path file = fs::path(folder) / name;
    LOOM_CHECK_AS(CheckpointError, fs::exists(file), "checkpoint file '", file.string(),
                  "' is missing; the checkpoint is incomplete");
    const auto d = fsutil::digest(file);
    const auto bytes = info.at("bytes").get<uint64_t>();
    const auto crc = info.at("crc32").get<uint32_t>();
    LOOM_CHECK_AS(CheckpointError, d.bytes == bytes, "checkpoint file '", file.string(),
                  "' is truncated or padded: ", d.bytes, " bytes, the manifest says ", bytes,
                  "; resume from an earlier checkpoint");
    LOOM_CHECK_AS(CheckpointError, d.crc32 == crc, "checkpoint file '", file.string(),
                  "' is corrupt: crc32 ", d.crc32, ", the manifest says ", crc,
                  "; resume from an earlier checkpoint");
    auto contents = safetensors::load(file);
    const std::string stem = name.substr(0, name.size() - std::string(".safetensors").size());
    if (stem == "model") c.model = std::move(contents.tensors);
    else if (stem == "optimizer") c.optimizer = std::move(contents.tensors);
    else if (stem == "trainer") {
      for (auto& [key, tensor] : contents.tensors)
        if (key == "rng.cpu") c.rng_cpu = tensor;
        else if (key == "rng.cuda") c.rng_device = tensor;
    } else c.plugin.files[stem] = std::move(contents.tensors);
  }
  LOOM_CHECK_AS(CheckpointError, c.rng_cpu.defined(), "checkpoint '", folder,
                "' lacks trainer.safetensors (rng.cpu)");
  return c;
}

std::string latest_checkpoint(const std::string& output_dir) {
  auto all = checkpoints_in(output_dir);
  return all.empty() ? "" : all.back().second.string();
}

}  // namespace loom
