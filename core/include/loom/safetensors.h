// loom/safetensors.h — reading and writing the safetensors format: u64 little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then
// the raw little-endian bytes. Files Python's safetensors/torch read, and that loom reads back
// with every bound checked: a truncated or corrupt file is a CheckpointError naming the file.
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loom/update_rule.h"  // NamedTensors

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::safetensors {

using Metadata = std::map<std::string, std::string>;

// Writes atomically: a temporary name in the same folder, fsync, rename, fsync the folder.
// Tensors are written contiguous, on the CPU, in their dtype. Names must be unique.
void save(const std::filesystem::path& file, const NamedTensors& tensors,
          const Metadata& metadata = {});

// A tensor whose values are produced when the writer reaches it: the header needs only its
// dtype and shape, so a file larger than memory is written one tensor at a time (an offloaded
// optimizer state read back from its swap file piece by piece). `produce` is called once, in
// file order, and must return a tensor of that dtype and shape (any device).
struct StreamedTensor {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::function<at::Tensor()> produce;
};
// As save (atomic, the same format), holding one tensor at a time.
void save_streamed(const std::filesystem::path& file, const std::vector<StreamedTensor>& tensors,
                   const Metadata& metadata = {});

struct Contents {
  NamedTensors tensors;  // in file order (sorted by offset)
  Metadata metadata;
};
Contents load(const std::filesystem::path& file);

// Reading tensor by tensor (peak memory: one tensor): the header, checked against the file's
// size, then any tensor of it.
struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
  uint64_t numel() const {  // checked against the byte range when the header was read
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
};
struct Header {
  std::vector<Entry> entries;  // in file order
  Metadata metadata;
  uint64_t data_start = 0;
};
Header read_header(const std::filesystem::path& file);
// The format's name of a dtype ("F32", "BF16"...); a dtype it cannot store is a CheckpointError.
const char* dtype_name(at::ScalarType type);
at::Tensor read_tensor(const std::filesystem::path& file, const Header& header,
                       const Entry& entry);

}  // namespace loom::safetensors

#pragma GCC visibility pop
