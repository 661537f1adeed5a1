// The SDK's reading of a transformers config.json (loom/hf_config.h): the model's vocabulary and
// classes as a job states them, which every data source checks its data against (Note [Data
// against the model]), and a classifier's classes as the model plugins import them: a
// save_pretrained folder's id2label (transformers writes no num_labels) names them.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "loom/hf_config.h"
#include "test_util.h"

namespace loom {
namespace {

using pretrained::model_limit;

using Value = decltype(ConfigValue::value);

// A [model] table of a model with from_pretrained, vocab_size and num_labels keys, `set` in the
// job at job.toml:2, 3, ...
ConfigSection model_table(const std::vector<std::pair<std::string, Value>>& set) {
  Schema schema("model", "bert");
  schema.key_string("from_pretrained", "", "folder")
      .key_int("vocab_size", 30522, "ids")
      .key_int("num_labels", 2, "classes");
  ConfigTable values;
  int line = 2;
  for (const auto& [key, value] : set)
    values.emplace_back(key, ConfigValue{value, "job.toml:" + std::to_string(line++)});
  return ConfigSection("model", values, schema, "job.toml");
}

class HfConfigLimits : public testing::Test {
 protected:
  pretrained::ModelLimit limit(const ConfigSection& model, const char* key) {
    return model_limit(
        &model, [this](const std::string& path) { return (dir_.path() / path).string(); }, key);
  }
  std::string config_file() const { return (dir_.path() / "hf" / "config.json").string(); }
  test::TempDir dir_;
};

TEST_F(HfConfigLimits, TheJobsKeyWinsOverTheFolders) {
  std::filesystem::create_directories(dir_ / "hf");
  std::ofstream(dir_ / "hf" / "config.json") << R"({"vocab_size": 1000, "num_labels": 7})";
  const auto model =
      model_table({{"from_pretrained", std::string("hf")}, {"num_labels", int64_t{3}}});
  const auto classes = limit(model, "num_labels");
  EXPECT_EQ(classes.value, 3);
  EXPECT_EQ(classes.source, "[model] num_labels (job.toml:3)");
  // vocab_size is not set in the job: the folder's.
  const auto vocab = limit(model, "vocab_size");
  EXPECT_EQ(vocab.value, 1000);
  EXPECT_EQ(vocab.source, "vocab_size of '" + config_file() + "'");
}

TEST_F(HfConfigLimits, Id2labelCountsTheClasses) {
  std::filesystem::create_directories(dir_ / "hf");
  const auto model = model_table({{"from_pretrained", std::string("hf")}});
  // What BertConfig(id2label={0: "a", 1: "b", 2: "c"}).save_pretrained writes (label2id: null).
  std::ofstream(dir_ / "hf" / "config.json")
      << R"({"model_type": "bert", "id2label": {"0": "a", "1": "b", "2": "c"}, "label2id": null})";
  auto classes = limit(model, "num_labels");
  EXPECT_EQ(classes.value, 3);
  EXPECT_EQ(classes.source, "the id2label of '" + config_file() + "'");
  // A hand-written file whose num_labels disagrees: id2label counts (transformers 4's rule).
  std::ofstream(dir_ / "hf" / "config.json")
      << R"({"num_labels": 5, "id2label": {"0": "a", "1": "b", "2": "c"}})";
  EXPECT_EQ(limit(model, "num_labels").value, 3);
  // An empty id2label names no class: num_labels counts.
  std::ofstream(dir_ / "hf" / "config.json") << R"({"num_labels": 5, "id2label": {}})";
  classes = limit(model, "num_labels");
  EXPECT_EQ(classes.value, 5);
  EXPECT_EQ(classes.source, "num_labels of '" + config_file() + "'");
  EXPECT_EQ(pretrained::id2label_count(nlohmann::json::parse(R"({"id2label": {"0": "x"}})")), 1);
  EXPECT_EQ(pretrained::id2label_count(nlohmann::json::parse(R"({"id2label": ["x"]})")), 0);
  EXPECT_EQ(pretrained::id2label_count(nlohmann::json::parse(R"({"num_labels": 4})")), 0);
}

// What the model plugin's import reports (no config.json, not JSON, a field of the wrong type)
// gives no limit here, so the model's own error, naming its file, is the one the user sees.
TEST_F(HfConfigLimits, WhatTheModelPluginReportsGivesNoLimit) {
  const auto model = model_table({{"from_pretrained", std::string("hf")}});
  EXPECT_EQ(limit(model, "vocab_size").value, 0);  // no folder
  std::filesystem::create_directories(dir_ / "hf");
  EXPECT_EQ(limit(model, "vocab_size").value, 0);  // no config.json
  std::ofstream(dir_ / "hf" / "config.json") << "{not json";
  EXPECT_EQ(limit(model, "vocab_size").value, 0);
  std::ofstream(dir_ / "hf" / "config.json") << R"({"vocab_size": "many", "num_labels": 2.5})";
  EXPECT_EQ(limit(model, "vocab_size").value, 0);
  EXPECT_EQ(limit(model, "num_labels").value, 0);
  // No from_pretrained: the schema's default is what the model is built with.
  const auto plain = model_table({});
  EXPECT_EQ(limit(plain, "vocab_size").value, 30522);
  EXPECT_EQ(limit(plain, "vocab_size").source, "[model] vocab_size (job.toml [model])");
  // No [model] table, or a key its schema lacks (a test plugin's model): no limit.
  EXPECT_EQ(model_limit(nullptr, [](const std::string& p) { return p; }, "vocab_size").value, 0);
  EXPECT_EQ(limit(plain, "n_classes").value, 0);
}

}  // namespace
}  // namespace loom
