// Schemas, config values and the typed section view (the SDK half of configuration; the TOML
// parsing and validation against schemas is job.cpp).
#include "loom/config.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace loom {

const char* to_string(ValueType type) {
  switch (type) {
    case ValueType::Int: return "integer";
    case ValueType::Float: return "float";
    case ValueType::Bool: return "boolean";
    case ValueType::String: return "string";
    case ValueType::Array: return "array";
    case ValueType::Table: return "table";
    case ValueType::Any: return "any";
  }
  return "?";
}

ValueType ConfigValue::type() const {
  switch (value.index()) {
    case 1: return ValueType::Int;
    case 2: return ValueType::Float;
    case 3: return ValueType::Bool;
    case 4: return ValueType::String;
    case 5: return ValueType::Array;
    case 6: return ValueType::Table;
    default: return ValueType::Any;
  }
}

const ConfigValue* ConfigValue::find(std::string_view key) const {
  const auto* table = std::get_if<ConfigTable>(&value);
  if (!table) return nullptr;
  for (const auto& [name, child] : *table)
    if (name == key) return &child;
  return nullptr;
}

ConfigValue* ConfigValue::find(std::string_view key) {
  return const_cast<ConfigValue*>(static_cast<const ConfigValue*>(this)->find(key));
}

std::string ConfigValue::to_text() const {
  std::ostringstream out;
  switch (value.index()) {
    case 1: out << std::get<int64_t>(value); break;
    case 2: out << std::setprecision(17) << std::get<double>(value); break;
    case 3: out << (std::get<bool>(value) ? "true" : "false"); break;
    case 4: out << std::quoted(std::get<std::string>(value)); break;
    case 5: {
      out << "[";
      const auto& array = std::get<ConfigArray>(value);
      for (size_t i = 0; i < array.size(); ++i) out << (i ? ", " : "") << array[i].to_text();
      out << "]";
      break;
    }
    case 6: {
      out << "{";
      const auto& table = std::get<ConfigTable>(value);
      for (size_t i = 0; i < table.size(); ++i)
        out << (i ? ", " : "") << table[i].first << " = " << table[i].second.to_text();
      out << "}";
      break;
    }
    default: out << "<none>";
  }
  return out.str();
}

Schema& Schema::add(KeySpec spec) {
  LOOM_INTERNAL_ASSERT(!find(spec.name), "schema [", table_, "] declares '", spec.name,
                       "' twice");
  keys_.push_back(std::move(spec));
  return *this;
}
Schema& Schema::key_int(const std::string& name, int64_t def, const std::string& doc) {
  return add({name, ValueType::Int, ConfigValue{def, "default"}, doc, false});
}
Schema& Schema::key_float(const std::string& name, double def, const std::string& doc) {
  return add({name, ValueType::Float, ConfigValue{def, "default"}, doc, false});
}
Schema& Schema::key_bool(const std::string& name, bool def, const std::string& doc) {
  return add({name, ValueType::Bool, ConfigValue{def, "default"}, doc, false});
}
Schema& Schema::key_string(const std::string& name, const std::string& def,
                           const std::string& doc) {
  return add({name, ValueType::String, ConfigValue{def, "default"}, doc, false});
}
Schema& Schema::key_required(const std::string& name, ValueType type, const std::string& doc) {
  return add({name, type, std::nullopt, doc, true});
}
Schema& Schema::key_optional(const std::string& name, ValueType type, const std::string& doc) {
  return add({name, type, std::nullopt, doc, false});
}
const KeySpec* Schema::find(std::string_view name) const {
  for (const auto& key : keys_)
    if (key.name == name) return &key;
  return nullptr;
}

ConfigSection::ConfigSection(std::string name, ConfigTable values, Schema schema,
                             std::string file)
    : name_(std::move(name)), file_(std::move(file)), values_(std::move(values)),
      schema_(std::move(schema)) {}

