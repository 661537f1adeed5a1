// The parsers of checkpoint_format.h. Every number taken from a file is checked for its JSON
// type and range before it is converted: nlohmann's get<int>() of 1e300 or of 2^64-1 converts
// silently (or, for a double out of range, is undefined), and an element count multiplied out
// of a shape can wrap to a small one that then passes the byte-range check.
#include "checkpoint_format.h"

#include <algorithm>
#include <boost/crc.hpp>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/error.h"

namespace loom::format {
namespace {

using json = nlohmann::json;

struct DtypeSize {
  const char* name;
  size_t bytes;
};
constexpr DtypeSize kDtypes[] = {{"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F64", 8}, {"I64", 8},
                                 {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U8", 1},  {"BOOL", 1}};

constexpr uint64_t kMaxHeader = 100ull << 20;  // the reference implementation's limit
constexpr size_t kMaxDims = 64;

// Reads fields of a parsed JSON document; any problem is a CheckpointError "<prefix><problem>
// <suffix>".
struct Fields {
  std::string prefix, suffix;

  [[noreturn]] void fail(const std::string& problem) const {
    throw CheckpointError(prefix + problem + suffix);
  }
  const json& at(const json& object, const std::string& key, const std::string& where) const {
    if (!object.is_object()) fail(where + " is not a JSON object");
    auto it = object.find(key);
    if (it == object.end()) fail("a field is missing (key '" + key + "' not found)" +
                                 (where.empty() ? "" : " in " + where));
    return *it;
  }
  int64_t integer(const json& value, const std::string& field, int64_t min, int64_t max) const {
    bool ok = false;
    int64_t out = 0;
    if (value.is_number_unsigned()) {
      const uint64_t u = value.get<uint64_t>();
      ok = u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
      out = static_cast<int64_t>(u);
    } else if (value.is_number_integer()) {
      ok = true;
      out = value.get<int64_t>();
    }
    if (!ok) fail("a field has the wrong type (" + field + " is " + value.dump() +
                  ", not an integer)");
    if (out < min || out > max)
      fail(max == std::numeric_limits<int64_t>::max()
               ? detail::cat(field, " is ", out, ", it must be >= ", min)
               : detail::cat(field, " is ", out, ", it must be in [", min, ", ", max, "]"));
    return out;
  }
  uint64_t unsigned_integer(const json& value, const std::string& field, uint64_t max) const {
    if (!value.is_number_unsigned() && !(value.is_number_integer() && value.get<int64_t>() >= 0))
      fail("a field has the wrong type (" + field + " is " + value.dump() +
           ", not an integer >= 0)");
    const uint64_t out = value.get<uint64_t>();
    if (out > max) fail(detail::cat(field, " is ", out, ", it must be <= ", max));
    return out;
  }
  std::string string(const json& value, const std::string& field) const {
    if (!value.is_string())
      fail("a field has the wrong type (" + field + " is " + value.dump() + ", not a string)");
    return value.get<std::string>();
  }
  std::map<std::string, std::string> strings(const json& value, const std::string& field) const {
    if (!value.is_object()) fail("a field has the wrong type (" + field + " is not an object)");
    std::map<std::string, std::string> out;
    for (const auto& [key, item] : value.items()) out[key] = string(item, field + "." + key);
    return out;
  }
  std::vector<std::string> string_list(const json& value, const std::string& field) const {
    if (!value.is_array()) fail("a field has the wrong type (" + field + " is not an array)");
    std::vector<std::string> out;
    for (const auto& item : value) out.push_back(string(item, field + " item"));
    return out;
  }
  std::vector<int64_t> shape(const json& value, const std::string& field) const {
    if (!value.is_array() || value.size() > kMaxDims)
      fail(detail::cat("a field has the wrong type (", field, " is not an array of at most ",
                       kMaxDims, " dimensions)"));
    std::vector<int64_t> out;
    for (const auto& d : value)
      out.push_back(integer(d, field + " dimension", 0, std::numeric_limits<int64_t>::max()));
    return out;
  }
};

// A name given twice in one JSON object: nlohmann keeps the last silently, and two readers
// could then see two different files (the reference safetensors reader refuses it).
struct DuplicateKey {
  std::string key;
};

json parse_json(std::string_view text, const Fields& fields) {
  std::vector<std::set<std::string>> open;  // the keys of each object being parsed
  const json::parser_callback_t refuse_duplicates = [&open](int, json::parse_event_t event,
                                                            json& parsed) {
    if (event == json::parse_event_t::object_start) open.emplace_back();
    if (event == json::parse_event_t::object_end && !open.empty()) open.pop_back();
    if (event == json::parse_event_t::key && !open.empty() &&
        !open.back().insert(parsed.get<std::string>()).second)
      throw DuplicateKey{parsed.get<std::string>()};
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), refuse_duplicates);
  } catch (const DuplicateKey& duplicate) {
    fields.fail("it names '" + duplicate.key + "' twice in one object");
  } catch (const json::exception& error) {
    std::string what = error.what();
    const auto bracket = what.find("] ");
    fields.fail("not valid JSON (" + (bracket == std::string::npos ? what : what.substr(bracket + 2)) +
                ")");
  }
}

constexpr const char* kManifestChecksum = "manifest_crc32";

uint32_t content_checksum(json doc) {
  doc.erase(kManifestChecksum);
  boost::crc_32_type crc;
  const std::string canonical = doc.dump();  // compact, keys sorted (nlohmann::json's map)
  crc.process_bytes(canonical.data(), canonical.size());
  return crc.checksum();
}

// The checkpoint folder's own files only: a name, never a path.
void check_file_name(const std::string& name, const Fields& fields) {
  const bool ok = name.find('/') == std::string::npos && name.find('\0') == std::string::npos &&
                  name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0;
  if (!ok) fields.fail("it lists a file '" + name +
                       "', not a .safetensors file of the checkpoint's folder");
}

ListedFile listed_file(const std::string& name, const json& info, const std::string& where,
                       const Fields& fields) {
  check_file_name(name, fields);
  return {name,
          fields.unsigned_integer(fields.at(info, "bytes", where), where + ".bytes",
                                  std::numeric_limits<int64_t>::max()),
          static_cast<uint32_t>(fields.unsigned_integer(fields.at(info, "crc32", where),
                                                        where + ".crc32", UINT32_MAX))};
}

}  // namespace

size_t element_size_of(std::string_view dtype) {
  for (const auto& d : kDtypes)
    if (dtype == d.name) return d.bytes;
  return 0;
}

uint64_t safetensors_header_length(std::string_view prefix, uint64_t file_size,
                                   const std::string& file) {
  LOOM_CHECK_AS(CheckpointError, file_size >= 8 && prefix.size() >= 8, "'", file,
                "' is truncated (", file_size, " bytes): not a safetensors file");
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i)
    length |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[i])) << (8 * i);
  LOOM_CHECK_AS(CheckpointError, length <= kMaxHeader && 8 + length <= file_size, "'", file,
                "' is corrupt or truncated: its header claims ", length,
                " bytes but the file has ", file_size);
  return length;
}

