// loom/safetensors.h — reading and writing the safetensors format: u64 little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then
// the raw little-endian bytes. Files Python's safetensors/torch read, and that loom reads back
// with every bound checked: a truncated or corrupt file is a CheckpointError naming the file.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>

#include "loom/update_rule.h"  // NamedTensors

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::safetensors {

using Metadata = std::map<std::string, std::string>;

// Writes atomically: a temporary name in the same folder, fsync, rename, fsync the folder.
// Tensors are written contiguous, on the CPU, in their dtype. Names must be unique.
void save(const std::filesystem::path& file, const NamedTensors& tensors,
          const Metadata& metadata = {});

struct Contents {
  NamedTensors tensors;  // in file order (sorted by offset)
  Metadata metadata;
};
Contents load(const std::filesystem::path& file);

}  // namespace loom::safetensors

#pragma GCC visibility pop