bool ConfigSection::has(std::string_view key) const {
  for (const auto& [name, value] : values_)
    if (name == key) return true;
  return false;
}

const ConfigValue* ConfigSection::get(std::string_view key) const {
  for (const auto& [name, value] : values_)
    if (name == key) return &value;
  const KeySpec* spec = schema_.find(key);
  LOOM_INTERNAL_ASSERT(spec, "[", name_, "] has no key '", key, "' in its schema");
  return spec->default_value ? &*spec->default_value : nullptr;
}

const ConfigValue& ConfigSection::require(std::string_view key, ValueType type) const {
  const ConfigValue* value = get(key);
  LOOM_CHECK_AS(ConfigError, value, file_, ": [", name_, "] needs '", key,
                "' (", to_string(type), ")");
  return *value;
}

int64_t ConfigSection::get_int(std::string_view key) const {
  const ConfigValue& value = require(key, ValueType::Int);
  if (const auto* i = std::get_if<int64_t>(&value.value)) return *i;
  // Floats that are whole numbers (1e6) are accepted where an integer is wanted.
  if (const auto* d = std::get_if<double>(&value.value); d && std::floor(*d) == *d)
    return static_cast<int64_t>(*d);
  throw ConfigError(detail::cat(value.where, ": [", name_, "] ", key,
                                " must be an integer, not ", value.to_text()));
}

double ConfigSection::get_float(std::string_view key) const {
  const ConfigValue& value = require(key, ValueType::Float);
  if (const auto* d = std::get_if<double>(&value.value)) return *d;
  if (const auto* i = std::get_if<int64_t>(&value.value)) return static_cast<double>(*i);
  throw ConfigError(detail::cat(value.where, ": [", name_, "] ", key,
                                " must be a number, not ", value.to_text()));
}

bool ConfigSection::get_bool(std::string_view key) const {
  const ConfigValue& value = require(key, ValueType::Bool);
  if (const auto* b = std::get_if<bool>(&value.value)) return *b;
  throw ConfigError(detail::cat(value.where, ": [", name_, "] ", key,
                                " must be true or false, not ", value.to_text()));
}

std::string ConfigSection::get_string(std::string_view key) const {
  const ConfigValue& value = require(key, ValueType::String);
  if (const auto* s = std::get_if<std::string>(&value.value)) return *s;
  throw ConfigError(detail::cat(value.where, ": [", name_, "] ", key,
                                " must be a string, not ", value.to_text()));
}

std::vector<std::string> ConfigSection::get_strings(std::string_view key) const {
  const ConfigValue* value = get(key);
  if (!value) return {};
  if (const auto* s = std::get_if<std::string>(&value->value)) return {*s};
  std::vector<std::string> out;
  if (const auto* array = std::get_if<ConfigArray>(&value->value)) {
    for (const auto& item : *array) {
      const auto* s = std::get_if<std::string>(&item.value);
      LOOM_CHECK_AS(ConfigError, s, item.where, ": [", name_, "] ", key,
                    " must hold strings only, not ", item.to_text());
      out.push_back(*s);
    }
    return out;
  }
  throw ConfigError(detail::cat(value->where, ": [", name_, "] ", key,
                                " must be a string or an array of strings, not ",
                                value->to_text()));
}

std::string ConfigSection::where(std::string_view key) const {
  for (const auto& [name, value] : values_)
    if (name == key) return value.where;
  return detail::cat(file_, " [", name_, "]");
}

std::optional<std::string> closest_match(std::string_view word,
                                         const std::vector<std::string>& candidates) {
  auto distance = [](std::string_view a, std::string_view b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        size_t above = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
        diagonal = above;
      }
    }
    return row[b.size()];
  };
  std::optional<std::string> best;
  size_t best_distance = std::max<size_t>(2, word.size() / 3) + 1;
  for (const auto& candidate : candidates) {
    size_t d = distance(word, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  return best;
}

}  // namespace loom
