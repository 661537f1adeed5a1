// Note [TensorBoard events]: report_to = ["tensorboard"] writes every number of metrics.jsonl,
// training and evaluation, under the Trainer's tags (train/x, eval/x), and TensorBoard's own
// reader (the tensorboard package, read_events.py) reads them back, step and float32 value.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "loom/crc32c.h"
#include "loom/trainer.h"
#include "tensorboard.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using json = nlohmann::json;

// The suites' tiny GPT job, evaluating a held-out quarter every 2 of its 4 steps.
std::string job(const std::string& out, const std::string& extra) {
  std::string text = test::tiny_gpt_job(out);
  text.insert(text.find("[model]"), "eval_strategy = \"steps\"\neval_steps = 2\n" + extra + "\n");
  return text + "validation_split = 0.25\n";
}

TEST(TensorBoard, TensorBoardsReaderReadsEveryNumberOfMetricsJsonl) {
  TempDir dir;
  Trainer::from_text(job(dir.str(), "report_to = [\"tensorboard\"]\nlogging_dir = \"tb\"\n"),
                     dir.path())
      ->run();
  // What metrics.jsonl says, by the Trainer's tag.
  std::map<std::string, std::vector<std::pair<int64_t, float>>> expected;
  std::ifstream metrics(dir / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const json row = json::parse(line);
    for (const auto& [key, value] : row.items()) {
      if (key == "step" || !value.is_number()) continue;
      const std::string tag = key.rfind("eval_", 0) == 0 ? "eval/" + key.substr(5) : "train/" + key;
      expected[tag].emplace_back(row["step"].get<int64_t>(), static_cast<float>(value.get<double>()));
    }
  }
  ASSERT_TRUE(expected.count("train/loss") && expected.count("eval/loss"));
  EXPECT_EQ(expected["train/loss"].size(), 4u);
  EXPECT_EQ(expected["eval/loss"].size(), 2u);  // steps 2 and 4
  test::run_command(std::string(LOOM_TEST_PYTHON) + " " + LOOM_SOURCE_DIR +
                    "/tests/core/tensorboard/read_events.py " + (dir / "tb").string() + " " +
                    (dir / "read.json").string());
  const json read = json::parse(test::read_text(dir / "read.json"));
  EXPECT_EQ(read.size(), expected.size()) << read.dump();
  for (const auto& [tag, points] : expected) {
    ASSERT_TRUE(read.contains(tag)) << tag << " is not in the event files";
    ASSERT_EQ(read[tag].size(), points.size()) << tag;
    for (size_t i = 0; i < points.size(); ++i) {
      EXPECT_EQ(read[tag][i][0].get<int64_t>(), points[i].first) << tag;
      EXPECT_EQ(read[tag][i][1].get<float>(), points[i].second) << tag << " at step " << points[i].first;
    }
  }
}

TEST(TensorBoard, FramesCarryCastagnoliChecksumsAndBadReportToIsRefused) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
  TempDir dir;
  EXPECT_THROW_WITH(Trainer::from_text(job(dir.str(), "report_to = [\"wandb\"]\n"), dir.path()),
                    ConfigError, "report_to \"wandb\"", "\"tensorboard\"");
  // Off by default: no event files.
  Trainer::from_text(job(dir.str(), ""), dir.path())->run();
  EXPECT_FALSE(std::filesystem::exists(dir / "runs"));
}

}  // namespace
}  // namespace loom