SafetensorsHeader parse_safetensors_header(std::string_view text, uint64_t file_size,
                                           const std::string& file) {
  LOOM_INTERNAL_ASSERT(8 + text.size() <= file_size, "header longer than its file");
  const Fields fields{"'" + file + "' has a corrupt header: ", ""};
  const json header = parse_json(text, fields);
  if (!header.is_object()) fields.fail("not a JSON object");
  const uint64_t data_size = file_size - 8 - text.size();
  SafetensorsHeader out;
  out.data_start = 8 + text.size();
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      out.metadata = fields.strings(value, "__metadata__");
      continue;
    }
    const std::string where = "tensor '" + key + "'";
    TensorEntry entry;
    entry.name = key;
    entry.dtype = fields.string(fields.at(value, "dtype", where), where + " dtype");
    const size_t element = element_size_of(entry.dtype);
    if (element == 0) fields.fail(where + " has unsupported dtype " + entry.dtype);
    entry.shape = fields.shape(fields.at(value, "shape", where), where + " shape");
    const json& offsets = fields.at(value, "data_offsets", where);
    if (!offsets.is_array() || offsets.size() != 2)
      fields.fail(where + " data_offsets is not a pair [begin, end]");
    entry.begin = fields.unsigned_integer(offsets[0], where + " begin", UINT64_MAX);
    entry.end = fields.unsigned_integer(offsets[1], where + " end", UINT64_MAX);
    // Multiplied with overflow checks: a wrapped count could match a small byte range.
    uint64_t numel = 1, bytes = 0;
    bool overflow = false;
    for (int64_t d : entry.shape)
      overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel);
    overflow |= __builtin_mul_overflow(numel, element, &bytes);
    LOOM_CHECK_AS(CheckpointError,
                  !overflow && entry.begin <= entry.end && entry.end <= data_size &&
                      entry.end - entry.begin == bytes,
                  "'",
                  file, "' is corrupt or truncated: tensor '", key, "' claims bytes [",
                  entry.begin, ", ", entry.end, ") of ", data_size, " for ",
                  overflow ? std::string("too many") : std::to_string(numel), " elements");
    entry.numel = numel;
    out.entries.push_back(std::move(entry));
  }
  auto& entries = out.entries;
  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  for (size_t i = 1; i < entries.size(); ++i)
    LOOM_CHECK_AS(CheckpointError, entries[i - 1].end <= entries[i].begin, "'", file,
                  "' is corrupt: tensors '", entries[i - 1].name, "' and '", entries[i].name,
                  "' overlap");
  // The data section is the tensors' bytes and nothing else, as the reference reader requires:
  // no gap before or between them, no byte after the last.
  uint64_t expected = 0;
  for (const auto& entry : entries) {
    LOOM_CHECK_AS(CheckpointError, entry.begin == expected, "'", file, "' is corrupt: ",
                  entry.begin - expected, " bytes before tensor '", entry.name,
                  "' belong to no tensor");
    expected = entry.end;
  }
  LOOM_CHECK_AS(CheckpointError, expected == data_size, "'", file, "' is corrupt: ",
                data_size - expected, " bytes after the last tensor belong to no tensor (the "
                "file was appended to, or its header was edited)");
  return out;
}

