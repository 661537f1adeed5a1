// loom/config.h — job-file values, the schemas plugins declare, and the typed view a plugin
// reads its table through. Not the TOML parser: the core parses the file (TOML++) and hands
// plugins these types, so the SDK does not expose TOML++.
//
// Every value remembers where it came from ("job.toml:12" or "--set train.max_steps=3"), so
// errors can name the place.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "loom/error.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

enum class ValueType { Int, Float, Bool, String, Array, Table, Any };
const char* to_string(ValueType type);

struct ConfigValue;
using ConfigTable = std::vector<std::pair<std::string, ConfigValue>>;
using ConfigArray = std::vector<ConfigValue>;

struct ConfigValue {
  std::variant<std::monostate, int64_t, double, bool, std::string, ConfigArray, ConfigTable> value;
  std::string where;  // "file:line" or "--set key=value"

  ValueType type() const;
  bool is_table() const { return std::holds_alternative<ConfigTable>(value); }
  const ConfigValue* find(std::string_view key) const;  // tables only; nullptr if absent
  ConfigValue* find(std::string_view key);
  std::string to_text() const;  // TOML-like rendering, for logs and the config hash
};

// One key of a schema: name, type, default and a one-line doc (shown by `loom plugins`).
struct KeySpec {
  std::string name;
  ValueType type = ValueType::Any;
  std::optional<ConfigValue> default_value;  // absent and !required: the key is optional
  std::string doc;
  bool required = false;
};

// The keys a table accepts. `table` is the job-file table ("model", "optimizer", "lora"...);
// for the selector tables (model, data, optimizer) `provider` names the choice this schema
// belongs to ("gpt", "text", "adamw").
class Schema {
 public:
  Schema() = default;
  Schema(std::string table, std::string provider = "")
      : table_(std::move(table)), provider_(std::move(provider)) {}

  Schema& key_int(const std::string& name, int64_t def, const std::string& doc);
  Schema& key_float(const std::string& name, double def, const std::string& doc);
  Schema& key_bool(const std::string& name, bool def, const std::string& doc);
  Schema& key_string(const std::string& name, const std::string& def, const std::string& doc);
  Schema& key_required(const std::string& name, ValueType type, const std::string& doc);
  Schema& key_optional(const std::string& name, ValueType type, const std::string& doc);
  Schema& add(KeySpec spec);

  const std::string& table() const { return table_; }
  const std::string& provider() const { return provider_; }
  const std::vector<KeySpec>& keys() const { return keys_; }
  const KeySpec* find(std::string_view name) const;

 private:
  std::string table_, provider_;
  std::vector<KeySpec> keys_;
};

// A validated table of the job file, read through its schema: get_*() returns the job's value
// or the schema's default. Asking for a key the schema does not declare is a bug
// (InternalError); a wrong type was already reported when the job was validated.
class ConfigSection {
 public:
  ConfigSection() = default;
  ConfigSection(std::string name, ConfigTable values, Schema schema, std::string file);

  const std::string& name() const { return name_; }
  bool has(std::string_view key) const;  // set in the job (not a default)
  int64_t get_int(std::string_view key) const;
  double get_float(std::string_view key) const;  // ints are widened
  bool get_bool(std::string_view key) const;
  std::string get_string(std::string_view key) const;
  std::vector<std::string> get_strings(std::string_view key) const;  // a string or an array
  const ConfigValue* get(std::string_view key) const;  // job value or default; may be nullptr
  // "job.toml:12" for a key set in the job, else "<file> [table]".
  std::string where(std::string_view key) const;
  const Schema& schema() const { return schema_; }
  const ConfigTable& values() const { return values_; }

 private:
  const ConfigValue& require(std::string_view key, ValueType type) const;
  std::string name_, file_;
  ConfigTable values_;
  Schema schema_;
};

// Levenshtein-nearest candidate within a small distance, for "did you mean" hints.
std::optional<std::string> closest_match(std::string_view word,
                                         const std::vector<std::string>& candidates);

}  // namespace loom

#pragma GCC visibility pop
