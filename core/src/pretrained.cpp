// Hugging Face model folders: see loom/pretrained.h.
#include "loom/pretrained.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "fsutil.h"
#include "loom/error.h"
#include "loom/nn.h"
#include "loom/safetensors.h"

namespace loom::pretrained {
namespace {

std::string read_text(const std::filesystem::path& file) {
  std::error_code ec;
  LOOM_CHECK_AS(CheckpointError, std::filesystem::is_regular_file(file, ec), "'", file.string(),
                "' is missing or not a file");
  std::ifstream in(file, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  LOOM_CHECK_AS(CheckpointError, in.good() || in.eof(), "cannot read '", file.string(), "'");
  return text.str();
}

std::string shape_text(c10::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

}  // namespace

Folder::Folder(const std::filesystem::path& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(dir), "pretrained model folder '", dir.string(),
                "' does not exist (a folder transformers' save_pretrained wrote: config.json and "
                "model.safetensors)");
  config_ = read_text(dir / "config.json");
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  std::set<fs::path> files;
  if (fs::exists(index)) {
    nlohmann::json map;
    try {
      map = nlohmann::json::parse(read_text(index)).at("weight_map");
      for (const auto& [name, file] : map.items()) {
        const auto file_name = file.get<std::string>();
        LOOM_CHECK_AS(CheckpointError,
                      !file_name.empty() && file_name.find('/') == std::string::npos &&
                          file_name != "..",
                      "'", index.string(), "' maps tensor '", name, "' to '", file_name,
                      "', not a file of its folder");
        where_[name] = dir / file_name;
        files.insert(dir / file_name);
      }
    } catch (const nlohmann::json::exception& error) {
      throw CheckpointError(detail::cat("'", index.string(), "' is not a safetensors index (",
                                        error.what(), ")"));
    }
    for (const auto& file : files)
      LOOM_CHECK_AS(CheckpointError, fs::is_regular_file(file), "'", index.string(),
                    "' names the shard file '", file.filename().string(),
                    "', which is missing from '", dir.string(), "'");
    // Each tensor the index maps must be in the file it names.
    for (const auto& file : files) {
      std::set<std::string> held;
      for (const auto& entry : safetensors::read_header(file).entries) held.insert(entry.name);
      for (const auto& [name, in] : where_)
        LOOM_CHECK_AS(CheckpointError, in != file || held.count(name), "'", index.string(),
                      "' maps tensor '", name, "' to '", file.filename().string(),
                      "', which does not hold it");
    }
  } else {
    LOOM_CHECK_AS(CheckpointError, fs::exists(single), "pretrained model folder '", dir.string(),
                  "' has neither model.safetensors nor model.safetensors.index.json (loom reads "
                  "safetensors weights; convert a pytorch_model.bin with transformers first)");
    for (const auto& entry : safetensors::read_header(single).entries)
      where_[entry.name] = single;
  }
  // Note [Partial model files]: a loom checkpoint's model.safetensors at ZeRO stage 3 or with
  // expert parallelism is part of a model; loading it would leave the rest at initial values.
  std::set<fs::path> weight_files;
  for (const auto& [name, file] : where_) weight_files.insert(file);
  for (const auto& file : weight_files) {
    const auto metadata = safetensors::read_header(file).metadata;
    const auto partial = metadata.find("loom_partial");
    LOOM_CHECK_AS(CheckpointError, partial == metadata.end(), "'", file.string(),
                  "' is not a whole model: ", partial->second,
                  "; then point from_pretrained at that output");
  }
}

std::vector<std::string> Folder::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

std::vector<int64_t> Folder::shape(const std::string& name) const {
  auto it = where_.find(name);
  LOOM_CHECK_AS(CheckpointError, it != where_.end(), "pretrained model '", dir_.string(),
                "' lacks the tensor '", name, "'");
  for (const auto& entry : safetensors::read_header(it->second).entries)
    if (entry.name == name) return entry.shape;
  throw CheckpointError(detail::cat("'", it->second.string(), "' lacks the tensor '", name, "'"));
}

at::Tensor Folder::read(const std::string& name) const {
  auto it = where_.find(name);
  LOOM_CHECK_AS(CheckpointError, it != where_.end(), "pretrained model '", dir_.string(),
                "' lacks the tensor '", name, "'");
  const auto header = safetensors::read_header(it->second);
  for (const auto& entry : header.entries)
    if (entry.name == name) return safetensors::read_tensor(it->second, header, entry);
  throw CheckpointError(detail::cat("'", it->second.string(), "' lacks the tensor '", name, "'"));
}

at::Tensor Folder::map(const std::string& name) const {
  auto it = where_.find(name);
  LOOM_CHECK_AS(CheckpointError, it != where_.end(), "pretrained model '", dir_.string(),
                "' lacks the tensor '", name, "'");
  const auto header = safetensors::read_header(it->second);
  for (const auto& entry : header.entries) {
    if (entry.name != name) continue;
    // read_header checked the byte range against the file's size.
    const uint64_t start = header.data_start + entry.begin, bytes = entry.end - entry.begin;
    const uint64_t element = c10::elementSize(entry.dtype);
    if (bytes == 0 || start % element != 0)
      return safetensors::read_tensor(it->second, header, entry);
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t first = start / page * page, length = start + bytes - first;
    const int fd = ::open(it->second.c_str(), O_RDONLY | O_CLOEXEC);
    LOOM_CHECK_AS(CheckpointError, fd >= 0, "cannot open '", it->second.string(), "': ",
                  std::strerror(errno));
    void* base = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd, static_cast<off_t>(first));
    const int mmap_errno = errno;
    ::close(fd);  // the mapping stays valid
    LOOM_CHECK_AS(CheckpointError, base != MAP_FAILED, "cannot map tensor '", name, "' of '",
                  it->second.string(), "': ", std::strerror(mmap_errno));
    return at::from_blob(
        static_cast<char*>(base) + (start - first), entry.shape,
        [base, length](void*) { ::munmap(base, length); },
        at::TensorOptions().dtype(entry.dtype));
  }
  throw CheckpointError(detail::cat("'", it->second.string(), "' lacks the tensor '", name, "'"));
}

void assign(torch::nn::Module& module, const NamedTensors& tensors, const std::string& source) {
  std::map<std::string, at::Tensor> given(tensors.begin(), tensors.end());
  std::vector<std::pair<std::string, at::Tensor>> targets;
  for (const auto& item : module.named_parameters()) targets.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers()) targets.emplace_back(item.key(), item.value());
  std::vector<std::string> missing;
  at::NoGradGuard no_grad;
  for (auto& [name, target] : targets) {
    auto it = given.find(name);
    if (it == given.end()) {
      missing.push_back(name);
      continue;
    }
    LOOM_CHECK_AS(CheckpointError, it->second.sizes() == target.sizes(), source, ": tensor '",
                  name, "' has shape ", shape_text(it->second.sizes()),
                  " but the model's is ", shape_text(target.sizes()),
                  "; the weights belong to another model configuration");
    // Note [Sharded initialization]: a unit weight the observer released takes its part only.
    if (nn::storage_released(target)) {
      nn::UnitBuildObserver* observer = nn::unit_build_observer();
      LOOM_INTERNAL_ASSERT(observer && observer->assign(target, it->second), "tensor '", name,
                           "' holds no bytes, and no unit build observer keeps its part");
    } else {
      target.copy_(it->second);
    }
    given.erase(it);
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 5; ++i) list += (i ? ", " : "") + missing[i];
    throw CheckpointError(detail::cat(source, " lacks ", missing.size(), " of the model's tensors (",
                                      list, missing.size() > 5 ? ", ..." : "", ")"));
  }
  if (!given.empty())
    throw CheckpointError(detail::cat(source, " has ", given.size(),
                                      " tensors the model does not (first: '",
                                      given.begin()->first, "')"));
}