uint32_t manifest_checksum(std::string_view text, const std::string& path) {
  const Fields fields{"'" + path + "' is corrupt: ", ""};
  return content_checksum(parse_json(text, fields));
}

Manifest parse_manifest(std::string_view text, const std::string& path) {
  const Fields fields{"'" + path + "' is corrupt: ",
                      "; resume from an earlier checkpoint or delete this one"};
  const json doc = parse_json(text, fields);
  // Note [Manifest checksum]: first, wherever it is present (a flipped version number must not
  // switch it off); then required from format 3 on.
  const bool has_checksum = doc.is_object() && doc.contains(kManifestChecksum);
  if (has_checksum) {
    const uint64_t stored = fields.unsigned_integer(doc[kManifestChecksum], kManifestChecksum,
                                                    UINT32_MAX);
    const uint32_t content = content_checksum(doc);
    LOOM_CHECK_AS(CheckpointError, stored == content, "'", path, "' is corrupt: its content does "
                  "not match its own checksum (manifest_crc32 ", stored, ", the content's ",
                  content, "): it was edited or damaged; resume from an earlier checkpoint or "
                  "delete this one");
  }
  LOOM_CHECK_AS(CheckpointError,
                doc.is_object() && doc.contains("format") && doc["format"] == kManifestFormat,
                "'", path, "' is not a loom checkpoint manifest");
  Manifest m;
  const json& version = fields.at(doc, "format_version", "");
  LOOM_CHECK_AS(CheckpointError, version == 1 || version == 2 || version == kManifestVersion,
                "'", path, "' has format version ", version.dump(),
                "; this loom reads versions 1 to ", kManifestVersion);
  m.version = version.get<int>();
  LOOM_CHECK_AS(CheckpointError, m.version < 3 || has_checksum, "'", path, "' is corrupt: a "
                "format ", m.version, " manifest without its manifest_crc32; resume from an "
                "earlier checkpoint or delete this one");
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  auto integer = [&](const json& object, const char* key, const std::string& where, int64_t min,
                     int64_t max) {
    return fields.integer(fields.at(object, key, where), where.empty() ? key : where + "." + key,
                          min, max);
  };
  m.step = integer(doc, "step", "", 0, kMax);
  m.seed = fields.unsigned_integer(fields.at(doc, "seed", ""), "seed", UINT64_MAX);
  m.config_hash = fields.string(fields.at(doc, "config_hash", ""), "config_hash");
  m.update_rule = fields.string(fields.at(doc, "update_rule", ""), "update_rule");
  m.world_size = static_cast<int>(integer(doc, "world_size", "", 1, 1 << 24));
  const json& data = fields.at(doc, "data", "");
  m.epoch = integer(data, "epoch", "data", 0, kMax);
  m.cursor = integer(data, "cursor", "data", 0, kMax);
  m.skipped_updates = integer(doc, "skipped_updates", "", 0, kMax);
  const json& scale = fields.at(doc, "loss_scale", "");
  if (!scale.is_number()) fields.fail("a field has the wrong type (loss_scale is not a number)");
  m.loss_scale = scale.get<double>();
  if (!std::isfinite(m.loss_scale) || m.loss_scale <= 0)
    fields.fail(detail::cat("loss_scale is ", m.loss_scale,
                            ", it must be a positive finite number"));
  m.values = fields.strings(fields.at(doc, "values", ""), "values");
  if (doc.contains("job")) {  // since loom 0.1.0's export: the run's job, for `loom export`
    const json& job = doc["job"];
    m.job_text = fields.string(fields.at(job, "text", "job"), "job.text");
    m.job_dir = fields.string(fields.at(job, "dir", "job"), "job.dir");
  }
  if (doc.contains("labels"))  // since loom 0.1.0's datasets: classification names by id
    m.label_names = fields.string_list(fields.at(doc, "labels", ""), "labels");
  const json& files = fields.at(doc, "files", "");
  if (!files.is_object()) fields.fail("a field has the wrong type (files is not an object)");
  for (const auto& [name, info] : files.items())
    m.files.push_back(listed_file(name, info, "files['" + name + "']", fields));
  if (m.version >= 2) {
    const json& shards = fields.at(doc, "optimizer_shards", "");
    if (!shards.is_array())
      fields.fail("a field has the wrong type (optimizer_shards is not an array)");
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string where = detail::cat("optimizer_shards[", i, "]");
      const std::string name = fields.string(fields.at(shards[i], "file", where), where + ".file");
      m.optimizer_shards.push_back(listed_file(name, shards[i], where, fields));
    }
  }
  return m;
}

