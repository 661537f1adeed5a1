// loom/pretrained.h — Hugging Face model folders, as transformers' save_pretrained writes them:
// config.json plus model.safetensors, or model.safetensors.index.json and its shard files.
// Model plugins read them for `[model] from_pretrained` and write them for `loom export`
// (Plugin::export_pretrained); the name and layout mapping is the plugin's.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/update_rule.h"  // NamedTensors

namespace torch::nn {
class Module;
}

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::pretrained {

// The model types the in-tree model plugins import, for errors that name another one.
inline constexpr const char* kImportable =
    "gpt2 (model = \"gpt\"), bert (model = \"bert\"), llama (model = \"llama\")";

// A save_pretrained folder, opened: config.json's text and every tensor's header (shards and
// the index checked: a missing shard file or a tensor the index names but no file holds is a
// CheckpointError naming it). Tensors are read one at a time.
class Folder {
 public:
  explicit Folder(const std::filesystem::path& dir);
  const std::filesystem::path& dir() const { return dir_; }
  const std::string& config_text() const { return config_; }
  std::filesystem::path config_path() const { return dir_ / "config.json"; }
  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  std::vector<int64_t> shape(const std::string& name) const;
  // The tensor in its stored dtype; a name the folder lacks is a CheckpointError naming it.
  at::Tensor read(const std::string& name) const;
  // The same values with nothing copied: a read-only view of the file's bytes mapped into
  // memory (a copy only where the file places the tensor off its element alignment). A reader
  // touches only the pages it reads, and the page cache holds one copy for every rank reading
  // the file; so a ZeRO-3 rank copies just its part of each unit weight (Note [Sharded
  // initialization] in loom/nn.h). The view must not be written to.
  at::Tensor map(const std::string& name) const;

 private:
  std::filesystem::path dir_;
  std::string config_;
  std::map<std::string, std::filesystem::path> where_;  // tensor -> its file
};

// Copies `tensors` (the module's own names) into the module's parameters and persistent
// buffers, converted to each one's dtype (a weight released by the unit build observer gets
// only the elements the observer keeps: Note [Sharded initialization] in loom/nn.h). Every parameter must be given and nothing else: a
// missing or unexpected name, or another shape, is a CheckpointError naming the tensor (and
// both shapes) and `source`.
void assign(torch::nn::Module& module, const NamedTensors& tensors, const std::string& source);

// What a model plugin exports: config.json's text and the tensors by transformers' names.
struct Export {
  std::string config_json;
  NamedTensors tensors;
  std::vector<std::filesystem::path> files;  // copied in as they are (the tokenizer's files)
};

// Writes a folder transformers' from_pretrained loads: config.json, model.safetensors
// (metadata format "pt") and model.files, under a temporary name renamed at the end: `dir` appears whole or not
// at all. An existing non-empty `dir` is refused (CheckpointError), not overwritten.
void write_folder(const std::filesystem::path& dir, const Export& model);

}  // namespace loom::pretrained

#pragma GCC visibility pop
