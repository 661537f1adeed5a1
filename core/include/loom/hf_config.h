// loom/hf_config.h — a transformers config.json, read with checks, for model plugins that import
// save_pretrained folders: a field of the wrong type is a ConfigError naming the file, the key
// and the value; an absent or null field gives the default. And model_limit(), the model's
// vocabulary or classes as a job states them, for data sources. Header-only (nlohmann/json).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "loom/config.h"
#include "loom/error.h"
#include "loom/pretrained.h"

namespace loom::pretrained {

// A config.json's classes where it names them: the size of a non-empty id2label object, which
// is where save_pretrained records a classifier's classes (it writes no num_labels); 0 when
// there is none. A hand-written file whose num_labels disagrees with its id2label is counted by
// id2label, as transformers 4 does (5 warns and takes num_labels).
inline int64_t id2label_count(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("id2label")) return 0;
  const auto& map = config["id2label"];
  return map.is_object() ? static_cast<int64_t>(map.size()) : 0;
}

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
  // A classifier's classes: id2label's (id2label_count), else num_labels, else `def`.
  int64_t num_labels(int64_t def) const {
    const int64_t named = id2label_count(json_);
    return named > 0 ? named : positive("num_labels", def);
  }

 private:
  HfConfig(nlohmann::json json, std::string file) : json_(std::move(json)), file_(std::move(file)) {}
  bool absent(const char* key) const { return !json_.contains(key) || json_[key].is_null(); }
  nlohmann::json json_;
  std::string file_;
};

// Note [Data against the model] (core/src/builtin.cpp): the model's `key` (vocab_size or
// num_labels) as the job states it, in transformers' names: the [model] table's key, or its
// from_pretrained folder's config.json (num_labels there: id2label_count first). value 0: the
// job states none. Read leniently, since the model plugin's own import is what reports a folder
// without config.json, text that is not JSON or a field of the wrong type: here those give no
// limit, so the data source's check never speaks first about the model's file.
struct ModelLimit {
  int64_t value = 0;
  std::string source;  // for messages: "[model] vocab_size (job.toml:12)"
};
inline ModelLimit model_limit(const ConfigSection* model,
                              const std::function<std::string(const std::string&)>& resolve_path,
                              const char* key) {
  if (!model) return {};
  const bool pretrained = model->schema().find("from_pretrained") &&
                          !model->get_string("from_pretrained").empty();
  if (model->schema().find(key) && (model->has(key) || !pretrained))
    return {model->get_int(key), detail::cat("[model] ", key, " (", model->where(key), ")")};
  if (!pretrained) return {};
  const std::string file =
      (std::filesystem::path(resolve_path(model->get_string("from_pretrained"))) /
       "config.json").string();
  std::ifstream in(file);
  if (!in) return {};
  const auto config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object()) return {};
  const std::string name = key;
  if (name == "num_labels")
    if (const int64_t named = id2label_count(config); named > 0)
      return {named, "the id2label of '" + file + "'"};
  if (!config.contains(name) || !config[name].is_number_integer()) return {};
  return {config[name].get<int64_t>(), detail::cat(name, " of '", file, "'")};
}

}  // namespace loom::pretrained
