// checkpoint_format.h (core-internal) — the parsers of what a checkpoint's files say about
// themselves: a safetensors header, manifest.json, an optimizer shard's "layout" metadata.
// No LibTorch here on purpose: these parsers take bytes from disk that anyone may have edited,
// so they are built alone with clang's fuzzer and sanitizers (tests/fuzz). Any input ends in a
// parsed value whose every number is bounded, or a CheckpointError naming the file.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace loom::format {

// ---- safetensors --------------------------------------------------------------------------

// The dtypes loom stores, by the format's names: "F32", "BF16", ...; 0 for an unknown name.
size_t element_size_of(std::string_view dtype);

struct TensorEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint64_t begin = 0, end = 0;  // byte range within the data section
};
struct SafetensorsHeader {
  std::vector<TensorEntry> entries;  // sorted by begin, non-overlapping
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + the header's length
};
// The header's length from a file's first 8 bytes (`prefix`, little-endian u64), checked
// against the file's size and the format's 100 MiB limit. `file` names the file in errors.
uint64_t safetensors_header_length(std::string_view prefix, uint64_t file_size,
                                   const std::string& file);
// The JSON header (the `header_length` bytes after the prefix) of a file of `file_size` bytes.
SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t file_size,
                                           const std::string& file);

// ---- manifest.json ------------------------------------------------------------------------

constexpr const char* kManifestFormat = "loom-checkpoint";
constexpr int kManifestVersion = 3;

// Note [Manifest checksum]: manifest.json carries the checksums of the checkpoint's other files,
// and since format 3 one of its own, "manifest_crc32": crc32 (IEEE) of its canonical content,
// every other field as a compact JSON dump with sorted keys, so an edit or a flipped byte in any
// field (one loom does not read included) is refused before any field is read; spacing and key
// order are not content. The checksum of a manifest's JSON text (a "manifest_crc32" in it left
// out); a CheckpointError naming `path` if the text is not JSON.
uint32_t manifest_checksum(std::string_view text, const std::string& path);

struct ListedFile {
  std::string name;  // a .safetensors file of the checkpoint's folder, no path
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};
struct Manifest {
  int version = 0;
  int64_t step = 0;
  uint64_t seed = 0;
  std::string config_hash, update_rule;
  int world_size = 1;
  int64_t epoch = 0, cursor = 0;
  int64_t skipped_updates = 0;
  double loss_scale = 1.0;
  std::map<std::string, std::string> values;  // plugins' manifest values
  std::string job_text, job_dir;  // the run's job (canonical text) and its folder; "" if older
  std::vector<std::string> label_names;  // "labels": the data's label map; empty if none
  std::vector<ListedFile> files;              // verified up front
  std::vector<ListedFile> optimizer_shards;   // format 2
};
Manifest parse_manifest(std::string_view text, const std::string& path);

// ---- an optimizer shard's layout ----------------------------------------------------------

struct PieceLayout {
  std::vector<int64_t> global_shape;
  int64_t offset = 0;                 // the piece's first row in the global tensor
  std::vector<int64_t> tensor_shape;  // a flattened tensor's own shape, or empty
};
// The metadata "layout" (JSON: name -> {shape, offset, tensor_shape?}) and "step" of an
// optimizer shard written at checkpoint step `step`.
std::map<std::string, PieceLayout> parse_shard_layout(
    const std::map<std::string, std::string>& metadata, int64_t step, const std::string& file);

}  // namespace loom::format
