// loom/hf_config.h — a transformers config.json, read with checks, for model plugins that import
// save_pretrained folders: a field of the wrong type is a ConfigError naming the file, the key
// and the value; an absent or null field gives the default. Header-only (nlohmann/json).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "loom/error.h"
#include "loom/pretrained.h"

namespace loom::pretrained {

class HfConfig {
 public:
  // config.json of `folder`; text that is not JSON is a ConfigError naming the file.
  explicit HfConfig(const Folder& folder) : file_(folder.config_path().string()) {
    try {
      json_ = nlohmann::json::parse(folder.config_text());
    } catch (const nlohmann::json::exception& error) {
      throw ConfigError(detail::cat("'", file_, "' is not valid JSON: ", error.what()));
    }
    LOOM_CHECK_AS(ConfigError, json_.is_object(), "'", file_, "' is not a JSON object");
  }

  const nlohmann::json& json() const { return json_; }
  const std::string& file() const { return file_; }
  // model_type, or "(none)".
  std::string type() const { return text("model_type", "(none)"); }

  int64_t integer(const char* key, int64_t def) const {
    if (absent(key)) return def;
    LOOM_CHECK_AS(ConfigError, json_[key].is_number_integer(), "'", file_, "': ", key, " is ",
                  json_[key].dump(), ", not an integer");
    return json_[key].get<int64_t>();
  }
  int64_t positive(const char* key, int64_t def) const {
    const int64_t value = integer(key, def);
    LOOM_CHECK_AS(ConfigError, value > 0, "'", file_, "': ", key, " is ", value,
                  ", not a positive integer");
    return value;
  }
  double number(const char* key, double def) const {
    if (absent(key)) return def;
    LOOM_CHECK_AS(ConfigError, json_[key].is_number(), "'", file_, "': ", key, " is ",
                  json_[key].dump(), ", not a number");
    return json_[key].get<double>();
  }
  bool flag(const char* key, bool def) const {
    if (absent(key)) return def;
    LOOM_CHECK_AS(ConfigError, json_[key].is_boolean(), "'", file_, "': ", key, " is ",
                  json_[key].dump(), ", not true or false");
    return json_[key].get<bool>();
  }
  std::string text(const char* key, const std::string& def) const {
    if (absent(key)) return def;
    LOOM_CHECK_AS(ConfigError, json_[key].is_string(), "'", file_, "': ", key, " is ",
                  json_[key].dump(), ", not a string");
    return json_[key].get<std::string>();
  }
  // A nested object (rope_parameters...), read the same way; empty when absent or null.
  HfConfig object(const char* key) const {
    if (absent(key)) return HfConfig(nlohmann::json::object(), file_);
    LOOM_CHECK_AS(ConfigError, json_[key].is_object(), "'", file_, "': ", key, " is ",
                  json_[key].dump(), ", not an object");
    return HfConfig(json_[key], file_);
  }
  bool has(const char* key) const { return !absent(key); }

 private:
  HfConfig(nlohmann::json json, std::string file) : json_(std::move(json)), file_(std::move(file)) {}
  bool absent(const char* key) const { return !json_.contains(key) || json_[key].is_null(); }
  nlohmann::json json_;
  std::string file_;
};

}  // namespace loom::pretrained
