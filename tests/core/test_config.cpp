// Job files: parsing, validation against schemas, --set, and the error messages users see.
#include "loom/config.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

std::unique_ptr<Trainer> from(const std::string& toml, const std::vector<std::string>& set = {}) {
  return Trainer::from_text(toml, std::filesystem::temp_directory_path(), set);
}

TEST(Config, ValidJobResolves) {
  TempDir dir;
  auto trainer = from(tiny_gpt_job(dir.str()));
  const std::string text = trainer->describe();
  EXPECT_NE(text.find("model      gpt"), std::string::npos) << text;
  EXPECT_NE(text.find("optimizer  adamw"), std::string::npos) << text;
}

TEST(Config, UnknownKeyNamesLineAndSuggests) {
  EXPECT_THROW_WITH(from("[train]\nmodel = \"gpt\"\nmax_step = 3\n"), ConfigError, "job.toml:3",
                    "unknown key 'max_step' in [train]", "did you mean 'max_steps'");
}

TEST(Config, UnknownKeyOfAProviderSuggests) {
  TempDir dir;
  std::string job = tiny_gpt_job(dir.str());
  job.replace(job.find("seq_len = 16"), 12, "seq_length = 16");
  EXPECT_THROW_WITH(from(job), ConfigError, "unknown key 'seq_length' in [data]",
                    "did you mean 'seq_len'");
}

TEST(Config, WrongTypeIsAnError) {
  EXPECT_THROW_WITH(from("[train]\nmodel = \"gpt\"\nmax_steps = \"ten\"\n"), ConfigError,
                    "job.toml:3", "max_steps must be integer", "\"ten\"");
}

// A whole number written as a float is the integer; a fraction is not.
TEST(Config, WholeFloatsAreIntegers) {
  TempDir dir;
  EXPECT_NE(from(tiny_gpt_job(dir.str()), {"train.max_steps=1e3"})->describe().find("steps      1000"),
            std::string::npos);
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"train.max_steps=2.5"}), ConfigError,
                    "max_steps must be integer", "2.5");
}

TEST(Config, APluginsPathThatIsNoFolderIsNamed) {
  TempDir dir;
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()) + "\n[plugins]\npath = \"no/such/folder\"\n"),
                    ConfigError, "[plugins] path 'no/such/folder' is not a folder");
}

TEST(Config, MissingRequiredKey) {
  EXPECT_THROW_WITH(from("[train]\nmax_steps = 3\n"), ConfigError, "[train] needs 'model'");
  EXPECT_THROW_WITH(from("[model]\nn_layer = 1\n"), ConfigError, "no [train] table");
}

TEST(Config, SyntaxErrorNamesLine) {
  EXPECT_THROW_WITH(from("[train]\nmodel = \"gpt\"\nmax_steps = = 3\n"), ConfigError,
                    "job.toml:3", "invalid TOML");
}

TEST(Config, TopLevelKeyOutsideATable) {
  EXPECT_THROW_WITH(from("model = \"gpt\"\n"), ConfigError, "job.toml:1",
                    "must sit inside a table");
}

TEST(Config, UnknownModelSuggestsAKnownOne) {
  EXPECT_THROW_WITH(from("[train]\nmodel = \"gtp\"\n"), ConfigError, "job.toml:2",
                    "no plugin provides model 'gtp'", "did you mean 'gpt'", "bert");
}

TEST(Config, UnknownTableIsAnUnknownPlugin) {
  TempDir dir;
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()) + "\n[lorra]\nr = 8\n"), ConfigError,
                    "[lorra] names no known plugin", "Plugins found:");
}

TEST(Config, UnknownOptimizerAndDataSource) {
  TempDir dir;
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"optimizer.name=adamm"}), ConfigError,
                    "no plugin provides optimizer 'adamm'", "did you mean 'adamw'");
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"data.source=txt"}), ConfigError,
                    "no plugin provides data source 'txt'", "did you mean 'text'");
}

TEST(Config, SetOverridesAndReportsWhere) {
  TempDir dir;
  auto trainer = from(tiny_gpt_job(dir.str()), {"train.max_steps=9", "model.n_layer=1"});
  EXPECT_EQ(trainer->engine().section("train").get_int("max_steps"), 9);
  EXPECT_EQ(trainer->engine().section("model").get_int("n_layer"), 1);
  EXPECT_EQ(trainer->engine().section("train").where("max_steps"), "--set train.max_steps=9");
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"max_steps=9"}), ConfigError,
                    "must name its table");
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"train.max_steps=many"}), ConfigError,
                    "--set train.max_steps=many", "must be integer");
}

TEST(Config, BadValuesAreNamed) {
  TempDir dir;
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"train.learning_rate=-1"}), ConfigError,
                    "learning_rate must be >= 0, got -1");
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"train.lr_scheduler_type=\"cosin\""}),
                    ConfigError, "lr_scheduler_type 'cosin' is unknown");
  // The update rule is built while the job is prepared (Note [One resolved job]).
  EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), {"optimizer.beta2=1.0"}), ConfigError,
                    "beta2 must be in [0, 1), got 1");
  // Model keys are checked before anything is built (Note [One resolved job]): `loom check`
  // refuses what `loom run` would.
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"model.n_head=3"}, "n_embd 32 must be divisible by n_head 3"},
      {{"model.n_layer=0"}, "n_layer must be positive, got 0"},
      {{"data.seq_len=64"}, "seq_len 64 exceeds [model] n_positions 16"},
      {{"optimizer.weight_decay=-1"}, "weight_decay must be >= 0, got -1"},
      {{"distributed.timeout_seconds=0"}, "timeout_seconds must be positive"},
      {{"train.learning_rate=inf"}, "learning_rate must be a finite number, not inf"},
      {{"model.layer_norm_epsilon=nan"}, "layer_norm_epsilon must be a finite number, not nan"},
      {{"model.n_layer=100000000"}, "fp32 weights alone need"},
      {{"model.n_embd=1000000000000000000", "model.n_head=1"}, "choose smaller sizes"}};
  for (const auto& [overrides, message] : refused)
    EXPECT_THROW_WITH(from(tiny_gpt_job(dir.str()), overrides), ConfigError, message);
}

TEST(Config, ClosestMatch) {
  EXPECT_EQ(closest_match("learning_rat", {"learning_rate", "max_steps"}), "learning_rate");
  EXPECT_EQ(closest_match("zzzzzz", {"learning_rate", "max_steps"}), std::nullopt);
}

TEST(Config, MissingJobFile) {
  EXPECT_THROW_WITH(Trainer::from_file("/nonexistent/job.toml"), ConfigError,
                    "cannot read job file '/nonexistent/job.toml'");
}

}  // namespace
}  // namespace loom