std::map<std::string, PieceLayout> parse_shard_layout(
    const std::map<std::string, std::string>& metadata, int64_t step, const std::string& file) {
  const auto layout = metadata.find("layout");
  const auto saved_step = metadata.find("step");
  LOOM_CHECK_AS(CheckpointError, layout != metadata.end() && saved_step != metadata.end(),
                "optimizer shard '", file, "' lacks its layout metadata; it is not a loom shard");
  const Fields fields{"optimizer shard '" + file + "' has corrupt layout metadata: ", ""};
  const json saved = parse_json(saved_step->second, fields);
  const int64_t saved_at = fields.integer(saved, "step", 0, std::numeric_limits<int64_t>::max());
  LOOM_CHECK_AS(CheckpointError, saved_at == step, "optimizer shard '", file, "' is from step ",
                saved_at, " but the checkpoint is of step ", step,
                "; the shards come from different checkpoints");
  const json map = parse_json(layout->second, fields);
  if (!map.is_object()) fields.fail("not a JSON object");
  std::map<std::string, PieceLayout> out;
  for (const auto& [name, piece] : map.items()) {
    const std::string where = "'" + name + "'";
    PieceLayout p;
    p.global_shape = fields.shape(fields.at(piece, "shape", where), where + " shape");
    p.offset = fields.integer(fields.at(piece, "offset", where), where + " offset", 0,
                              std::numeric_limits<int64_t>::max());
    if (piece.contains("tensor_shape"))
      p.tensor_shape = fields.shape(piece["tensor_shape"], where + " tensor_shape");
    out.emplace(name, std::move(p));
  }
  return out;
}

}  // namespace loom::format