void write_folder(const std::filesystem::path& dir, const Export& model) {
  namespace fs = std::filesystem;
  std::error_code ec;
  LOOM_CHECK_AS(CheckpointError, !fs::exists(dir, ec) || (fs::is_directory(dir, ec) && fs::is_empty(dir, ec)),
                "'", dir.string(), "' exists and is not an empty folder; choose a new folder (an "
                "export never overwrites)");
  const fs::path target = fs::absolute(dir).lexically_normal();
  const fs::path parent = target.parent_path();
  LOOM_CHECK_AS(CheckpointError, fs::is_directory(parent, ec), "cannot export into '",
                dir.string(), "': its parent folder '", parent.string(), "' does not exist");
  std::string temp_name = ".";  // built in steps: GCC 12 misreads "." + string as an overflow
  temp_name += target.filename().string();
  temp_name += ".tmp-" + std::to_string(::getpid());
  const fs::path temp = parent / temp_name;
  fs::remove_all(temp, ec);
  fs::create_directory(temp);
  try {
    fsutil::write_file_atomic(temp / "config.json", model.config_json);
    safetensors::save(temp / "model.safetensors", model.tensors, {{"format", "pt"}});
    for (const auto& file : model.files) fs::copy_file(file, temp / file.filename());
    fs::remove(target, ec);  // an empty folder the user made
    fs::rename(temp, target);
    fsutil::fsync_dir(parent);
  } catch (...) {
    fs::remove_all(temp, ec);
    throw;
  }
}

}  // namespace loom::pretrained
